//! Frequency sources (frspec, FR-Spec, vLLM fixtures made with torch/numpy) and the keep sets they give.

use frspec::vocab::{Frequencies, KeepRule};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("datasets/fixtures/freq").join(name)
}

// Counts [7, 1, 0, 40, 2, 90, 0, 0, 3, 40, 0, 0, 5, 0, 0, 1]: by count, then id, the ranking is
// 5, 3, 9, 0, 12, 8, 4, 1, 15, then the zero-count ids 2, 6, 7, 10, 11, 13, 14.
const RANKING: [u32; 16] = [5, 3, 9, 0, 12, 8, 4, 1, 15, 2, 6, 7, 10, 11, 13, 14];

#[test]
fn vllm_frequency_tensors_in_every_format_rank_alike() {
    for file in ["token_freq.pt", "token_freq.npy", "token_freq.safetensors", "token_freq_f32.npy", "token_freq_strided.pt"] {
        let f = Frequencies::load(&fixture(file)).unwrap();
        assert_eq!(f.ranking, RANKING, "{file}");
        let keep = f.keep_set(KeepRule::Ratio(0.5), 16, &[]).unwrap();
        assert_eq!(keep.ids, [0, 1, 3, 4, 5, 8, 9, 12], "{file}");
    }
    let f = Frequencies::load(&fixture("token_freq.pt")).unwrap();
    assert_eq!(f.keep_set(KeepRule::Ratio(0.75), 16, &[15]).unwrap().ids, [0, 3, 5, 9, 15], "end-of-turn id kept");
    assert_eq!(f.keep_set(KeepRule::Mass(0.8), 16, &[]).unwrap().ids, [3, 5, 9], "90+40+40 of 189 ≥ 80%");
    assert_eq!(f.keep_set(KeepRule::Ratio(0.0), 16, &[]).unwrap().ids.len(), 16);
    assert!((f.coverage(3).unwrap() - 170.0 / 189.0).abs() < 1e-12);
}

#[test]
fn fr_spec_id_lists_load() {
    let f = Frequencies::load(&fixture("freq_6.pt")).unwrap();
    assert_eq!(f.ranking, [5, 3, 9, 0, 1, 12]);
    assert_eq!(f.keep_set(KeepRule::Ratio(0.75), 16, &[]).unwrap().ids, [0, 3, 5, 9]);
    assert_eq!(f.keep_set(KeepRule::Keep(6), 16, &[]).unwrap().ids, [0, 1, 3, 5, 9, 12]);
    let err = f.keep_set(KeepRule::Ratio(0.5), 16, &[]).unwrap_err().to_string();
    assert!(err.contains("ranks only 6 ids"), "{err}");
    let err = f.keep_set(KeepRule::Mass(0.5), 16, &[]).unwrap_err().to_string();
    assert!(err.contains("no counts"), "{err}");
}

#[test]
fn frspec_files_round_trip_with_metadata() {
    let counts = [7u64, 1, 0, 40, 2, 90, 0, 0, 3, 40, 0, 0, 5, 0, 0, 1];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("freq.safetensors");
    let mut f = Frequencies::from_counts(&counts, &path);
    f.metadata.insert("vocab".into(), "16".into());
    f.metadata.insert("corpus".into(), "test".into());
    f.save(&path).unwrap();
    let back = Frequencies::load(&path).unwrap();
    assert_eq!(back.ranking, RANKING);
    assert_eq!(back.counts, f.counts);
    assert_eq!(back.metadata.get("corpus").map(String::as_str), Some("test"));
    let err = back.keep_set(KeepRule::Ratio(0.5), 32, &[]).unwrap_err().to_string();
    assert!(err.contains("built for a vocabulary of 16") && err.contains("32"), "{err}");

    // Sweeps identify frequency files by sha256: the same frequencies must save to the same bytes, whatever order
    // the metadata map iterates in (each map gets its own hash seed).
    let again = dir.path().join("again.safetensors");
    for key in ["a", "b", "c", "d", "e", "f", "g"] {
        f.metadata.insert(key.into(), key.repeat(3));
    }
    f.save(&path).unwrap();
    let mut g = Frequencies::from_counts(&counts, &again);
    g.metadata = f.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    g.save(&again).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&again).unwrap());
    assert_eq!(Frequencies::load(&again).unwrap().metadata.get("e").map(String::as_str), Some("eee"));
}

#[test]
fn bad_frequency_input_is_refused_with_the_file_named() {
    for (file, vocab, want) in [
        ("out_of_range.pt", 16, "token id 99 is outside the target vocabulary of 16"),
        ("duplicated.pt", 16, "token id 5 appears twice"),
        ("token_freq.npy", 8, "outside the target vocabulary of 8"),
    ] {
        let f = Frequencies::load(&fixture(file)).unwrap();
        let err = f.keep_set(KeepRule::Ratio(0.5), vocab, &[]).unwrap_err().to_string();
        assert!(err.contains(file) && err.contains(want), "{file}: {err}");
    }
    let f = Frequencies::load(&fixture("token_freq.pt")).unwrap();
    // A per-token tensor counted for 16 ids cannot rank a vocabulary of 32: half of it would never be kept.
    let err = f.keep_set(KeepRule::Ratio(0.5), 32, &[]).unwrap_err().to_string();
    assert!(err.contains("token_freq.pt was built for a vocabulary of 16 ids, the target has 32"), "{err}");
    for bad in [KeepRule::Ratio(1.0), KeepRule::Ratio(-0.1), KeepRule::Keep(0), KeepRule::Mass(0.0)] {
        assert!(f.keep_set(bad, 16, &[]).is_err(), "{bad:?}");
    }
    let err = Frequencies::load(&fixture("token_freq_2d.pt")).unwrap_err().to_string();
    assert!(err.contains("token_freq_2d.pt: a frequency tensor must be 1-D") && err.contains("[4, 4]"), "{err}");
    let err = Frequencies::load(&fixture("missing.pt")).unwrap_err().to_string();
    assert!(err.contains("missing.pt") && err.contains("does not exist"), "{err}");
    let err = Frequencies::load(&fixture("README.md")).unwrap_err().to_string();
    assert!(err.contains("unknown frequency file type"), "{err}");
}

#[test]
fn large_float_frequencies_keep_their_order() {
    // Float values far above probabilities (raw counts stored as f64) once saturated when scaled to integers, so the
    // three largest tied and ranked by id.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("freq.safetensors");
    let values = candle_core::Tensor::new(&[1e10f64, 3e10, 2e10, 5.0], &candle_core::Device::Cpu).unwrap();
    candle_core::safetensors::save(&std::collections::HashMap::from([("freq".to_string(), values)]), &path).unwrap();
    let f = Frequencies::load(&path).unwrap();
    assert_eq!(f.ranking, [1, 2, 0, 3]);
    assert_eq!(f.keep_set(KeepRule::Mass(0.8), 4, &[]).unwrap().ids, [1, 2], "3e10 + 2e10 of 6e10 ≥ 80%");
}
