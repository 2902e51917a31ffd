//! The candle engine (frspec's GPU path) against the CPU engine, run here on the CPU in f32: the same model gives
//! the same greedy tokens and nearly the same hidden states; its caches roll back as verification needs; the
//! `bench decode` route through it reports and compares; in bf16 it stays within bf16's tolerance of the engine; padded
//! head rows change no logits; with the shipped heads on SmolLM2 the two engines give the same drafts and records
//! (T = 0 loop and fast path, batched or not; drafts fed together). Exact activations throughout
//! (`common::exact_activations`): the CPU engine's default 8-bit activations are not what candle computes.

mod common;
use common::smollm2::{batched_sweep, fed_alone_and_together, keep, mt_bench_prompts, smollm2, Queue};
use common::{exact_activations, frspec};
use frspec::engine::candle::draft::DraftWeights;
use frspec::engine::candle::llama::{greedy, named_shape, Attention, Cache, Llama};
use frspec::engine::candle::{DeviceHead, DeviceRow};
use frspec::speculative::decode::{greedy_turns, speculative_turn, SpecConfig};
use frspec::speculative::generate::generate;
use frspec::speculative::{Context, Draft, DraftHead, DraftKind, DraftMode, HeadMode, HeadRows, TargetModel};
use frspec::sampling::Sampling;
use frspec::sweep::{Plan, Run};
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use frspec::engine::cpu::model::Config;
use frspec::bench::engine_greedy;
use frspec::text::chat::Message;
use frspec::engine::cpu::model::Model;
use frspec::synthetic::{self, Shape};
use frspec::loading::target::Target;
use candle_core::{DType, Device, Tensor};

fn max_abs_diff(a: &Tensor, b: &[f32]) -> f32 {
    a.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Greedy tokens and prompt hidden states of the backend on `model` equal the engine's.
fn agrees_with_engine(model: &Model, prompt: &[u32], new_tokens: usize, tolerance: f32) {
    let llama = Llama::from_engine(model, &Device::Cpu, DType::F32).unwrap();
    let hidden = llama.forward(prompt, &mut llama.new_cache()).unwrap();
    let engine_hidden = model.forward(prompt, &mut model.new_cache(), &[], &[]).unwrap().hidden;
    let diff = max_abs_diff(&hidden, &engine_hidden);
    assert!(diff < tolerance, "hidden states differ by {diff}");
    assert_eq!(greedy(&llama, prompt, new_tokens).unwrap(), engine_greedy(model, prompt, new_tokens).unwrap());
}

#[test]
fn smollm2_greedy_tokens_match_the_engine() {
    exact_activations();
    // GGUF: interleaved RoPE, tied embeddings, Q4_1 weights dequantized.
    let target = Target::load("smollm2").unwrap_or_else(|e| panic!("{e:#}"));
    let prompt = target.tokenizer.chat_prompt(&[Message::new("user", "Name three rivers in Europe.")]).unwrap();
    agrees_with_engine(&target.model, &prompt, 24, 1e-2);
}

#[test]
fn synthetic_greedy_tokens_match_the_engine() {
    exact_activations();
    agrees_with_engine(&synthetic_model(), &[5, 17, 200, 3, 99, 42, 7], 32, 1e-4);
}

/// A synthetic model in HF safetensors: rotate-half RoPE, an untied head, Q/K/V biases.
fn synthetic_model() -> Model {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { qkv_bias: true, ..Shape::tiny() };
    synthetic::write_model(dir.path(), &shape, 3, DType::F32).unwrap();
    Model::load(dir.path()).unwrap()
}

#[test]
fn caches_roll_back_and_blocks_equal_single_steps() {
    exact_activations();
    let shape = Config { layers: 2, vocab: 512, ..named_shape("smollm2-135m").unwrap() };
    let llama = Llama::random(&shape, &Device::Cpu, DType::F32).unwrap();
    let prompt: Vec<u32> = (0..9).map(|i| i * 37 % 512).collect();
    let block = [11, 12, 13];

    let mut cache = llama.new_cache();
    llama.forward(&prompt, &mut cache).unwrap();
    let first = llama.forward(&block, &mut cache).unwrap();
    cache.truncate(prompt.len());
    assert_eq!(cache.len(), prompt.len());
    let again = llama.forward(&block, &mut cache).unwrap();
    assert!(max_abs_diff(&again, &first.flatten_all().unwrap().to_vec1::<f32>().unwrap()) == 0.0);

    let mut single = llama.new_cache();
    llama.forward(&prompt, &mut single).unwrap();
    let rows: Vec<Tensor> = block.iter().map(|&t| llama.forward(&[t], &mut single).unwrap()).collect();
    let stepped = Tensor::cat(&rows, 0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(max_abs_diff(&first, &stepped) < 1e-4);

    // An EAGLE-1 draft on this engine: catching up on n positions then one more equals n + 1 positions at once.
    let eagle = DraftWeights::random_eagle(&llama).unwrap();
    let mut features = llama.new_features(&[]);
    TargetModel::forward(&llama, &prompt, &mut llama.new_cache(), &[], Some(&mut features), &mut Vec::new()).unwrap();
    let mut whole = eagle.instance(&llama);
    let all = whole.catch_up(&Context { tokens: &prompt, features: &features }).unwrap();
    let mut parts = eagle.instance(&llama);
    parts.catch_up(&Context { tokens: &prompt[..prompt.len() - 1], features: &features }).unwrap();
    let last = parts.catch_up(&Context { tokens: &prompt, features: &features }).unwrap();
    assert!(max_abs_diff(&all.tensor().unwrap(), &last.tensor().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()) < 1e-4);
}

/// Hidden states of `tokens` split into `rows` continuing `caches`, one pass, as a row per sequence.
fn forward_batch(llama: &Llama, caches: &mut [&mut Cache], tokens: &[&[u32]]) -> Vec<Vec<f32>> {
    let rows: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
    let (hidden, _) = llama.forward_sequences(&tokens.concat(), caches, &rows, &[]).unwrap();
    let (mut at, mut out) = (0, Vec::new());
    for n in rows {
        out.push(hidden.narrow(0, at, n).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
        at += n;
    }
    out
}

#[test]
fn ragged_sequences_attend_in_one_pass_as_each_alone() {
    exact_activations();
    // Every row of a batch at its own place in one pool, written and attended by one launch a layer each, against
    // each sequence alone through candle's products and softmax: prompts of 1 to 40 positions in one pass, then
    // blocks of 5, 30, 3 and 2 tokens (the pool grows past its first 64 positions, keeping what it held); a dropped
    // cache's slot serves a new sequence, and a fifth sequence grows the pool's slots while the others keep theirs.
    let shape = Config { layers: 2, vocab: 512, ..named_shape("smollm2-135m").unwrap() };
    let llama = Llama::random(&shape, &Device::Cpu, DType::F32).unwrap();
    let prompts: Vec<Vec<u32>> = [3usize, 40, 9, 1].iter().map(|&n| (0..n as u32).map(|i| (i * 37 + n as u32) % 512).collect()).collect();
    let long: Vec<u32> = (100..130).collect();
    let blocks: [&[u32]; 4] = [&[8, 19, 23, 4, 61], &long, &[5, 6, 7], &[300, 301]];
    let alone = |prompt: &[u32], then: &[&[u32]]| -> Vec<Vec<f32>> {
        let mut cache = llama.new_cache().attending(Attention::Products);
        llama.forward(prompt, &mut cache).unwrap();
        then.iter().map(|t| llama.forward(t, &mut cache).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
    };
    let close = |got: &[f32], want: &[f32], what: &str| {
        let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(got.len() == want.len() && diff < 1e-4, "{what}: differs by {diff}");
    };

    let mut caches: Vec<Cache> = (0..4).map(|_| llama.new_cache()).collect();
    let prompt_refs: Vec<&[u32]> = prompts.iter().map(|p| &p[..]).collect();
    forward_batch(&llama, &mut caches.iter_mut().collect::<Vec<_>>(), &prompt_refs);
    let got = forward_batch(&llama, &mut caches.iter_mut().collect::<Vec<_>>(), &blocks);
    for (i, (prompt, block)) in prompts.iter().zip(blocks).enumerate() {
        close(&got[i], &alone(prompt, &[block])[0], &format!("sequence {i}'s block"));
    }

    // Sequence 1's slot goes to a new sequence; a fifth grows the slots; sequence 0 goes on beside them.
    let dropped = caches.remove(1);
    drop(dropped);
    let (fresh, fifth): (&[u32], &[u32]) = (&[1, 2, 3, 4], &[9, 10]);
    caches.push(llama.new_cache());
    caches.push(llama.new_cache());
    let [first, _, _, reused, fifth_cache] = &mut caches[..] else { unreachable!("five caches") };
    let got = forward_batch(&llama, &mut [first, reused, fifth_cache], &[&[42], fresh, fifth]);
    close(&got[0], &alone(&prompts[0], &[blocks[0], &[42]])[1], "sequence 0 after the pool grew");
    close(&got[1], &llama.forward(fresh, &mut llama.new_cache().attending(Attention::Products)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), "a sequence in a reused slot");
    close(&got[2], &llama.forward(fifth, &mut llama.new_cache().attending(Attention::Products)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), "a fifth sequence");

    // Caches of two models never share a forward.
    let other = Llama::random(&shape, &Device::Cpu, DType::F32).unwrap();
    let (mut mine, mut theirs) = (llama.new_cache(), other.new_cache());
    let err = llama.forward_sequences(&[1, 2], &mut [&mut mine, &mut theirs], &[1, 1], &[]).unwrap_err();
    assert!(err.to_string().contains("belong to one model"), "{err}");
}

#[test]
fn bench_decode_on_the_candle_engine_compares_with_the_engine() {
    exact_activations();
    // The model folder scripts/gpu-check.sh makes.
    let dir = tempfile::tempdir().unwrap();
    let made = frspec().args(["synthetic-model", "--out", dir.path().to_str().unwrap(), "--hidden", "128", "--layers", "2", "--vocab", "260"]).output().unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let bad = frspec().args(["synthetic-model", "--out", dir.path().to_str().unwrap(), "--hidden", "100"]).output().unwrap();
    assert!(bad.status.code() == Some(1) && String::from_utf8_lossy(&bad.stderr).contains("multiple of 64"));
    // Heads that could not be loaded, or folders that cannot be made, are refused before anything is written.
    let (file, fresh) = (dir.path().join("config.json"), dir.path().join("fresh"));
    for (flags, message) in [
        (["--layers", "2", "--eagle3-head", "e3"], "--eagle3-head needs --layers at least 4"),
        (["--layers", "4", "--eagle-head", file.join("e1").to_str().unwrap()], "cannot create"),
    ] {
        let refused = frspec().args(["synthetic-model", "--out", fresh.to_str().unwrap(), "--hidden", "64"]).args(flags).current_dir(dir.path()).output().unwrap();
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(refused.status.code() == Some(1) && stderr.contains(message), "{flags:?}: {stderr}");
        assert!(!fresh.join("model.safetensors").exists(), "{flags:?}: no model written");
    }
    let out = frspec()
        .args(["bench", "decode", "--model", dir.path().to_str().unwrap(), "--candle", "--compare-engine", "--json"])
        .args(["--new-tokens", "12", "--runs", "2", "--ratios", "0,0.5", "--lengths", "2,3", "--prompt", "hi there"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let b: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(b["agreement"]["first_difference"], serde_json::Value::Null);
    assert_eq!(b["agreement"]["device"].as_array().unwrap().len(), 12);
    let drafts = b["drafts"].as_array().unwrap();
    assert_eq!(drafts.len(), 2);
    assert_eq!(drafts[1]["kept"], 130);
    assert_eq!(drafts[0]["projected_tok_s"].as_array().unwrap().len(), 2);
    assert!(drafts.iter().all(|d| d["loop_tok_s"].as_f64().unwrap() > 0.0 && d["draft_step_secs"].as_f64().unwrap() > 0.0), "{drafts:?}");
    let step = drafts[0]["speculative_step_secs"].as_f64().unwrap();
    let expected = b["verify_secs"].as_f64().unwrap() + 4.0 * drafts[0]["draft_step_secs"].as_f64().unwrap();
    assert!((step - expected).abs() < 1e-12 * step.max(1.0));

    for (args, expect) in [
        (vec!["--device", "cuda"], "without CUDA"),
        (vec!["--candle", "--dtype", "f64"], "expected f32, f16 or bf16"),
        (vec!["--shape", "llama99"], "expected llama31-8b"),
        (vec!["--shape", "smollm2-135m", "--compare-engine"], "needs --model"),
        (vec!["--candle", "--lengths", "0.5"], "at least 1"),
        (vec!["--sequences", "0"], "--sequences and --k must be at least 1"),
    ] {
        let out = frspec().args(["bench", "decode", "--model", dir.path().to_str().unwrap()]).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(1) && err.contains(expect), "{args:?}: {err}");
    }
}

/// ‖a − b‖ / ‖b‖.
fn relative_error(a: &Tensor, b: &[f32]) -> f64 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (diff, norm) = a.iter().zip(b).fold((0.0, 0.0), |(d, n), (&x, &y)| (d + ((x - y) as f64).powi(2), n + (y as f64).powi(2)));
    (diff / norm).sqrt()
}

#[test]
fn fused_forward_agrees_with_the_engine_in_f32_and_bf16() {
    exact_activations();
    // The candle forward (fused norms, RoPE, SiLU × up and one-token attention, stacked projections, the cache
    // written in place) against the CPU engine, prompt, a verification block and one token over the cache: f32 to
    // rounding, bf16 to its 8-bit mantissa.
    let model = synthetic_model();
    let (prompt, block) = ([5, 17, 200, 3, 99, 42, 7], [8, 19, 23, 4, 61]);
    let mut engine_cache = model.new_cache();
    model.forward(&prompt, &mut engine_cache, &[], &[]).unwrap();
    let expected = model.forward(&block, &mut engine_cache, &[], &[]).unwrap().hidden;
    let expected_step = model.forward(&[77], &mut engine_cache, &[], &[]).unwrap().hidden;
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let llama = Llama::from_engine(&model, &Device::Cpu, dtype).unwrap();
        let mut cache = llama.new_cache();
        llama.forward(&prompt, &mut cache).unwrap();
        let error = relative_error(&llama.forward(&block, &mut cache).unwrap(), &expected);
        assert!(error < tolerance, "{dtype:?}: block, relative error {error}");
        // One token: the decode step's own attention.
        let error = relative_error(&llama.forward(&[77], &mut cache).unwrap(), &expected_step);
        assert!(error < tolerance, "{dtype:?}: one token, relative error {error}");
    }
}

#[test]
fn padded_head_rows_give_the_unpadded_logits() {
    exact_activations();
    // 1,283 kept rows are stored as 1,408 (a multiple of 128); the padding's logits never reach the chooser.
    let matrix = Tensor::randn(0f32, 1.0, (3000, 64), &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..1283).map(|i| (i * 7 % 3000) as u32).collect();
    let head = DeviceHead::new(matrix.clone()).select_rows(&ids).unwrap();
    assert_eq!((head.rows(), head.stored_rows()), (1283, 1408));
    let unpadded = matrix.index_select(&Tensor::from_slice(&ids, ids.len(), &Device::Cpu).unwrap(), 0).unwrap();
    let (mut logits, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let row = Tensor::randn(0f32, 1.0, (1, 64), &Device::Cpu).unwrap();
        let row = DeviceRow::from(row);
        head.logits(&row, &mut logits, &mut ()).unwrap();
        DeviceHead::new(unpadded.clone()).logits(&row, &mut plain, &mut ()).unwrap();
        assert_eq!(logits.len(), 1283);
        assert!(logits.iter().zip(&plain).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)));
        let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        assert_eq!(argmax(&logits), argmax(&plain));
    }
}

#[test]
fn matvec_kernels_equal_the_ops_they_fold() {
    exact_activations();
    // The CPU twins of the GPU matrix-vector kernels that one-row products take there (kernels.cu runs only on a
    // GPU; scripts/gpu-check.sh checks those through greedy tokens and sweep records against the CPU engine): the
    // plain product, the product of the RMS-normed row, and the product plus a residual.
    use frspec::engine::candle::kernels::{matvec, matvec_normed, matvec_plus};
    let w = Tensor::randn(0f32, 1.0, (300, 256), &Device::Cpu).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1, 256), &Device::Cpu).unwrap();
    let g = Tensor::randn(1f32, 0.1, 256, &Device::Cpu).unwrap();
    let r = Tensor::randn(0f32, 1.0, (1, 300), &Device::Cpu).unwrap();
    let product = |x: &Tensor| x.matmul(&w.t().unwrap()).unwrap();
    let normed = candle_nn::ops::rms_norm_slow(&x, &g, 1e-5).unwrap();
    let cases = [
        (matvec(&x, &w).unwrap(), product(&x)),
        (matvec_normed(&x, &g, 1e-5, &w).unwrap(), product(&normed)),
        (matvec_plus(&x, &w, &r).unwrap(), (product(&x) + &r).unwrap()),
    ];
    for (i, (got, expected)) in cases.iter().enumerate() {
        assert_eq!(got.dims(), &[1, 300]);
        let error = relative_error(got, &expected.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert!(error < 1e-5, "case {i}: relative error {error}");
    }
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let error = relative_error(&matvec_normed(&bf16(&x), &bf16(&g), 1e-5, &bf16(&w)).unwrap(), &product(&normed).flatten_all().unwrap().to_vec1::<f32>().unwrap());
    assert!(error < 1e-2, "bf16: relative error {error}");
}

#[test]
fn a_heads_product_of_several_rows_gives_each_row_what_it_gets_alone_on_both_engines() {
    exact_activations();
    // Sequences drafting through one head share one product of it (`logits_many`, `argmax_many`): on the CPU engine
    // each row gets its own logits bit for bit, on the candle engine to rounding with the same argmax; a masked head
    // masks every row and a sliced one gives the masked one's kept entries.
    use frspec::speculative::{DraftHead, HeadMode, LmHead};
    use frspec::vocab::{Frequencies, KeepRule};
    use rand::{RngExt, SeedableRng};
    let model = synthetic_model();
    let (vocab, hidden) = (model.lm_head().rows, model.lm_head().cols);
    let ranking = Frequencies::from_counts(&(0..vocab as u64).map(|i| (i * 53) % 97).collect::<Vec<_>>(), std::path::Path::new("synthetic"));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let rows: Vec<Vec<f32>> = (0..6).map(|_| (0..hidden).map(|_| rng.random_range(-2.0f32..2.0)).collect()).collect();
    let llama = Llama::from_engine(&model, &Device::Cpu, DType::F32).unwrap();
    let device_rows: Vec<Tensor> = rows.iter().map(|r| Tensor::from_slice(r, (1, hidden), &Device::Cpu).unwrap()).collect();
    for (keep, mode) in [(None, HeadMode::Slice), (Some(0.5), HeadMode::Slice), (Some(0.5), HeadMode::Mask)] {
        let keep = keep.map(|r| ranking.keep_set(KeepRule::Ratio(r), vocab, &[]).unwrap());
        let cpu = DraftHead::new(LmHead::full(std::sync::Arc::new(model.lm_head().clone())), keep.clone(), mode).unwrap();
        let candle = DraftHead::new(LmHead::full(DeviceHead::new(llama.lm_head().clone())), keep, mode).unwrap();

        let (mut scratch, mut indices) = (Default::default(), Vec::new());
        let alone: Vec<Vec<f32>> = rows.iter().map(|r| { let mut out = Vec::new(); cpu.logits(r, &mut out, &mut scratch).unwrap(); out }).collect();
        let mut together = vec![Vec::new(); rows.len()];
        cpu.logits_many(&rows.iter().collect::<Vec<_>>(), &mut together.iter_mut().collect::<Vec<_>>(), &mut scratch).unwrap();
        assert_eq!(together, alone, "CPU engine, {mode:?}: a row's logits among others");
        cpu.argmax_many(&rows.iter().collect::<Vec<_>>(), &mut together.iter_mut().collect::<Vec<_>>(), &mut scratch, &mut indices).unwrap();
        let argmax: Vec<usize> = rows.iter().map(|r| cpu.argmax(r, &mut Vec::new(), &mut scratch).unwrap()).collect();
        assert_eq!(indices, argmax);
        if mode == HeadMode::Mask {
            assert!(alone.iter().all(|l| l.iter().filter(|v| v.is_finite()).count() == cpu.kept()), "every row masked");
        }

        // Rows stack three ways (`candle::stack`): consecutive rows of one batch (a view), rows of one batch out of
        // order (a gather), rows of their own (copies).
        let batch = Tensor::cat(&device_rows, 0).unwrap();
        let order: [Vec<usize>; 3] = [(0..rows.len()).collect(), (0..rows.len()).rev().collect(), (0..rows.len()).collect()];
        let arranged: [Vec<DeviceRow>; 3] = [
            order[0].iter().map(|&i| DeviceRow::of(batch.clone(), i)).collect(),
            order[1].iter().map(|&i| DeviceRow::of(batch.clone(), i)).collect(),
            device_rows.iter().map(|r| DeviceRow::from(r.clone())).collect(),
        ];
        for (how, (order, arranged)) in ["view", "gather", "copies"].iter().zip(order.iter().zip(&arranged)) {
            let rows: Vec<&DeviceRow> = arranged.iter().collect();
            let mut on_device = vec![Vec::new(); rows.len()];
            candle.logits_many(&rows, &mut on_device.iter_mut().collect::<Vec<_>>(), &mut ()).unwrap();
            for (got, &i) in on_device.iter().zip(order) {
                let want = &alone[i];
                assert_eq!(got.len(), want.len());
                let close = got.iter().zip(want).all(|(g, w)| (g == w) || (g - w).abs() <= 1e-4 * w.abs().max(1.0));
                assert!(close, "candle engine, {mode:?}, {how}: logits of a row among others");
            }
            candle.argmax_many(&rows, &mut on_device.iter_mut().collect::<Vec<_>>(), &mut (), &mut indices).unwrap();
            let device_argmax: Vec<usize> = rows.iter().map(|r| candle.argmax(r, &mut Vec::new(), &mut ()).unwrap()).collect();
            let want: Vec<usize> = order.iter().map(|&i| argmax[i]).collect();
            assert_eq!((indices.clone(), device_argmax), (want.clone(), want), "candle engine, {mode:?}, {how}: argmax");
        }
    }
}

#[test]
fn the_candle_engine_gives_the_cpu_engines_records_with_the_shipped_eagle_head() {
    exact_activations();
    let t = smollm2();
    let load = || frspec::engine::cpu::draft::load(&DraftKind::Eagle, Some(frspec::spec::SMOLLM2_HEAD), t, "smollm2").unwrap();
    let llama = Llama::from_engine(&t.model, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let weights = DraftWeights::from_engine(&load(), &llama).unwrap();
    let ratios = [0.0, 0.5, 0.9];
    let mut on_cpu: Vec<Box<dyn Draft<Model>>> = ratios.iter().map(|_| load().boxed()).collect();
    let mut on_candle: Vec<Box<dyn Draft<Llama> + '_>> = ratios.iter().map(|_| weights.instance(&llama)).collect();
    let cpu_heads: Vec<_> = on_cpu.iter().zip(ratios).map(|(d, r)| DraftHead::new(d.lm_head(), keep(r), HeadMode::Slice).unwrap()).collect();
    let candle_heads: Vec<_> = on_candle.iter().zip(ratios).map(|(d, r)| DraftHead::new(d.lm_head(), keep(r), HeadMode::Slice).unwrap()).collect();
    let (prompts, stop) = (mt_bench_prompts(10), &t.tokenizer.stop_ids);
    let mut accepted = 0;
    // The T = 0 path a sweep takes: the target's continuation once, every ratio's draft along it.
    for k in [1, 4] {
        for (i, prompt) in prompts.iter().enumerate() {
            let (want, want_recs) = greedy_turns(&t.model, stop, on_cpu[0].as_mut(), &cpu_heads.iter().collect::<Vec<_>>(), prompt, k, 64).unwrap();
            let (got, recs) = greedy_turns(&llama, stop, on_candle[0].as_mut(), &candle_heads.iter().collect::<Vec<_>>(), prompt, k, 64).unwrap();
            assert_eq!(got, want, "k {k} prompt {i}: tokens");
            for ((rec, want_rec), ratio) in recs.iter().zip(&want_recs).zip(ratios) {
                assert_eq!(rec.without_timings(), want_rec.without_timings(), "ratio {ratio} k {k} prompt {i}: record");
                accepted += rec.accepted;
            }
        }
    }
    assert!(accepted > 0, "the shipped head drafts tokens the target accepts");
    // The full loop: verification blocks on each engine, caches and features rolled back.
    let cfg = SpecConfig { k: 4, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 64 };
    for (i, prompt) in prompts[..2].iter().enumerate() {
        for (j, ratio) in ratios.iter().enumerate() {
            let mut rng = ChaCha20Rng::seed_from_u64(1);
            let (want, want_rec) = speculative_turn(&t.model, stop, on_cpu[j].as_mut(), &cpu_heads[j], prompt, &cfg, &mut rng).unwrap();
            let mut rng = ChaCha20Rng::seed_from_u64(1);
            let (got, rec) = speculative_turn(&llama, stop, on_candle[j].as_mut(), &candle_heads[j], prompt, &cfg, &mut rng).unwrap();
            assert_eq!((got, rec.without_timings()), (want, want_rec.without_timings()), "full loop, ratio {ratio} prompt {i}");
        }
    }
}

#[test]
fn candle_drafts_fed_together_give_each_what_it_gets_alone() {
    // The loop feeds every slot's EAGLE draft in one forward of the head's layer, each at its own positions of its
    // own cache (a slot of the head's pool): each draft's head input must be what it gets fed alone (EAGLE-1 and
    // EAGLE-3, catching up on prompts of different lengths, then two drafted tokens), and greedy turns of three slots
    // at once stay the target's own output.
    // Their prompts share the chat template's opening: the second and third turns start from the first slot's rows
    // of it (copied from slot to slot of the pool), once the first has forwarded them.
    use frspec::speculative::decode::{speculative_turns, TurnJob};
    exact_activations();
    let t = smollm2();
    let llama = Llama::from_engine(&t.model, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let prompts = mt_bench_prompts(3);
    let rows = |t: frspec::engine::candle::DeviceRow| t.tensor().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (kind, head) in [(DraftKind::Eagle, frspec::spec::SMOLLM2_HEAD), (DraftKind::Eagle3, frspec::spec::SMOLLM2_EAGLE3_HEAD)] {
        let weights = DraftWeights::from_engine(&frspec::engine::cpu::draft::load(&kind, Some(head), t, "smollm2").unwrap(), &llama).unwrap();
        let mut drafts: Vec<_> = prompts.iter().map(|_| weights.instance(&llama)).collect();
        fed_alone_and_together(&llama, &mut drafts, rows, |i, step, got, want| {
            let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(got.len() == want.len() && diff < 1e-4, "{kind}: draft {i} at position {step} differs by {diff}");
        });
        let mut slots: Vec<&mut dyn Draft<Llama>> = drafts.iter_mut().map(|d| d.as_mut() as _).collect();
        let head = DraftHead::new(slots[0].lm_head(), None, HeadMode::Slice).unwrap();
        let cfg = SpecConfig { k: 4, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 48 };
        let jobs = prompts.iter().enumerate().map(|(id, p)| TurnJob { id, prompt: p.clone(), head: &head, rng: Box::new(ChaCha20Rng::seed_from_u64(0)) }).collect();
        let mut queue = Queue { jobs, done: Vec::new() };
        speculative_turns(&llama, &t.tokenizer.stop_ids, &mut slots, &cfg, &mut queue).unwrap();
        queue.done.sort_by_key(|d| d.0);
        for ((id, got, _), prompt) in queue.done.iter().zip(&prompts) {
            let want = generate(&t.model, &t.tokenizer.stop_ids, prompt, 48, Sampling::GREEDY, &mut ChaCha20Rng::seed_from_u64(0)).unwrap().tokens;
            assert_eq!(got, &want, "{kind}: turn {id} of three side by side");
        }
    }
}

#[test]
fn the_candle_engine_gives_the_cpu_engines_t0_records_batched_or_not() {
    exact_activations();
    let t = smollm2();
    let questions = frspec::text::dataset::load("mt-bench").unwrap()[..3].to_vec();
    let plan = Plan { ratios: vec![0.0, 0.9], temperatures: vec![0.0], top_p: 1.0, repeats: 2, seed: 0, k: 4, turns: 1, max_new_tokens: 128, mode: DraftMode::Argmax };
    let load = || frspec::engine::cpu::draft::load(&DraftKind::Eagle, Some(frspec::spec::SMOLLM2_HEAD), t, "smollm2").unwrap();
    let sorted = |mut runs: Vec<Run>| {
        runs.sort_by(|a, b| (a.ratio, a.prompt_index, a.repeat).partial_cmp(&(b.ratio, b.prompt_index, b.repeat)).unwrap());
        runs
    };
    let want = sorted(batched_sweep(&t.model, vec![load().boxed()], &questions, &plan));
    assert!(want.iter().filter(|r| r.record.accepted > 0).count() > want.len() / 2);
    // The candle engine on the CPU in f32: at T = 0 its records are the CPU engine's, batched or not.
    let llama = Llama::from_engine(&t.model, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let weights = DraftWeights::from_engine(&load(), &llama).unwrap();
    for batch in [1, 8] {
        let runs = sorted(batched_sweep(&llama, (0..batch).map(|_| weights.instance(&llama)).collect(), &questions, &plan));
        assert_eq!(runs, want, "candle engine, batch {batch}: T = 0 records");
    }
}
