//! Mutation fuzzing of every parser of outside bytes: GGUF (header, tensors, the model it describes), safetensors,
//! its index and a model's config.json, torch pickles (as frequency files and as EAGLE checkpoints), `.npy`, dataset JSONL, sweep TOML, `--speculative-config` JSON and a sweep
//! folder's journal. Each target starts from valid seeds, applies a few random mutations per execution (bit flips,
//! boundary integers, inserted, removed, repeated or truncated bytes) and asserts: no panic, and no more memory than
//! `16 MiB + 32 × input size` at any moment. (That each error is one line naming the file is tests/hostile.rs's.)
//!
//! A deterministic ChaCha stream drives the mutations, so a failure repeats. Time per target: FRSPEC_FUZZ_SECS
//! (default 4 s in the test suite); `FRSPEC_FUZZ_SECS=300 cargo test --release --test fuzz -- --nocapture` is the
//! long run. Crashing inputs are written to target/fuzz-crashes/ and the test fails naming them.
//!
//! Written as an ordinary test rather than with cargo-fuzz: cargo-fuzz needs a nightly toolchain and libFuzzer,
//! which CI does not have; this runs everywhere `cargo test` does.

mod common;
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};
use frspec::engine::cpu::model::Model;
use frspec::loading::pickle::TorchFile;
use frspec::loading::weights::{Gguf, Safetensors, WeightSource};
use frspec::spec::{resolve, SweepSpec};
use frspec::vocab::Frequencies;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Counts live heap bytes and their peak, so each execution's high-water mark can be checked against its input.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn memory_bound(input_len: usize) -> usize {
    (16 << 20) + 32 * input_len
}

/// One parser under test: its seeds, the name the mutated bytes are written under, and how the CLI would read them.
struct Target {
    name: &'static str,
    seeds: Vec<Vec<u8>>,
    /// The file name inside the execution's folder (the extension picks the reader).
    file: &'static str,
    parse: Box<dyn Fn(&Path) -> anyhow::Result<()>>,
}

fn fixture(rel: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

fn tiny_gguf() -> Vec<u8> {
    let weight = QTensor::quantize(&Tensor::arange(0f32, 64., &Device::Cpu).unwrap().reshape((2, 32)).unwrap(), candle_core::quantized::GgmlDType::Q4_0).unwrap();
    let norm = QTensor::quantize(&Tensor::ones(32, candle_core::DType::F32, &Device::Cpu).unwrap(), candle_core::quantized::GgmlDType::F32).unwrap();
    let arch = gguf_file::Value::String("llama".into());
    let layers = gguf_file::Value::U32(1);
    let tokens = gguf_file::Value::Array(vec![gguf_file::Value::String("a".into()), gguf_file::Value::String("b".into())]);
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(
        &mut out,
        &[("general.architecture", &arch), ("llama.block_count", &layers), ("tokenizer.ggml.tokens", &tokens)],
        &[("token_embd.weight", &weight), ("output_norm.weight", &norm)],
    )
    .unwrap();
    out.into_inner()
}

/// A model folder whose index names its one shard.
fn index_seed() -> Vec<u8> {
    br#"{"metadata": {"total_size": 317000}, "weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": "model.safetensors"}}"#.to_vec()
}

fn targets() -> Vec<Target> {
    let tiny = "datasets/fixtures/tiny-llama/model.safetensors";
    vec![
        Target {
            name: "gguf",
            seeds: vec![tiny_gguf()],
            file: "model.gguf",
            parse: Box::new(|p| {
                let gguf = Gguf::open(p)?;
                let mut file = std::fs::File::open(p)?;
                for name in gguf.content.tensor_infos.keys() {
                    gguf.content.tensor(&mut file, name, &Device::Cpu)?;
                }
                Ok(())
            }),
        },
        Target {
            name: "gguf model",
            seeds: vec![fixture("tests/hostile/_aux/tiny.gguf")],
            file: "model.gguf",
            parse: Box::new(|p| Model::load(p).map(drop)),
        },
        Target {
            name: "model config.json",
            seeds: vec![fixture("tests/hostile/_aux/tiny-target/config.json")],
            file: "config.json",
            parse: Box::new(|p| {
                let folder = p.parent().unwrap();
                let weights = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hostile/_aux/tiny-target/model.safetensors");
                std::fs::copy(weights, folder.join("model.safetensors"))?;
                Model::load(folder).map(drop)
            }),
        },
        Target {
            name: "safetensors",
            seeds: vec![fixture(tiny)],
            file: "model.safetensors",
            parse: Box::new(|p| {
                Safetensors::open(p)?.vector("token_embd.weight")?;
                Ok(())
            }),
        },
        Target {
            name: "safetensors index",
            seeds: vec![index_seed()],
            file: "model.safetensors.index.json",
            parse: Box::new(move |p| {
                let folder = p.parent().unwrap();
                std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(tiny), folder.join("model.safetensors"))?;
                Safetensors::open(folder)?;
                Ok(())
            }),
        },
        Target {
            name: "pickle (checkpoint)",
            seeds: vec![fixture("datasets/fixtures/eagle1-tiny/pytorch_model.bin"), fixture("datasets/fixtures/eagle3-tiny/pytorch_model.bin")],
            file: "pytorch_model.bin",
            parse: Box::new(|p| TorchFile::open(p)?.state_dict().map(drop)),
        },
        Target {
            name: "pickle (frequencies)",
            seeds: ["freq_6.pt", "token_freq.pt", "token_freq_strided.pt"]
                .iter()
                .map(|f| fixture(&format!("datasets/fixtures/freq/{f}")))
                .collect(),
            file: "freq.pt",
            parse: Box::new(|p| Frequencies::load(p).map(drop)),
        },
        Target {
            name: "frequency safetensors",
            seeds: vec![fixture("datasets/fixtures/freq/token_freq.safetensors")],
            file: "freq.safetensors",
            parse: Box::new(|p| Frequencies::load(p).map(drop)),
        },
        pickle_stream("pickle stream (checkpoint)", "datasets/fixtures/eagle1-tiny/pytorch_model.bin", |p| TorchFile::open(p)?.state_dict().map(drop)),
        pickle_stream("pickle stream (frequencies)", "datasets/fixtures/freq/token_freq.pt", |p| Frequencies::load(p).map(drop)),
        pickle_stream("pickle stream (id list)", "datasets/fixtures/freq/freq_6.pt", |p| Frequencies::load(p).map(drop)),
        Target {
            name: "npy",
            seeds: vec![fixture("datasets/fixtures/freq/token_freq.npy"), fixture("datasets/fixtures/freq/token_freq_f32.npy")],
            file: "freq.npy",
            parse: Box::new(|p| Frequencies::load(p).map(drop)),
        },
        Target {
            name: "dataset jsonl",
            seeds: vec![std::fs::read_to_string(common::asset("mt-bench")).unwrap().lines().take(3).collect::<Vec<_>>().join("\n").into_bytes()],
            file: "questions.jsonl",
            parse: Box::new(|p| frspec::text::dataset::load(p.to_str().unwrap()).map(drop)),
        },
        Target {
            name: "sweep toml",
            seeds: ["smollm2-default.toml", "ci-regression.toml", "llama31-eagle.toml"].iter().map(|f| fixture(&format!("sweeps/{f}"))).collect(),
            file: "sweep.toml",
            parse: Box::new(|p| resolve(Some(&SweepSpec::from_toml_file(p)?), None, &SweepSpec::default()).map(drop)),
        },
        Target {
            name: "speculative-config json",
            seeds: vec![br#"{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4, "token_ids_by_frequency": "freq.pt", "pruning_ratio": 0.75, "draft_tensor_parallel_size": 1}"#.to_vec()],
            file: "config.json",
            parse: Box::new(|p| {
                let text = std::fs::read_to_string(p)?;
                let (spec, _) = SweepSpec::from_vllm(&text)?;
                resolve(None, Some(&spec), &SweepSpec::default()).map(drop)
            }),
        },
        journal_target(),
    ]
}

/// The pickle inside a torch file mutated and the archive rebuilt around it (the same storages, correct CRCs), so
/// that the mutations reach the pickle reader instead of stopping at the zip's checksum.
fn pickle_stream(name: &'static str, archive: &'static str, parse: fn(&Path) -> anyhow::Result<()>) -> Target {
    use std::io::{Read, Write};
    let archive = Path::new(env!("CARGO_MANIFEST_DIR")).join(archive);
    let mut zip = zip::ZipArchive::new(std::fs::File::open(&archive).unwrap()).unwrap();
    let pkl = zip.file_names().map(|n| n.unwrap().to_string()).find(|n| n.ends_with("data.pkl")).unwrap();
    let mut seed = Vec::new();
    zip.by_name(&pkl).unwrap().read_to_end(&mut seed).unwrap();
    Target {
        name,
        seeds: vec![seed],
        file: "data.pkl",
        parse: Box::new(move |p| {
            let pickle = std::fs::read(p)?;
            let mut from = zip::ZipArchive::new(std::fs::File::open(&archive)?)?;
            let rebuilt = p.with_extension("pt");
            let mut to = zip::ZipWriter::new(std::fs::File::create(&rebuilt)?);
            let stored = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
            for i in 0..from.len() {
                let mut entry = from.by_index(i)?;
                let entry_name = entry.name()?.to_string();
                to.start_file(entry_name.as_str(), stored)?;
                match entry_name == pkl {
                    true => to.write_all(&pickle)?,
                    false => drop(std::io::copy(&mut entry, &mut to)?),
                }
            }
            to.finish()?;
            parse(&rebuilt)
        }),
    }
}

/// A sweep folder holding one finished unit; the mutated bytes replace that unit's journal entry, and the folder is
/// resumed and its runs read back as `sweep --resume` does.
fn journal_target() -> Target {
    use frspec::commands::sweep::folder::{Folder, FolderMode, Identity};
    use frspec::speculative::decode::TurnRecord;
    use frspec::sweep::{Run, UnitKey};
    let identity = Identity { settings: serde_json::json!({"seed": 0}), files: Default::default() };
    let unit = UnitKey { temperature: 0, prompt: 0, repeat: None };
    let record = TurnRecord { prompt_tokens: 12, generated: 30, drafts: 10, draft_tokens: 40, accepted: 20, accepted_per_pos: vec![9, 6, 3, 2], expected_accepted: 19.5, stop: None, draft_secs: 0.1, target_secs: 0.2 };
    let run = Run { ratio: 0.5, temperature: 0.0, repeat: 0, prompt_index: 0, prompt: "81".into(), turn: 0, record };
    let seed_dir = tempfile::tempdir().unwrap();
    let (folder, _) = Folder::open(seed_dir.path(), &identity, FolderMode::Fresh, &[unit]).unwrap();
    folder.save_unit(unit, 1.5, vec![run]).unwrap();
    drop(folder);
    let entry = seed_dir.path().join("units").join(unit.file_name());
    Target {
        name: "sweep journal",
        seeds: vec![std::fs::read(&entry).unwrap()],
        file: "journal-entry.json",
        parse: Box::new(move |p| {
            let dir = p.parent().unwrap().join("out");
            let (folder, _) = Folder::open(&dir, &identity, FolderMode::Fresh, &[unit])?;
            std::fs::copy(p, dir.join("units").join(unit.file_name()))?;
            drop(folder);
            let (folder, journal) = Folder::open(&dir, &identity, FolderMode::Resume, &[unit])?;
            if let Some(note) = journal.notes.first() {
                anyhow::bail!("{note}");
            }
            let done: Vec<UnitKey> = journal.done.keys().copied().collect();
            folder.runs(&done).map(drop)
        }),
    }
}

/// A few random edits of `seed`: the kinds of damage that find length and offset bugs.
fn mutate(seed: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut data = seed.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let at = if data.is_empty() { 0 } else { rng.random_range(0..data.len()) };
        match rng.random_range(0..7) {
            0 if !data.is_empty() => data[at] ^= 1 << rng.random_range(0..8),
            1 if !data.is_empty() => data[at] = [0x00, 0xff, 0x7f, 0x80, b'"', b'\n'][rng.random_range(0..6)],
            2 if data.len() >= at + 8 => {
                let boundary: u64 = [0, 1, u32::MAX as u64, i32::MAX as u64, 1 << 31, u64::MAX, i64::MAX as u64, data.len() as u64][rng.random_range(0..8)];
                let width = [1, 2, 4, 8][rng.random_range(0..4)];
                data[at..at + width].copy_from_slice(&boundary.to_le_bytes()[..width]);
            }
            3 => {
                let n = rng.random_range(1..=16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                data.splice(at..at, bytes);
            }
            4 if !data.is_empty() => {
                let end = (at + rng.random_range(1..=32)).min(data.len());
                data.drain(at..end);
            }
            5 if !data.is_empty() => {
                let end = (at + rng.random_range(1..=64)).min(data.len());
                let copy = data[at..end].to_vec();
                let to = rng.random_range(0..=data.len());
                data.splice(to..to, copy);
            }
            _ => data.truncate(at),
        }
    }
    data
}

/// What one target's run found.
struct Outcome {
    executions: usize,
    rejected: usize,
    crashes: Vec<PathBuf>,
}

fn fuzz(target: &Target, seconds: f64, rng: &mut ChaCha8Rng, crash_dir: &Path) -> Outcome {
    let work = tempfile::tempdir().unwrap();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut outcome = Outcome { executions: 0, rejected: 0, crashes: Vec::new() };
    // Seeds first, unmutated: they must parse.
    let mut inputs = target.seeds.iter().cloned().map(|s| (s, true)).collect::<Vec<_>>().into_iter();
    while Instant::now() < deadline || inputs.len() > 0 {
        let (input, must_parse) = inputs.next().unwrap_or_else(|| (mutate(&target.seeds[rng.random_range(0..target.seeds.len())], rng), false));
        let dir = work.path().join(outcome.executions.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(target.file);
        std::fs::write(&path, &input).unwrap();
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (target.parse)(&path)));
        let used = PEAK.load(Ordering::Relaxed).saturating_sub(before);
        let failure = match result {
            Err(_) => Some("panicked".to_string()),
            Ok(Ok(())) if must_parse || used <= memory_bound(input.len()) => None,
            Ok(Err(e)) if must_parse => Some(format!("a seed did not parse: {e:#}")),
            Ok(Err(_)) if used <= memory_bound(input.len()) => {
                outcome.rejected += 1;
                None
            }
            _ => Some(format!("used {used} bytes for a {}-byte input", input.len())),
        };
        if let Some(why) = failure {
            let saved = crash_dir.join(format!("{}-{}", target.name.replace([' ', '(', ')'], "_"), outcome.executions));
            std::fs::write(&saved, &input).unwrap();
            eprintln!("{}: {why}; input saved as {}", target.name, saved.display());
            outcome.crashes.push(saved);
        }
        std::fs::remove_dir_all(&dir).unwrap();
        outcome.executions += 1;
    }
    outcome
}

#[test]
fn every_parser_of_outside_bytes_survives_mutated_inputs() {
    // candle and anyhow capture a backtrace with every error when RUST_BACKTRACE is set, and resolving one takes
    // ~180 MB: that is the debugging aid's memory, not the parser's.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    let seconds: f64 = std::env::var("FRSPEC_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(4.0);
    let crash_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-crashes");
    std::fs::create_dir_all(&crash_dir).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let mut crashes = Vec::new();
    for target in targets() {
        let started = Instant::now();
        let outcome = fuzz(&target, seconds, &mut rng, &crash_dir);
        println!(
            "{:<28} {} seeds, {:>7} executions in {:.1} s, {:>7} rejected with an error, {} crashes",
            target.name,
            target.seeds.len(),
            outcome.executions,
            started.elapsed().as_secs_f64(),
            outcome.rejected,
            outcome.crashes.len()
        );
        crashes.extend(outcome.crashes);
    }
    assert!(crashes.is_empty(), "inputs that crashed or over-allocated: {crashes:?}");
}
