//! K-quant weights (Q4_K, Q5_K, Q6_K) on the CPU engine with real tensors, made here (no download): SmolLM2 widened
//! to d = 768 so that every matrix is whole 256-value super-blocks, re-quantized by candle's port of ggml's
//! quantizer in a Q4_K_M-like mix, scored along MT-Bench tokens against its f32-dequantized twin.
//! (`scripts/make_kquant_model.py` makes the same widened model and has llama.cpp's own quantizer write Q4_K_M,
//! for the speed comparison; this test needs neither Python nor llama.cpp.)

mod common;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use frspec::engine::cpu::model::Model;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

const WIDTH: usize = 768;

/// Tensor `name` of SmolLM2 (`[rows, cols]`, or a norm's `[hidden]`) in the widened model, which computes the same
/// function: 192 residual dimensions that stay zero, a zero query head after every 3 (12 heads over 3 KV heads keep
/// each group's heads together), norm weights × √(576/768) with eps × 576/768 (the mean runs over 768 values).
fn widen(name: &str, dims: &[usize], w: &[f32], hidden: usize, head_dim: usize) -> (Vec<usize>, Vec<f32>) {
    let slot = |row: usize| {
        let (head, i) = (row / head_dim, row % head_dim);
        (head / 3 * 4 + head % 3) * head_dim + i
    };
    let out = |rows: usize, cols: usize, place: &dyn Fn(usize, usize) -> (usize, usize)| {
        let mut v = vec![0f32; rows * cols];
        for (r, row) in w.chunks_exact(dims[1]).enumerate() {
            for (c, x) in row.iter().enumerate() {
                let (nr, nc) = place(r, c);
                v[nr * cols + nc] = *x;
            }
        }
        (vec![rows, cols], v)
    };
    if dims.len() == 1 {
        let scale = (hidden as f32 / WIDTH as f32).sqrt();
        let mut v: Vec<f32> = w.iter().map(|x| x * scale).collect();
        v.resize(WIDTH, 0.0);
        return (vec![WIDTH], v);
    }
    let kind = name.rsplit('.').nth(1).unwrap();
    match kind {
        "attn_q" => out(WIDTH, WIDTH, &|r, c| (slot(r), c)),
        "attn_output" => out(WIDTH, WIDTH, &|r, c| (r, slot(c))),
        "ffn_down" => out(WIDTH, dims[1], &|r, c| (r, c)),
        _ => out(dims[0], WIDTH, &|r, c| (r, c)),
    }
}

/// The mix: Q6_K for the embedding (also the LM head) and, as Q4_K_M's "more bits" layers do, for attn_v and ffn_down
/// of every third layer; Q5_K for the other attn_v and ffn_down; Q4_K elsewhere.
fn mix(name: &str) -> GgmlDType {
    let layer: Option<usize> = name.strip_prefix("blk.").and_then(|s| s.split('.').next()).and_then(|n| n.parse().ok());
    match (name.rsplit('.').nth(1).unwrap(), layer) {
        ("token_embd", _) => GgmlDType::Q6K,
        ("attn_v" | "ffn_down", Some(l)) if l % 3 == 0 => GgmlDType::Q6K,
        ("attn_v" | "ffn_down", _) => GgmlDType::Q5K,
        _ => GgmlDType::Q4K,
    }
}

enum Variant {
    /// Widened, every tensor f32.
    Wide,
    /// Widened, matrices in the K-quant mix.
    KQuants,
    /// The K-quant mix's values written as f32.
    Twin,
}

fn widened(dir: &Path, variant: Variant) -> PathBuf {
    let mut file = File::open(common::asset("smollm2")).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let u32_of = |key: &str| content.metadata[key].to_u32().unwrap() as usize;
    let (hidden, heads) = (u32_of("llama.embedding_length"), u32_of("llama.attention.head_count"));
    assert_eq!((hidden, heads, u32_of("llama.attention.head_count_kv")), (576, 9, 3), "SmolLM2-135M's shape");
    let mut metadata: HashMap<String, gguf_file::Value> = content.metadata.clone();
    metadata.insert("llama.embedding_length".into(), gguf_file::Value::U32(WIDTH as u32));
    metadata.insert("llama.attention.head_count".into(), gguf_file::Value::U32(12));
    let eps = content.metadata["llama.attention.layer_norm_rms_epsilon"].to_f32().unwrap();
    metadata.insert("llama.attention.layer_norm_rms_epsilon".into(), gguf_file::Value::F32(eps * hidden as f32 / WIDTH as f32));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let cpu = Device::Cpu;
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|name| {
            let q = content.tensor_infos[name].read(&mut file, content.tensor_data_offset, &cpu).unwrap();
            let dims = q.shape().dims().to_vec();
            let values = q.dequantize(&cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (dims, values) = widen(name, &dims, &values, hidden, hidden / heads);
            let t = Tensor::from_vec(values, dims.as_slice(), &cpu).unwrap();
            let q = match (&variant, dims.len()) {
                (Variant::Wide, _) | (_, 1) => QTensor::quantize(&t, GgmlDType::F32),
                (Variant::KQuants, _) => QTensor::quantize(&t, mix(name)),
                (Variant::Twin, _) => QTensor::quantize(&QTensor::quantize(&t, mix(name)).unwrap().dequantize(&cpu).unwrap(), GgmlDType::F32),
            };
            (name.clone(), q.unwrap())
        })
        .collect();
    let path = dir.join(match variant {
        Variant::Wide => "wide.gguf",
        Variant::KQuants => "wide-k.gguf",
        Variant::Twin => "wide-twin.gguf",
    });
    let metadata: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut File::create(&path).unwrap(), &metadata, &tensors).unwrap();
    path
}

/// The first turns of the MT-Bench questions, as llama.cpp tokenizes them for SmolLM2, joined: 1 sequence.
fn tokens() -> Vec<u32> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/fixtures/mtbench_smollm2_llamacpp_tokens.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids: Vec<u32> = fixture["questions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| serde_json::from_value::<Vec<u32>>(q["turns"][0].clone()).unwrap())
        .collect();
    ids[..ids.len().min(400)].to_vec()
}

/// Top-1 agreement, the largest and the mean logit difference of two scorings of the same sequence.
fn compare(a: &frspec::score::Score, b: &frspec::score::Score) -> (usize, f32, f32) {
    let agree = a.positions.iter().zip(&b.positions).filter(|(x, y)| x.top1 == y.top1).count();
    let differences = || a.logits.iter().zip(&b.logits).map(|(x, y)| (x - y).abs());
    (agree, differences().fold(0f32, f32::max), differences().sum::<f32>() / a.logits.len() as f32)
}

/// `frspec score` in another process with `FRSPEC_ACTIVATIONS` set: each position's top-1 and log-probability.
fn scored(model: &Path, tokens_file: &Path, activations: &str) -> Vec<(u64, f64)> {
    let out = Command::new(env!("CARGO_BIN_EXE_frspec"))
        .args(["score", "--model"])
        .arg(model)
        .arg("--tokens-file")
        .arg(tokens_file)
        .arg("--json")
        .env("FRSPEC_ACTIVATIONS", activations)
        .output()
        .unwrap();
    assert!(out.status.success(), "frspec score: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["positions"].as_array().unwrap().iter().map(|p| (p["top1"].as_u64().unwrap(), p["logprob"].as_f64().unwrap())).collect()
}

#[test]
fn a_model_of_k_quants_only_scores_like_its_dequantized_twin() {
    // In process, K-quant rows take Q8_K activations and SmolLM2's Q4_1 rows exact ones (the reference below).
    frspec::engine::cpu::tensor::Activations::set(frspec::engine::cpu::tensor::Activations::KQuants).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens();
    let n = tokens.len() - 1;
    let score = |path: &Path| frspec::score::score(&Model::load(path).unwrap(), &tokens).unwrap();

    // The widening is exact in real numbers: the widened f32 model follows SmolLM2 itself.
    let original = score(&common::asset("smollm2"));
    let wide_path = widened(dir.path(), Variant::Wide);
    let (agree, worst, _) = compare(&score(&wide_path), &original);
    println!("widened f32 vs SmolLM2: top-1 agreement {agree}/{n}, largest logit difference {worst:.2e}");
    assert!(agree == n && worst < 1e-3, "the widened model is not SmolLM2: {agree}/{n} top-1, logits up to {worst}");
    std::fs::remove_file(&wide_path).unwrap();

    let k_path = widened(dir.path(), Variant::KQuants);
    let k_model = Model::load(&k_path).unwrap();
    let kinds: std::collections::BTreeSet<&str> = k_model.layers().iter().flat_map(|l| l.matrices().map(|m| m.dtype_name())).chain([k_model.embedding().dtype_name()]).collect();
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), ["q4_k", "q5_k", "q6_k"], "every matrix is a K-quant");
    let twin_path = widened(dir.path(), Variant::Twin);
    let twin = score(&twin_path);

    // f32 activations: the products of the dequantized weights, to f32 rounding; the greedy token at every position
    // is the twin's.
    let tokens_file = dir.path().join("tokens.json");
    std::fs::write(&tokens_file, serde_json::to_string(&tokens).unwrap()).unwrap();
    let (exact, reference) = (scored(&k_path, &tokens_file, "f32"), scored(&twin_path, &tokens_file, "f32"));
    let agree = exact.iter().zip(&reference).filter(|(a, b)| a.0 == b.0).count();
    let worst = exact.iter().zip(&reference).map(|(a, b)| (a.1 - b.1).abs()).fold(0f64, f64::max);
    println!("K-quants, f32 activations: top-1 agreement {agree}/{n}, largest log-probability difference {worst:.2e}");
    assert!(agree as f64 >= 0.99 * n as f64, "f32 activations: top-1 agrees at {agree} of {n} positions");
    assert!(worst < 1e-3, "f32 activations: log-probabilities differ by up to {worst}");

    // Q8_K activations and integer sums, as llama.cpp (kquants, and the default q8 alike). Rounding activations to
    // 8 bits moves these logits as far as it moves llama.cpp's: on llama.cpp's own Q4_K_M of this model, along these
    // tokens, llama.cpp agrees with the f32 twin at 360 of 399 positions, mean |Δlogit| 0.44
    // (results/numerics/kquants.md). A wrong scale, offset or layout lands far outside these bounds.
    let k = frspec::score::score(&k_model, &tokens).unwrap();
    let (agree, worst, mean) = compare(&k, &twin);
    println!("K-quants, Q8_K activations: top-1 agreement {agree}/{n}, logit difference largest {worst:.2e}, mean {mean:.3}");
    assert!(agree as f64 >= 0.85 * n as f64, "Q8_K activations: top-1 agrees at {agree} of {n} positions");
    assert!(mean <= 0.6, "Q8_K activations: logits differ by {mean} on average");
}
