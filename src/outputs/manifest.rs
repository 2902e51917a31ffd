//! What a sweep needs to be repeated and trusted: its arguments, the code and crates that ran it, the files it
//! read (sha256) and the machine.

use anyhow::{Context, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// sha256 of a file, or of a folder's files (name and digest of each, sorted by name; sub-folders skipped).
pub fn sha256(path: &Path) -> Result<String> {
    if !path.is_dir() {
        return file_sha256(path);
    }
    let mut names: Vec<_> = std::fs::read_dir(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    let mut h = Sha256::new();
    for p in names {
        h.update(format!("{} {}\n", p.file_name().unwrap_or_default().to_string_lossy(), file_sha256(&p)?));
    }
    Ok(format!("{:x}", h.finalize()))
}

fn file_sha256(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

#[derive(Serialize)]
pub struct Hardware {
    pub cpu: String,
    pub threads: usize,
    pub os: &'static str,
    pub arch: &'static str,
    pub device: String,
    pub engine: crate::engine::EngineKind,
    pub dtype: String,
    /// On a GPU: what `nvidia-smi` says of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Gpu>,
}

#[derive(Serialize)]
pub struct Gpu {
    pub name: String,
    pub driver: String,
    /// The CUDA version the driver supports.
    pub cuda: String,
}

impl Hardware {
    pub fn here(device: &str, engine: crate::engine::EngineKind, dtype: &str) -> Hardware {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
            .unwrap_or_else(|| "unknown".into());
        let gpu = device.starts_with("cuda").then(|| Gpu::of(device)).flatten();
        Hardware {
            cpu,
            threads: crate::engine::cpu::tensor::pool().current_num_threads(),
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
            device: device.into(),
            engine,
            dtype: dtype.into(),
            gpu,
        }
    }
}

impl Gpu {
    /// The GPU `cuda[:N]` names, as `nvidia-smi` reports it (candle exposes neither name nor driver).
    fn of(device: &str) -> Option<Gpu> {
        let index = device.strip_prefix("cuda:").unwrap_or("0");
        let run = |args: &[&str]| -> Option<String> {
            let out = std::process::Command::new("nvidia-smi").args(args).output().ok()?;
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        };
        let query = run(&["--query-gpu=name,driver_version", "--format=csv,noheader", "-i", index])?;
        let (name, driver) = query.trim().split_once(", ")?;
        let banner = run(&[]).unwrap_or_default();
        let cuda = banner.split("CUDA Version:").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or("unknown");
        Some(Gpu { name: name.into(), driver: driver.into(), cuda: cuda.into() })
    }
}

#[derive(Serialize)]
pub struct Manifest<'a> {
    pub frspec: &'static str,
    pub git_commit: &'static str,
    pub crates: BTreeMap<&'static str, &'static str>,
    /// The command line as typed.
    pub command: Vec<String>,
    /// Every setting after presets, sweep file and flags were merged.
    pub settings: &'a serde_json::Value,
    /// sha256 of what was read: model, draft, frequency file, dataset.
    pub files: &'a BTreeMap<String, FileDigest>,
    pub hardware: Hardware,
    /// Sequences decoded together in this invocation.
    pub batch: usize,
    /// Seconds of this invocation, and of all invocations that built the folder (resumes add up).
    pub wall_secs: f64,
    pub total_wall_secs: f64,
    /// Units found finished in the folder when this invocation began.
    pub units_resumed: usize,
    pub units_total: usize,
    /// When the tables were written, seconds since the Unix epoch.
    pub finished_unix: u64,
    /// The shard folders a merged sweep was joined from (`frspec merge`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub merged_from: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct FileDigest {
    pub path: String,
    pub sha256: String,
}

pub fn crate_versions() -> BTreeMap<&'static str, &'static str> {
    env!("FRSPEC_CRATE_VERSIONS").split(',').filter_map(|kv| kv.split_once('=')).collect()
}

impl Manifest<'_> {
    pub const FILE: &'static str = "manifest.json";

    pub fn frspec_version() -> &'static str {
        env!("CARGO_PKG_VERSION")
    }

    pub fn git_commit() -> &'static str {
        env!("FRSPEC_GIT_COMMIT")
    }
}
