//! File helpers every writer shares.

use anyhow::{Context, Result};
use std::path::Path;

/// Write `bytes` to `path` through a temporary file in the same folder and a rename, so a reader never sees half a
/// file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot move {} into place", path.display()))
}
