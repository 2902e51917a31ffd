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
    pub fn differences(&self, other: &Identity) -> Vec<String> {
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
    /// Locked while this sweep writes the folder.
    _lock: std::fs::File,
}

const UNITS: &str = "units";
const IDENTITY: &str = "sweep.json";
/// Held locked (an advisory lock, released when the process ends, however it ends) while a sweep writes the folder.
const LOCK: &str = "lock";
/// Everything a sweep writes into its folder; `--overwrite` removes exactly these.
const OWN: [&str; 6] = [UNITS, store::RUNS, store::SUMMARY, store::TIMINGS, store::TIMING_SUMMARY, crate::outputs::manifest::Manifest::FILE];

/// What opening a folder found: the units already finished in it (and the seconds each took), and the journal
/// entries it will redo or ignore, with why.
pub struct Journal {
    pub done: BTreeMap<UnitKey, f64>,
    pub notes: Vec<String>,
}

impl Folder {
    /// Open `dir` for the sweep `identity` and hold it (a second sweep cannot open it until this one ends).
    pub fn open(dir: &Path, identity: &Identity, mode: FolderMode, all_units: &[UnitKey]) -> Result<(Folder, Journal)> {
        let occupied = match dir.read_dir() {
            Ok(mut entries) => entries.next().is_some(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => bail!("cannot read --out {}: {e}", dir.display()),
        };
        let units = dir.join(UNITS);
        if occupied {
            let id_path = units.join(IDENTITY);
            if !id_path.exists() {
                bail!("{} exists and does not hold a frspec sweep: choose another --out", dir.display());
            }
        }
        std::fs::create_dir_all(&units).with_context(|| format!("cannot create {}", units.display()))?;
        let lock_path = units.join(LOCK);
        let lock = std::fs::File::create(&lock_path).with_context(|| format!("cannot create {}", lock_path.display()))?;
        if let Err(e) = lock.try_lock() {
            bail!("{} is being written by another sweep ({e}): wait for it to end, or choose another --out", dir.display());
        }
        let folder = Folder { dir: dir.to_path_buf(), _lock: lock };
        let fresh = Journal { done: BTreeMap::new(), notes: Vec::new() };
        if occupied {
            let id_path = folder.units().join(IDENTITY);
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
                    let journal = folder.finished(all_units)?;
                    return Ok((folder, journal));
                }
                FolderMode::Fresh => {
                    let done = folder.finished(all_units)?.done.len();
                    bail!(
                        "{} already holds this sweep ({done} of {} units finished): pass --resume to continue it or --overwrite to start again",
                        dir.display(),
                        all_units.len()
                    );
                }
            }
        }
        write_atomic(&folder.units().join(IDENTITY), serde_json::to_string_pretty(identity)?.as_bytes())?;
        Ok((folder, fresh))
    }

    fn units(&self) -> PathBuf {
        self.dir.join(UNITS)
    }

    /// Remove what the sweep wrote, all but the lock this one holds.
    fn clear(&self) -> Result<()> {
        let journal = std::fs::read_dir(self.units()).with_context(|| format!("cannot read {}", self.units().display()))?;
        let entries = journal.map(|e| Ok(e?.path())).collect::<std::io::Result<Vec<_>>>()?;
        let own = OWN.iter().filter(|n| **n != UNITS).map(|n| self.dir.join(n));
        for p in entries.into_iter().filter(|p| !p.ends_with(LOCK)).chain(own) {
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

    fn finished(&self, all_units: &[UnitKey]) -> Result<Journal> {
        journal(&self.dir, all_units)
    }

    /// Copy `units`' journal entries from the shard folder `shard` (`frspec merge`), returning the seconds each took;
    /// each is read back first, so a damaged one stops the merge.
    pub fn adopt(&self, shard: &Path, units: &[UnitKey]) -> Result<BTreeMap<UnitKey, f64>> {
        let mut done = BTreeMap::new();
        for key in units {
            let path = shard.join(UNITS).join(key.file_name());
            let unit = read_unit(&path)?;
            write_atomic(&self.units().join(key.file_name()), &std::fs::read(&path)?)?;
            done.insert(*key, unit.secs);
        }
        Ok(done)
    }

    /// Every journalled run of `units`, read back from disk whether this invocation or an earlier one made it, so a
    /// resumed sweep and an uninterrupted one assemble the same tables.
    pub fn runs(&self, units: &[UnitKey]) -> Result<Vec<Run>> {
        let mut runs = Vec::new();
        for key in units {
            runs.extend(read_unit(&self.units().join(key.file_name()))?.runs);
        }
        Ok(runs)
    }
}

/// The identity of the sweep in folder `dir`.
pub fn identity(dir: &Path) -> Result<Identity> {
    let path = dir.join(UNITS).join(IDENTITY);
    let text = std::fs::read_to_string(&path).with_context(|| format!("{} holds no frspec sweep (cannot read {})", dir.display(), path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow!("{} is not a sweep identity: {e}", path.display()))
}

/// The finished units in folder `dir`'s journal and the seconds each took, read without taking the folder. An entry
/// that cannot be read back as the unit its name says is noted (a sweep redoes it); so is an entry the plan has no
/// unit for (left alone).
pub fn journal(dir: &Path, all_units: &[UnitKey]) -> Result<Journal> {
    let units = dir.join(UNITS);
    let names: BTreeSet<String> = all_units.iter().map(UnitKey::file_name).collect();
    let mut journal = Journal { done: BTreeMap::new(), notes: Vec::new() };
    for entry in std::fs::read_dir(&units).with_context(|| format!("cannot read {}", units.display()))? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        if name == IDENTITY || name == LOCK || path.extension().is_some_and(|e| e == "partial") {
            continue;
        }
        if !names.contains(&name) {
            journal.notes.push(format!("ignoring {}: not a unit of this sweep", path.display()));
            continue;
        }
        match read_unit(&path) {
            Ok(unit) if unit.key.file_name() == name => {
                journal.done.insert(unit.key, unit.secs);
            }
            Ok(_) => journal.notes.push(format!("redoing {name}: its journal entry holds another unit")),
            Err(e) => journal.notes.push(format!("redoing {name}: {e:#}")),
        }
    }
    Ok(journal)
}

fn read_unit(path: &Path) -> Result<UnitFile> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let unit: UnitFile = serde_json::from_slice(&bytes).map_err(|e| anyhow!("{} is damaged ({e})", path.display()))?;
    for run in &unit.runs {
        run.record.check().map_err(|why| anyhow!("{} is damaged ({why})", path.display()))?;
    }
    Ok(unit)
}
