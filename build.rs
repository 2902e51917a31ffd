//! Records, for sweep manifests, the git commit the binary was built from and the versions of the crates that
//! shape its numbers (read from Cargo.lock, which cargo itself does not expose to the crate). With feature `cuda`,
//! builds the candle engine's own kernels to PTX with nvcc (as candle-kernels does for candle's).

fn main() {
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda_kernels();
    }
    println!("cargo:rerun-if-changed=Cargo.lock");
    // Only paths that exist: cargo reruns a build script every time for a missing one, and with it recompiles the
    // crate (a checkout without .git/packed-refs rebuilt frspec on every cargo command).
    for git in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"].into_iter().filter(|p| std::path::Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={git}");
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FRSPEC_GIT_COMMIT={commit}");

    const CRATES: [&str; 8] = ["candle-core", "polars", "tokenizers", "hf-hub", "rand_chacha", "statrs", "minijinja", "safetensors"];
    let lock = std::fs::read_to_string("Cargo.lock").unwrap_or_default();
    let mut versions = Vec::new();
    let mut name = None;
    for line in lock.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            if CRATES.contains(&n.as_str()) {
                versions.push(format!("{n}={}", v.trim_matches('"')));
            }
        }
    }
    println!("cargo:rustc-env=FRSPEC_CRATE_VERSIONS={}", versions.join(","));
}

/// src/engine/candle/kernels.cu → $OUT_DIR/frspec_kernels.ptx for compute capability $CUDA_COMPUTE_CAP (default 90).
fn cuda_kernels() {
    const SOURCE: &str = "src/engine/candle/kernels.cu";
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var_os("CUDA_HOME").map_or_else(|| "nvcc".into(), |home| std::path::Path::new(&home).join("bin/nvcc"));
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("frspec_kernels.ptx");
    let status = std::process::Command::new(&nvcc)
        .args(["--ptx", "-O3", &format!("-arch=sm_{cap}"), "-o"])
        .arg(&out)
        .arg(SOURCE)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (scripts/cuda-toolchain.sh sets CUDA_HOME)", nvcc.display()));
    assert!(status.success(), "nvcc failed on {SOURCE}");
}
