//! `frspec bench head` writes its grid (no timing is asserted: speed is measured, never tested).

mod common;
use common::frspec;

#[test]
fn head_benchmark_writes_every_keep_size_and_batch() {
    let dir = tempfile::tempdir().unwrap();
    let out = frspec()
        .args(["bench", "head", "--hidden", "64", "--vocab", "1000", "--batch", "1,4,16", "--ratios", "0,0.5,0.99", "--dtype", "f16"])
        .args(["--out", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let df = frspec::outputs::store::read(&dir.path().join("head.parquet")).unwrap();
    assert_eq!(df.height(), 3 * 3);
    let kept: Vec<u64> = df.column("kept").unwrap().u64().unwrap().into_no_null_iter().collect();
    // ⌈(1 − 0.99)·1000⌉ = 11 in f64, as in vLLM's Python.
    assert_eq!(kept, [1000, 1000, 1000, 500, 500, 500, 11, 11, 11]);
    let flops: Vec<f64> = df.column("flops").unwrap().f64().unwrap().into_no_null_iter().collect();
    assert_eq!(flops[1], 2.0 * 4.0 * 64.0 * 1000.0);
    assert!(dir.path().join("head_latency.png").exists() && dir.path().join("head_latency.svg").exists());

    // Every block-quantized type the CPU kernels run, K-quants on rows of whole 256-value super-blocks.
    for dtype in ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"] {
        let out = frspec().args(["bench", "head", "--hidden", "256", "--vocab", "64", "--batch", "1,5", "--ratios", "0", "--dtype", dtype]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains(&format!("{dtype} weights")), "{dtype}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let hidden = ["--hidden", "96", "--dtype", "q4_k"];
    for (flag, value, expect) in [("--dtype", "bf16", "q5_k or q6_k"), ("--hidden", "0", "at least 1"), ("--device", "cuda:0", "without CUDA"), (hidden[0], hidden[1], "multiple of 256")] {
        let extra: &[&str] = if value == "96" { &hidden[2..] } else { &[] };
        let out = frspec().args(["bench", "head", "--vocab", "1000", "--batch", "1", flag, value]).args(extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(1) && err.contains(expect), "{flag} {value}: {err}");
    }
}
