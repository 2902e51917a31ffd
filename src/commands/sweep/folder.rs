//! A sweep's output folder. Each finished unit is journalled atomically under units/, next to the sweep's
//! identity (settings and the digests of the files it read); `--resume` picks up the finished units, and a folder
//! made by another sweep is refused unless `--overwrite` says to replace it.

use crate::sweep::{Run, UnitKey};
use crate::outputs::manifest::FileDigest;
use crate::files::write_atomic;
use crate::outputs::store;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FolderMode {
    /// Refuse a folder that already holds a sweep.
    Fresh,
    /// Continue the same sweep; refuse another one.
    Resume,
    /// Replace whatever sweep the folder holds.
    Overwrite,
}

/// What makes two sweeps the same sweep.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    pub settings: serde_json::Value,
    pub files: BTreeMap<String, FileDigest>,
}

impl Identity {
    /// What differs from `other`, one phrase per setting or file.
    fn differences(&self, other: &Identity) -> Vec<String> {
        let mut out = Vec::new();
        let (a, b) = (self.settings.as_object(), other.settings.as_object());
        for (key, value) in a.into_iter().flatten() {
            let theirs = b.and_then(|b| b.get(key)).unwrap_or(&serde_json::Value::Null);
            if theirs != value {
                out.push(format!("{key}: {theirs} → {value}"));
            }
        }
        for (role, digest) in &self.files {
            if other.files.get(role).map(|d| &d.sha256) != Some(&digest.sha256) {
                out.push(format!("{role} file {} has other contents", digest.path));
            }
        }
        out
    }
}

/// One finished unit as journalled.
#[derive(Serialize, Deserialize)]
struct UnitFile {
    key: UnitKey,
    secs: f64,
    runs: Vec<Run>,
}

pub struct Folder {
    dir: PathBuf,
}

const UNITS: &str = "units";
const IDENTITY: &str = "sweep.json";
/// Everything a sweep writes into its folder; `--overwrite` removes exactly these.
const OWN: [&str; 6] = [UNITS, store::RUNS, store::SUMMARY, store::TIMINGS, store::TIMING_SUMMARY, crate::outputs::manifest::Manifest::FILE];

impl Folder {
    /// Open `dir` for the sweep `identity`; returns the folder and the units already finished in it.
    pub fn open(dir: &Path, identity: &Identity, mode: FolderMode, all_units: &[UnitKey]) -> Result<(Folder, BTreeMap<UnitKey, f64>)> {
        let folder = Folder { dir: dir.to_path_buf() };
        let occupied = dir.read_dir().map(|mut d| d.next().is_some()).unwrap_or(false);
        if occupied {
            let id_path = folder.units().join(IDENTITY);
            if !id_path.exists() {
                bail!("{} exists and does not hold a frspec sweep: choose another --out", dir.display());
            }
            let text = std::fs::read_to_string(&id_path).with_context(|| format!("cannot read {}", id_path.display()))?;
            let theirs: Identity = serde_json::from_str(&text).map_err(|e| anyhow!("{} is not a sweep identity: {e}", id_path.display()))?;
            let differences = identity.differences(&theirs);
            match mode {
                FolderMode::Overwrite => folder.clear()?,
                _ if !differences.is_empty() => bail!(
                    "{} holds a sweep made with other arguments ({}): pass --overwrite to replace it, or choose another --out",
                    dir.display(),
                    differences.join("; ")
                ),
                FolderMode::Resume => {
                    let done = folder.finished(all_units)?;
                    return Ok((folder, done));
                }
                FolderMode::Fresh => {
                    let done = folder.finished(all_units)?.len();
                    bail!(
                        "{} already holds this sweep ({done} of {} units finished): pass --resume to continue it or --overwrite to start again",
                        dir.display(),
                        all_units.len()
                    );
                }
            }
        }
        std::fs::create_dir_all(folder.units()).with_context(|| format!("cannot create {}", folder.units().display()))?;
        write_atomic(&folder.units().join(IDENTITY), serde_json::to_string_pretty(identity)?.as_bytes())?;
        Ok((folder, BTreeMap::new()))
    }

    fn units(&self) -> PathBuf {
        self.dir.join(UNITS)
    }

    fn clear(&self) -> Result<()> {
        for name in OWN {
            let p = self.dir.join(name);
            let gone = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            match gone {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).with_context(|| format!("cannot remove {}", p.display())),
                _ => {}
            }
        }
        Ok(())
    }

    /// Journal one finished unit; it took `secs`.
    pub fn save_unit(&self, key: UnitKey, secs: f64, runs: Vec<Run>) -> Result<()> {
        let bytes = serde_json::to_vec(&UnitFile { key, secs, runs })?;
        write_atomic(&self.units().join(key.file_name()), &bytes)
    }

    /// Finished units and the seconds each took. A unit the plan does not have means the journal is not this sweep's.
    fn finished(&self, all_units: &[UnitKey]) -> Result<BTreeMap<UnitKey, f64>> {
        let names: BTreeSet<String> = all_units.iter().map(UnitKey::file_name).collect();
        let mut done = BTreeMap::new();
        for entry in std::fs::read_dir(self.units()).with_context(|| format!("cannot read {}", self.units().display()))? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
            if name == IDENTITY || path.extension().is_some_and(|e| e == "partial") {
                continue;
            }
            if !names.contains(&name) {
                bail!("{} is not a unit of this sweep: the journal is damaged; pass --overwrite to start again", path.display());
            }
            let unit = self.read_unit(&path)?;
            done.insert(unit.key, unit.secs);
        }
        Ok(done)
    }

    fn read_unit(&self, path: &Path) -> Result<UnitFile> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_slice(&bytes).map_err(|e| anyhow!("{} is damaged ({e}): pass --overwrite to start again", path.display()))
    }

    /// Every journalled run of `units`, read back from disk whether this invocation or an earlier one made it, so a
    /// resumed sweep and an uninterrupted one assemble the same tables.
    pub fn runs(&self, units: &[UnitKey]) -> Result<Vec<Run>> {
        let mut runs = Vec::new();
        for key in units {
            runs.extend(self.read_unit(&self.units().join(key.file_name()))?.runs);
        }
        Ok(runs)
    }
}
