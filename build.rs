//! Records, for sweep manifests, the git commit the binary was built from and the versions of the crates that
//! shape its numbers (read from Cargo.lock, which cargo itself does not expose to the crate).

fn main() {
    println!("cargo:rerun-if-changed=Cargo.lock");
    for git in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
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
