//! frspec's CUDA kernels for the cache write, attention, argmax and matrix-vector products, as written in
//! src/engine/candle/kernels.cu, run on the CPU by an emulation of their threads (tests/cuda_emulation/kernels.cpp)
//! and checked against references computed there: no GPU is lent to CI.

use std::path::Path;
use std::process::Command;

/// The text of `source` from the line that starts with `from` up to (not including) the line that starts with `to`.
fn cut<'a>(source: &'a str, from: &str, to: &str) -> &'a str {
    let start = source.find(from).unwrap_or_else(|| panic!("kernels.cu no longer has a line starting {from:?}"));
    let end = start + source[start..].find(to).unwrap_or_else(|| panic!("kernels.cu no longer has a line starting {to:?}"));
    &source[start..end]
}

#[test]
fn kernels_equal_their_references() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let kernels = std::fs::read_to_string(root.join("src/engine/candle/kernels.cu")).expect("kernels.cu");
    // RoPE's pair rotation, the block reduction, the cache write, the attention, argmax and matrix-vector kernels, with
    // CUDA's block-shared memory made the emulation's.
    let snippet = [
        cut(&kernels, "// Pair j of a head x", "// Rows of qkv [n, width]: the first"),
        cut(&kernels, "// Sum (or max) over the block", "#define FRSPEC_KERNELS"),
    ]
    .concat()
    .replace("extern __shared__ float shared[];", "float *shared = g_shared;")
    .replace("__shared__", "static");
    let dir = tempfile::tempdir().expect("temporary folder");
    std::fs::write(dir.path().join("kernel_snippet.h"), snippet).expect("write the kernel");
    let harness = root.join("tests/cuda_emulation/kernels.cpp");
    let binary = dir.path().join("kernels");
    let built = Command::new("g++")
        .args(["-std=c++20", "-O1", "-pthread", "-I"])
        .arg(dir.path())
        .arg(&harness)
        .arg("-o")
        .arg(&binary)
        .output()
        .expect("g++ runs (a C++20 compiler is needed for this test)");
    assert!(built.status.success(), "g++ failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let ran = Command::new(&binary).output().expect("the emulation runs");
    let report = String::from_utf8_lossy(&ran.stdout);
    assert!(ran.status.success(), "a kernel's outputs differ from its reference:\n{report}");
    assert_eq!(report.lines().filter(|l| l.ends_with("(ok)")).count(), 16, "{report}");
}
