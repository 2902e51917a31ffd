//! The speculative core on both engines: lossless greedy decoding on the real SmolLM2 target with a truncated draft
//! and an EAGLE-1 head at every ratio and k; the sampling distribution on a small synthetic model (χ² tests that
//! pass for the real verifier on the CPU and candle engines and fail for samples from the draft); slice == mask;
//! determinism; batches; EAGLE-3 on both engines. In the default activations (the CPU engine's comparisons with the
//! candle engine on SmolLM2, which need exact ones, are in backend.rs).

mod common;
use common::smollm2::{batched_sweep, fed_alone_and_together, keep, mt_bench_prompts, smollm2, Queue};
use frspec::speculative::decode::{greedy_turns, speculative_turn, SpecConfig, TurnRecord};
use frspec::engine::cpu::draft::{build, EagleDraft, ModelDraft};
use frspec::speculative::{Draft, DraftHead, DraftKind, DraftMode, HeadMode, TargetModel};
use frspec::speculative::generate::{generate, StopReason};
use frspec::sweep::{Plan, Run};
use frspec::engine::candle::draft::DraftWeights;
use frspec::engine::candle::llama::Llama;
use frspec::engine::cpu::draft::Loaded;
use frspec::engine::cpu::model::Model;
use frspec::sampling::Sampling;
use frspec::synthetic::{self, Shape};
use frspec::vocab::{Frequencies, KeepRule, KeepSet};
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use statrs::distribution::{ChiSquared, ContinuousCDF};

fn smollm2_shape() -> Shape {
    let c = &smollm2().model.config;
    Shape { hidden: c.hidden, intermediate: c.intermediate, layers: 1, heads: c.heads, kv_heads: c.kv_heads, vocab: c.vocab, tied: true, qkv_bias: false }
}

fn run(draft: &mut dyn Draft<Model>, keep: Option<KeepSet>, mode: HeadMode, prompt: &[u32], cfg: &SpecConfig, seed: u64) -> (Vec<u32>, TurnRecord) {
    let t = smollm2();
    let head = DraftHead::new(draft.lm_head(), keep, mode).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    speculative_turn(&t.model, &t.tokenizer.stop_ids, draft, &head, prompt, cfg, &mut rng).unwrap()
}

#[test]
fn greedy_speculative_output_equals_target_greedy_for_every_ratio_k_and_draft() {
    let t = smollm2();
    let prompts = mt_bench_prompts(10);
    let baselines: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| generate(&t.model, &t.tokenizer.stop_ids, p, 64, Sampling::GREEDY, &mut ChaCha20Rng::seed_from_u64(0)).unwrap().tokens)
        .collect();
    let eagle_dir = tempfile::tempdir().unwrap();
    synthetic::write_eagle_head(eagle_dir.path(), &smollm2_shape(), 3).unwrap();
    let mut drafts: Vec<Box<dyn Draft<Model>>> = vec![
        build(&DraftKind::Truncated(2), None, t, "smollm2").unwrap(),
        Box::new(EagleDraft::load(eagle_dir.path(), &t.model).unwrap()),
    ];
    for draft in drafts.iter_mut() {
        for ratio in [0.0, 0.5, 0.9, 0.99] {
            for k in [1, 4] {
                let cfg = SpecConfig { k, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 64 };
                for (i, (prompt, want)) in prompts.iter().zip(&baselines).enumerate() {
                    let (got, rec) = run(draft.as_mut(), keep(ratio), HeadMode::Slice, prompt, &cfg, 1);
                    assert_eq!(&got, want, "{} ratio {ratio} k {k} prompt {i}", draft.describe());
                    assert_eq!(rec.generated, want.len());
                    assert!(rec.accepted <= rec.draft_tokens && rec.accepted_per_pos.iter().all(|&c| c <= rec.drafts));
                }
            }
        }
    }
}

/// The shipped EAGLE-3 head, packed in Q8_0 (`loading::pack`), as the `smollm2-eagle3` preset loads it: lossless at
/// T = 0 with its draft vocabulary pruned further, and accepted.
#[test]
fn the_shipped_eagle3_head_drafts_losslessly_and_is_accepted() {
    let t = smollm2();
    let mut draft = build(&DraftKind::Eagle3, Some(frspec::spec::SMOLLM2_EAGLE3_HEAD), t, "smollm2").unwrap();
    let cfg = SpecConfig { k: 4, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 64 };
    let (mut accepted, mut steps) = (0, 0);
    for (i, prompt) in mt_bench_prompts(4).iter().enumerate() {
        let want = generate(&t.model, &t.tokenizer.stop_ids, prompt, 64, Sampling::GREEDY, &mut ChaCha20Rng::seed_from_u64(0)).unwrap().tokens;
        for ratio in [0.0, 0.9] {
            let (got, rec) = run(draft.as_mut(), keep(ratio), HeadMode::Slice, prompt, &cfg, 1);
            assert_eq!(got, want, "ratio {ratio} prompt {i}");
            (accepted, steps) = (accepted + rec.accepted, steps + rec.drafts);
        }
    }
    assert!(accepted as f64 > 0.3 * steps as f64, "the head's drafts are accepted: {accepted} tokens in {steps} steps");
}

#[test]
fn slice_and_mask_heads_give_identical_records_and_seeds_repeat() {
    let t = smollm2();
    let eagle_dir = tempfile::tempdir().unwrap();
    synthetic::write_eagle_head(eagle_dir.path(), &smollm2_shape(), 4).unwrap();
    let mut eagle = EagleDraft::load(eagle_dir.path(), &t.model).unwrap();
    let mut truncated = build(&DraftKind::Truncated(6), None, t, "smollm2").unwrap();
    let sampling = Sampling::new(1.0, 0.95).unwrap();
    for prompt in mt_bench_prompts(2) {
        for mode in [DraftMode::Sample, DraftMode::Argmax] {
            let cfg = SpecConfig { k: 3, mode, sampling, max_new_tokens: 24 };
            for draft in [&mut eagle as &mut dyn Draft<Model>, truncated.as_mut()] {
                let (a, ra) = run(draft, keep(0.9), HeadMode::Slice, &prompt, &cfg, 9);
                let (b, rb) = run(draft, keep(0.9), HeadMode::Mask, &prompt, &cfg, 9);
                let (c, rc) = run(draft, keep(0.9), HeadMode::Slice, &prompt, &cfg, 9);
                assert_eq!(a, b, "slice vs mask tokens ({mode:?}, {})", draft.describe());
                assert_eq!(ra.without_timings(), rb.without_timings(), "slice vs mask record");
                assert_eq!((a, ra.without_timings()), (c, rc.without_timings()), "same seed twice");
            }
        }
    }
}

/// Tiny target and a different tiny draft over a 32-token vocabulary (no tokenizer needed).
fn tiny_pair() -> (tempfile::TempDir, Model, Model) {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { hidden: 32, intermediate: 48, layers: 2, heads: 4, kv_heads: 2, vocab: 32, tied: false, qkv_bias: false };
    synthetic::write_model(&dir.path().join("target"), &shape, 21, candle_core::DType::F32).unwrap();
    synthetic::write_model(&dir.path().join("draft"), &shape, 22, candle_core::DType::F32).unwrap();
    let target = Model::load(&dir.path().join("target")).unwrap();
    let draft = Model::load(&dir.path().join("draft")).unwrap();
    (dir, target, draft)
}

/// Exact marginal distributions of the first three sampled tokens after `prompt`.
fn exact_marginals(m: &Model, prompt: &[u32], s: Sampling) -> [Vec<f64>; 3] {
    let v = m.config.vocab;
    let dist = |logits: &[f32]| {
        let (mut p, mut o) = (Vec::new(), Vec::new());
        s.distribution(logits, &mut p, &mut o);
        p.into_iter().map(f64::from).collect::<Vec<_>>()
    };
    let mut cache = m.new_cache();
    let p1 = dist(&m.forward(prompt, &mut cache, &[prompt.len() - 1], &[]).unwrap().logits);
    let (mut p2, mut p3) = (vec![0.0; v], vec![0.0; v]);
    for x in 0..v as u32 {
        let mut c1 = cache.clone();
        let q2 = dist(&m.forward(&[x], &mut c1, &[0], &[]).unwrap().logits);
        for y in 0..v as u32 {
            let w = p1[x as usize] * q2[y as usize];
            p2[y as usize] += w;
            let mut c2 = c1.clone();
            let q3 = dist(&m.forward(&[y], &mut c2, &[0], &[]).unwrap().logits);
            q3.iter().zip(p3.iter_mut()).for_each(|(q, p)| *p += w * q);
        }
    }
    [p1, p2, p3]
}

/// p-value of a χ² goodness-of-fit test; bins expecting fewer than 5 samples are pooled.
fn chi_square_p(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut bins, mut pool_o, mut pool_e) = (0.0, 0usize, 0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e >= 5.0 {
            stat += (o as f64 - e).powi(2) / e;
            bins += 1;
        } else {
            pool_o += o as f64;
            pool_e += e;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        bins += 1;
    }
    1.0 - ChiSquared::new((bins - 1) as f64).unwrap().cdf(stat)
}

const SAMPLES: usize = 20_000;

fn first_three_counts(v: usize, mut sample: impl FnMut(&mut ChaCha20Rng) -> Vec<u32>) -> [Vec<u64>; 3] {
    let mut counts = [vec![0u64; v], vec![0u64; v], vec![0u64; v]];
    let mut rng = ChaCha20Rng::seed_from_u64(2024);
    for _ in 0..SAMPLES {
        let tokens = sample(&mut rng);
        for (pos, t) in tokens.iter().take(3).enumerate() {
            counts[pos][*t as usize] += 1;
        }
    }
    counts
}

/// The first three tokens the sampled loop emits on `target` with `draft` follow `exact` (χ²), for each draft mode
/// and keep set of `cases`.
fn assert_sampling_matches<T: TargetModel>(target: &T, draft: &mut dyn Draft<T>, cases: &[(DraftMode, Option<KeepSet>)], exact: &[Vec<f64>; 3], prompt: &[u32], sampling: Sampling, engine: &str) {
    let v = target.vocab();
    for (mode, keep) in cases.iter().cloned() {
        let head = DraftHead::new(draft.lm_head(), keep.clone(), HeadMode::Slice).unwrap();
        let cfg = SpecConfig { k: 2, mode, sampling, max_new_tokens: 3 };
        let counts = first_three_counts(v, |rng| speculative_turn(target, &[], draft, &head, prompt, &cfg, rng).unwrap().0);
        for pos in 0..3 {
            let p = chi_square_p(&counts[pos], &exact[pos]);
            assert!(p > 0.001, "{engine} engine, {mode:?} keep {:?}: token {} p-value {p}", keep.as_ref().map(|k| k.ids.len()), pos + 1);
        }
    }
}

#[test]
fn speculative_sampling_matches_the_target_distribution_on_both_engines_and_the_test_catches_a_broken_verifier() {
    let (_dir, target, draft_model) = tiny_pair();
    let v = target.config.vocab;
    let prompt = [3u32, 17, 5];
    let sampling = Sampling::new(0.9, 0.95).unwrap();
    let exact = exact_marginals(&target, &prompt, sampling);
    let ranking = Frequencies::from_counts(&(0..v as u64).map(|i| (i * 7919) % 31).collect::<Vec<_>>(), std::path::Path::new("synthetic"));
    let half = ranking.keep_set(KeepRule::Ratio(0.5), v, &[]).unwrap();
    let draft = Loaded::Model(ModelDraft::new(draft_model, "tiny draft".into()));
    let llama = Llama::from_engine(&target, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let mut on_candle = DraftWeights::from_engine(&draft, &llama).unwrap().instance(&llama);
    // Draws from the draft's q and argmax drafts, with and without pruning, on the reference engine; on the candle
    // engine, whose loop and verifier are the same code, draws from q through a pruned head.
    let cases = [(DraftMode::Sample, Some(half.clone())), (DraftMode::Argmax, Some(half.clone())), (DraftMode::Sample, None)];
    assert_sampling_matches(&target, draft.boxed().as_mut(), &cases, &exact, &prompt, sampling, "cpu");
    assert_sampling_matches(&llama, on_candle.as_mut(), &cases[..1], &exact, &prompt, sampling, "candle");
    // At top-p 1 the candle engine verifies argmax drafts where the logits are (softmax, p(x), and the recovery's draw
    // from p without x); top-p and the draft's q go through the host's code above.
    let whole = Sampling::new(0.9, 1.0).unwrap();
    let exact_whole = exact_marginals(&target, &prompt, whole);
    assert_sampling_matches(&llama, on_candle.as_mut(), &[(DraftMode::Argmax, Some(half.clone()))], &exact_whole, &prompt, whole, "candle, on the device");

    // An accept-everything verifier emits the draft's own samples: the same test must reject them.
    let (_d2, _, draft_model) = tiny_pair();
    let counts = first_three_counts(v, |rng| {
        let mut cache = draft_model.new_cache();
        let mut logits = draft_model.forward(&prompt, &mut cache, &[2], &[]).unwrap().logits;
        let (mut p, mut o, mut out) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            sampling.distribution(&logits, &mut p, &mut o);
            let t = frspec::sampling::draw(&p, rng);
            out.push(t);
            logits = draft_model.forward(&[t], &mut cache, &[0], &[]).unwrap().logits;
        }
        out
    });
    let worst = (0..3).map(|pos| chi_square_p(&counts[pos], &exact[pos])).fold(1.0, f64::min);
    assert!(worst < 1e-6, "samples from the draft passed as the target's (p = {worst})");
}

#[test]
fn bad_engine_input_is_refused() {
    let t = smollm2();
    let mut draft = build(&DraftKind::Truncated(1), None, t, "smollm2").unwrap();
    let head = DraftHead::new(draft.lm_head(), None, HeadMode::Slice).unwrap();
    let cfg = SpecConfig { k: 0, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 8 };
    let err = speculative_turn(&t.model, &[], draft.as_mut(), &head, &[1, 2], &cfg, &mut ChaCha20Rng::seed_from_u64(0)).unwrap_err();
    assert!(err.to_string().contains("k (draft tokens per step) must be at least 1"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    synthetic::write_eagle_head(dir.path(), &Shape { vocab: 49152, ..Shape::tiny() }, 1).unwrap();
    let err = EagleDraft::load(dir.path(), &t.model).err().unwrap().to_string();
    assert!(err.contains("EAGLE hidden size 64 ≠ the target's 576"), "{err}");

    let other = tempfile::tempdir().unwrap();
    synthetic::write_model(other.path(), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    let err = build(&DraftKind::Model, Some(other.path().to_str().unwrap()), t, "smollm2").err().unwrap().to_string();
    assert!(err.contains("does not share the target's tokenizer"), "{err}");

    let wrong = KeepSet { ids: vec![0, 1], vocab: 100 };
    let err = DraftHead::new(draft.lm_head(), Some(wrong), HeadMode::Slice).err().unwrap().to_string();
    assert!(err.contains("vocabulary of 100"), "{err}");
}

#[test]
fn eagle1_checkpoints_with_yuhuilis_key_names_load_from_pickle_and_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(dir.path(), &Shape::tiny(), 8, candle_core::DType::F32).unwrap();
    let target = Model::load(dir.path()).unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/fixtures");
    let mut from_pickle = EagleDraft::load(&fixtures.join("eagle1-tiny"), &target).unwrap();
    let mut from_safetensors = EagleDraft::load(&fixtures.join("eagle1-tiny-safetensors"), &target).unwrap();
    let ranking = Frequencies::from_counts(&(0..260u64).map(|i| (i * 37) % 101).collect::<Vec<_>>(), std::path::Path::new("synthetic"));
    let prompts: [&[u32]; 3] = [&[256, 72, 105, 33, 257, 256], &[1, 2, 3, 4, 5], &[200, 100, 50]];
    for prompt in prompts {
        let want = generate_tiny(&target, prompt, 24);
        for ratio in [0.0, 0.5, 0.9] {
            let keep = (ratio > 0.0).then(|| ranking.keep_set(KeepRule::Ratio(ratio), 260, &[]).unwrap());
            let cfg = SpecConfig { k: 3, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 24 };
            let mut outs = Vec::new();
            for draft in [&mut from_pickle as &mut dyn Draft<Model>, &mut from_safetensors] {
                let head = DraftHead::new(draft.lm_head(), keep.clone(), HeadMode::Slice).unwrap();
                let mut rng = ChaCha20Rng::seed_from_u64(0);
                outs.push(speculative_turn(&target, &[], draft, &head, prompt, &cfg, &mut rng).unwrap());
            }
            assert_eq!(outs[0].0, want, "EAGLE-1 from pytorch_model.bin, ratio {ratio}: output differs from target greedy");
            assert_eq!(outs[0].0, outs[1].0);
            assert_eq!(outs[0].1.without_timings(), outs[1].1.without_timings(), "pickle and safetensors heads draft alike");
        }
    }
}

fn generate_tiny(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    let mut logits = m.forward(prompt, &mut cache, &[prompt.len() - 1], &[]).unwrap().logits;
    let mut out = Vec::new();
    for _ in 0..n {
        let t = frspec::sampling::argmax(&logits);
        out.push(t);
        logits = m.forward(&[t], &mut cache, &[0], &[]).unwrap().logits;
    }
    out
}

/// Every (ratio × head mode × greedy/sampled) turn of an EAGLE-3 draft after `prompt`, in that order.
fn eagle3_turns<T: TargetModel>(target: &T, draft: &mut dyn Draft<T>, ranking: &Frequencies, prompt: &[u32]) -> Vec<(Vec<u32>, TurnRecord)> {
    let mut out = Vec::new();
    for ratio in [0.0, 0.5, 0.8] {
        let keep = (ratio > 0.0).then(|| ranking.keep_set(KeepRule::Ratio(ratio), 260, &[]).unwrap());
        for mode in [HeadMode::Slice, HeadMode::Mask] {
            let head = DraftHead::new(draft.lm_head(), keep.clone(), mode).unwrap();
            assert!(head.kept() <= 100);
            for sampling in [Sampling::GREEDY, Sampling::new(1.0, 1.0).unwrap()] {
                let cfg = SpecConfig { k: 3, mode: DraftMode::Sample, sampling, max_new_tokens: 20 };
                let (tokens, rec) = speculative_turn(target, &[], draft, &head, prompt, &cfg, &mut ChaCha20Rng::seed_from_u64(5)).unwrap();
                out.push((tokens, rec.without_timings()));
            }
        }
    }
    out
}

#[test]
fn eagle3_checkpoint_with_yuhuilis_key_names_drafts_losslessly_through_its_draft_vocabulary_on_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { layers: 4, ..Shape::tiny() };
    synthetic::write_model(dir.path(), &shape, 9, candle_core::DType::F32).unwrap();
    let target = Model::load(dir.path()).unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/fixtures/eagle3-tiny");
    let mut draft = frspec::engine::cpu::draft::EagleDraft::load_eagle3(&fixture, &target).unwrap();
    assert_eq!(draft.target_layers(), [2, 2, 1]);
    let draft_ids: Vec<u32> = (0..100).map(|d| DraftHead::new(draft.lm_head(), None, HeadMode::Slice).unwrap().id(d)).collect();
    assert_eq!(&draft_ids[..4], [0, 5, 6, 7], "d2t offsets map draft ids to target ids");
    let llama = Llama::from_engine(&target, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let mut on_candle = DraftWeights::from_engine(&Loaded::Eagle(frspec::engine::cpu::draft::EagleDraft::load_eagle3(&fixture, &target).unwrap()), &llama)
        .unwrap()
        .instance(&llama);
    let ranking = Frequencies::from_counts(&(0..260u64).map(|i| (i * 53) % 97).collect::<Vec<_>>(), std::path::Path::new("synthetic"));
    for prompt in [&[256u32, 72, 105, 33, 257][..], &[9, 8, 7, 6]] {
        let want = generate_tiny(&target, prompt, 20);
        let cpu = eagle3_turns(&target, &mut draft, &ranking, prompt);
        let candle = eagle3_turns(&llama, on_candle.as_mut(), &ranking, prompt);
        for (engine, turns) in [("cpu", &cpu), ("candle", &candle)] {
            // Per ratio: slice greedy, slice sampled, mask greedy, mask sampled.
            for (ratio, cell) in [0.0, 0.5, 0.8].iter().zip(turns.chunks(4)) {
                assert_eq!(cell[0].0, want, "{engine} engine, EAGLE-3 ratio {ratio}: output differs from target greedy");
                assert_eq!(cell[..2], cell[2..], "{engine} engine: slice and mask heads give identical records (ratio {ratio})");
            }
        }
        // Tokens and counts are equal; the expected accepted count sums ratios p/q, equal to float rounding.
        for ((cpu_tokens, cpu_rec), (tokens, rec)) in cpu.iter().zip(&candle) {
            assert_eq!(tokens, cpu_tokens, "the candle engine's EAGLE-3 tokens equal the CPU engine's");
            let close = (rec.expected_accepted - cpu_rec.expected_accepted).abs() <= 1e-5 * cpu_rec.expected_accepted.max(1.0);
            assert!(close, "expected accepted {} vs {}", rec.expected_accepted, cpu_rec.expected_accepted);
            let counts = |r: &TurnRecord| TurnRecord { expected_accepted: 0.0, ..r.clone() };
            assert_eq!(counts(rec), counts(cpu_rec), "the candle engine's EAGLE-3 counts equal the CPU engine's");
        }
    }
}

/// frspec's target, EAGLE-1 and EAGLE-3 logits against an independent torch implementation
/// (scripts/eagle_reference.py: HF transformers for the target, cnets1 / vLLM transcriptions for the heads).
#[test]
fn target_and_eagle_heads_match_the_torch_reference() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/fixtures");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("eagle_reference_logits.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = serde_json::from_value(reference["tokens"].clone()).unwrap();
    let target = Model::load(&fixtures.join("tiny-llama")).unwrap();
    let mut eagle3 = frspec::engine::cpu::draft::EagleDraft::load_eagle3(&fixtures.join("eagle3-tiny"), &target).unwrap();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let fwd = target.forward(&tokens, &mut target.new_cache(), &rows, &eagle3.target_layers()).unwrap();
    let mut features = frspec::engine::cpu::CpuFeatures::new(64, &eagle3.target_layers());
    features.append(&fwd.hidden, &fwd.layer_inputs);
    let ctx = frspec::speculative::Context { tokens: &tokens, features: &features };
    let worst = |ours: &[f32], key: &str| -> f64 {
        let want: Vec<Vec<f64>> = serde_json::from_value(reference[key].clone()).unwrap();
        let width = want[0].len();
        assert_eq!(ours.len(), want.len() * width, "{key}: shape");
        want.iter().flatten().zip(ours).map(|(w, o)| (w - *o as f64).abs()).fold(0.0, f64::max)
    };
    let t = worst(&fwd.logits, "target_logits");
    assert!(t < 1e-3, "target logits differ from HF transformers by {t}");
    let mut eagle1 = EagleDraft::load(&fixtures.join("eagle1-tiny"), &target).unwrap();
    let e1 = worst(&eagle1.teacher_forced_logits(&ctx).unwrap(), "eagle1_logits");
    assert!(e1 < 1e-3, "EAGLE-1 logits differ from the reference by {e1}");
    let e3 = worst(&eagle3.teacher_forced_logits(&ctx).unwrap(), "eagle3_logits");
    assert!(e3 < 1e-3, "EAGLE-3 logits differ from the reference by {e3}");
}

#[test]
fn greedy_fast_path_gives_the_full_loops_counts_for_every_draft_and_ratio() {
    let t = smollm2();
    let eagle_dir = tempfile::tempdir().unwrap();
    synthetic::write_eagle_head(eagle_dir.path(), &smollm2_shape(), 3).unwrap();
    let mut eagle = EagleDraft::load(eagle_dir.path(), &t.model).unwrap();
    let mut truncated = build(&DraftKind::Truncated(12), None, t, "smollm2").unwrap();
    let ratios = [0.0, 0.5, 0.9];
    let heads = |d: &dyn Draft<Model>| ratios.map(|r| DraftHead::new(d.lm_head(), keep(r), HeadMode::Slice).unwrap());
    let (eagle_heads, truncated_heads) = (heads(&eagle), heads(truncated.as_ref()));
    for prompt in mt_bench_prompts(3) {
        let want_tokens = generate(&t.model, &t.tokenizer.stop_ids, &prompt, 48, Sampling::GREEDY, &mut ChaCha20Rng::seed_from_u64(0)).unwrap().tokens;
        for k in [1, 4] {
            let mut full = Vec::new();
            for (draft, hs) in [(&mut eagle as &mut dyn Draft<Model>, &eagle_heads), (truncated.as_mut(), &truncated_heads)] {
                for head in hs.iter() {
                    let cfg = SpecConfig { k, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: 48 };
                    full.push(speculative_turn(&t.model, &t.tokenizer.stop_ids, draft, head, &prompt, &cfg, &mut ChaCha20Rng::seed_from_u64(0)).unwrap().1);
                }
            }
            // One draft runs along the continuation through every head, its state reset in between.
            let (tokens, mut fast) = greedy_turns(&t.model, &t.tokenizer.stop_ids, &mut eagle, &eagle_heads.iter().collect::<Vec<_>>(), &prompt, k, 48).unwrap();
            assert_eq!(tokens, want_tokens);
            let (tokens, more) = greedy_turns(&t.model, &t.tokenizer.stop_ids, truncated.as_mut(), &truncated_heads.iter().collect::<Vec<_>>(), &prompt, k, 48).unwrap();
            assert_eq!(tokens, want_tokens);
            fast.extend(more);
            for (i, (f, s)) in fast.iter().zip(&full).enumerate() {
                let strip = |r: &TurnRecord| TurnRecord { target_secs: 0.0, draft_secs: 0.0, ..r.clone() };
                assert_eq!(strip(f), strip(s), "k {k}, draft/ratio #{i}");
            }
            assert!(full.iter().any(|r| r.accepted > 0), "some drafts are accepted, so the comparison is not vacuous");
        }
    }
}

#[test]
fn bad_eagle3_checkpoints_are_refused() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/fixtures/eagle3-tiny");
    // Two target layers cannot provide inputs of layers 2, 1 and −1.
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(dir.path(), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    let shallow = Model::load(dir.path()).unwrap();
    let err = frspec::engine::cpu::draft::EagleDraft::load_eagle3(&fixture, &shallow).err().unwrap().to_string();
    assert!(err.contains("auxiliary layers") && err.contains("config.json"), "{err}");
    // A draft vocabulary that maps outside the target's.
    let small = tempfile::tempdir().unwrap();
    synthetic::write_model(small.path(), &Shape { layers: 4, vocab: 260, ..Shape::tiny() }, 1, candle_core::DType::F32).unwrap();
    let head = tempfile::tempdir().unwrap();
    for f in ["config.json", "pytorch_model.bin"] {
        std::fs::copy(fixture.join(f), head.path().join(f)).unwrap();
    }
    let config = head.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap().replace("\"vocab_size\": 260", "\"vocab_size\": 200");
    std::fs::write(&config, text).unwrap();
    let target = Model::load(small.path()).unwrap();
    let err = frspec::engine::cpu::draft::EagleDraft::load_eagle3(head.path(), &target).err().unwrap().to_string();
    assert!(err.contains("EAGLE-3 vocabulary 200 ≠ the target's 260"), "{err}");
}

#[test]
fn a_draft_identical_to_the_target_is_always_accepted() {
    let (dir, target, _) = tiny_pair();
    let twin = Model::load(&dir.path().join("target")).unwrap();
    let mut draft = ModelDraft::new(twin, "the target itself".into());
    let head = DraftHead::new(draft.lm_head(), None, HeadMode::Slice).unwrap();
    // Greedy, and sampling with q = p (every α = 1), over many seeds; stop on token 7 to exercise turn ends.
    for (mode, sampling) in [(DraftMode::Argmax, Sampling::GREEDY), (DraftMode::Sample, Sampling::new(1.0, 1.0).unwrap())] {
        for seed in 0..50 {
            let cfg = SpecConfig { k: 4, mode, sampling, max_new_tokens: 30 };
            let (_, r) = speculative_turn(&target, &[7], &mut draft, &head, &[3, 17, 5], &cfg, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap();
            assert_eq!(r.accepted, r.draft_tokens, "{mode:?} seed {seed}: {r:?}");
            assert!((r.expected_accepted - r.accepted as f64).abs() < 1e-9, "α = 1 everywhere: {r:?}");
        }
    }
}

/// The sweep of `plan` over `questions` on one engine, `batch` sequences at a time, with the shipped EAGLE-1 head
/// (one instance per slot) and a head per ratio; records without timings, in the order units finish.
#[test]
fn batched_sweeps_give_every_record_of_one_sequence_at_a_time() {
    let t = smollm2();
    // Questions 81–83: SmolLM2 ends some of its sampled answers to them before 128 tokens (which ones depends on
    // the kernels' rounding; the assertion below says so if a kernel change makes them all end alike).
    let questions = frspec::text::dataset::load("mt-bench").unwrap()[..3].to_vec();
    let plan = Plan { ratios: vec![0.0, 0.9], temperatures: vec![0.0, 1.0], top_p: 1.0, repeats: 2, seed: 0, k: 4, turns: 1, max_new_tokens: 128, mode: DraftMode::Argmax };
    let load = || frspec::engine::cpu::draft::load(&DraftKind::Eagle, Some(frspec::spec::SMOLLM2_HEAD), t, "smollm2").unwrap();
    let on_cpu = |batch: usize| batched_sweep(&t.model, (0..batch).map(|_| load().boxed()).collect(), &questions, &plan);
    let one = on_cpu(1);
    assert_eq!(one.len(), 2 * 2 * 2 * 3, "ratios × temperatures × repeats × prompts");
    let sampled: Vec<&Run> = one.iter().filter(|r| r.temperature == 1.0).collect();
    // Turns that end at different lengths share batches, and drafts are accepted: the comparison is not vacuous.
    let ends = |stop| sampled.iter().filter(|r| r.record.stop == Some(stop)).count();
    assert!(ends(StopReason::EndOfTurn) > 0 && ends(StopReason::MaxTokens) > 0, "pick questions whose sampled turns end both ways: {} end of turn, {} max tokens", ends(StopReason::EndOfTurn), ends(StopReason::MaxTokens));
    assert!(one.iter().filter(|r| r.record.accepted > 0).count() > one.len() / 2);
    let sorted = |mut runs: Vec<Run>| {
        runs.sort_by(|a, b| (a.temperature, a.ratio, a.prompt_index, a.repeat).partial_cmp(&(b.temperature, b.ratio, b.prompt_index, b.repeat)).unwrap());
        runs
    };
    let one = sorted(one);
    assert_eq!(sorted(on_cpu(8)), one, "CPU engine: batch 8 vs 1");
}

#[test]
fn turns_starting_from_positions_another_slot_holds_give_what_they_give_alone() {
    // The loop copies the positions of a prompt that a slot holds (the same prompt at another ratio, the chat before
    // a later turn, a shared opening) instead of forwarding them again, and a turn whose prompt another slot forwards
    // in the same step waits for it; at batch 1 a slot truncates its own last turn. Every turn must still give what
    // it gives alone, tokens and record, bit for bit, at T = 1.
    use frspec::speculative::decode::{speculative_turns, TurnJob};
    let t = smollm2();
    let load = || frspec::engine::cpu::draft::load(&DraftKind::Eagle, Some(frspec::spec::SMOLLM2_HEAD), t, "smollm2").unwrap().boxed();
    let heads = [0.0, 0.9].map(|r| DraftHead::new(load().lm_head(), keep(r), HeadMode::Slice).unwrap());
    let prompts = mt_bench_prompts(2);
    let later = [&prompts[0][..], &prompts[1][..]].concat();
    let jobs = [(&prompts[0], 0, 1), (&prompts[0], 1, 1), (&prompts[0], 1, 2), (&later, 0, 3), (&prompts[1], 1, 4), (&prompts[0], 0, 5)];
    let cfg = SpecConfig { k: 4, mode: DraftMode::Argmax, sampling: Sampling::new(1.0, 1.0).unwrap(), max_new_tokens: 48 };
    let alone: Vec<(Vec<u32>, TurnRecord)> = jobs
        .iter()
        .map(|&(prompt, head, seed)| {
            let (tokens, rec) = speculative_turn(&t.model, &t.tokenizer.stop_ids, load().as_mut(), &heads[head], prompt, &cfg, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap();
            (tokens, rec.without_timings())
        })
        .collect();
    assert!(alone.iter().filter(|(_, r)| r.accepted > 0).count() > 3, "drafts are accepted: the comparison is not vacuous");
    for batch in [1, 3] {
        let mut drafts: Vec<Box<dyn Draft<Model>>> = (0..batch).map(|_| load()).collect();
        let mut slots: Vec<&mut dyn Draft<Model>> = drafts.iter_mut().map(|d| d.as_mut() as _).collect();
        let turns = jobs.iter().enumerate().map(|(id, &(prompt, head, seed))| TurnJob { id, prompt: prompt.clone(), head: &heads[head], rng: Box::new(ChaCha20Rng::seed_from_u64(seed)) });
        let mut queue = Queue { jobs: turns.collect(), done: Vec::new() };
        speculative_turns(&t.model, &t.tokenizer.stop_ids, &mut slots, &cfg, &mut queue).unwrap();
        queue.done.sort_by_key(|d| d.0);
        let got: Vec<(Vec<u32>, TurnRecord)> = queue.done.into_iter().map(|(_, tokens, rec)| (tokens, rec.without_timings())).collect();
        assert_eq!(got, alone, "batch {batch}");
    }
}

#[test]
fn cpu_drafts_fed_together_give_each_what_it_gets_alone_bit_for_bit() {
    // On the CPU engine the loop feeds every slot's EAGLE draft in one pass over the layer's weights, each at its own
    // positions of its own cache: each draft's head input must be what it gets fed alone, bit for bit (EAGLE-1 and
    // EAGLE-3, catching up on prompts of different lengths, two drafted tokens for all, a third for two of them).
    let t = smollm2();
    for (kind, head) in [(DraftKind::Eagle, frspec::spec::SMOLLM2_HEAD), (DraftKind::Eagle3, frspec::spec::SMOLLM2_EAGLE3_HEAD)] {
        let loaded = frspec::engine::cpu::draft::load(&kind, Some(head), t, "smollm2").unwrap();
        let mut drafts: Vec<_> = (0..3).map(|_| loaded.fresh().boxed()).collect();
        fed_alone_and_together(&t.model, &mut drafts, |row| row, |i, step, got, want| {
            assert!(got == want, "{kind}: draft {i} at position {step} differs from its row fed alone");
        });
    }
}

#[test]
fn heads_nested_in_one_another_are_served_by_one_product_of_the_largest() {
    // Sequences drafting at ratios 0, 0.5 and 0.9 through the shipped EAGLE-1 head choose from one product of the
    // full head: each must get the tokens and q it gets through its own sliced head alone, for argmax drafts and for
    // draws at T = 1 (same stream). The positions of a head's rows within another are checked against the ids.
    use frspec::speculative::draft::{choose_many, Choice};
    use frspec::speculative::Chooser;
    let t = smollm2();
    let draft = build(&DraftKind::Eagle, Some(frspec::spec::SMOLLM2_HEAD), t, "smollm2").unwrap();
    let heads: Vec<DraftHead<_>> = [0.0, 0.5, 0.9].iter().map(|&r| DraftHead::new(draft.lm_head(), keep(r), HeadMode::Slice).unwrap()).collect();
    for (small, large) in [(1, 0), (2, 0), (2, 1)] {
        let within = heads[small].rows_within(&heads[large]).expect("nested keep sets");
        assert_eq!(within.len(), heads[small].kept());
        assert!(within.iter().enumerate().all(|(i, &j)| heads[small].id(i) == heads[large].id(j as usize)), "{small} within {large}");
        assert!(heads[large].rows_within(&heads[small]).is_none(), "a larger head is not within a smaller one");
    }
    let masked = DraftHead::new(draft.lm_head(), keep(0.5), HeadMode::Mask).unwrap();
    assert!(masked.rows_within(&heads[0]).is_none(), "a masked head is served by its own product");
    let hidden: Vec<Vec<f32>> = (0..3).map(|i| (0..t.model.config.hidden).map(|j| ((i * 31 + j * 7) % 13) as f32 / 6.0 - 1.0).collect()).collect();
    for (mode, sampling) in [(DraftMode::Argmax, Sampling::GREEDY), (DraftMode::Sample, Sampling { temperature: 1.0, ..Sampling::GREEDY })] {
        let alone: Vec<frspec::speculative::Proposal> = (0..3)
            .map(|i| {
                let mut out = frspec::speculative::Proposal::default();
                let mut chooser = Chooser::default();
                let mut rng = ChaCha20Rng::seed_from_u64(i as u64);
                let choice = Choice { chooser: &mut chooser, hidden: &hidden[i], rng: &mut rng, out: &mut out, head: &heads[i], within: None };
                choose_many(&heads[i], &mut [choice], mode, sampling, &mut Default::default(), &mut Vec::new()).unwrap();
                out
            })
            .collect();
        let within: Vec<Option<Vec<u32>>> = (0..3).map(|i| (i > 0).then(|| heads[i].rows_within(&heads[0]).unwrap())).collect();
        let mut outs: Vec<frspec::speculative::Proposal> = (0..3).map(|_| Default::default()).collect();
        let mut choosers: Vec<Chooser<_>> = (0..3).map(|_| Chooser::default()).collect();
        let mut rngs: Vec<ChaCha20Rng> = (0..3).map(|i| ChaCha20Rng::seed_from_u64(i as u64)).collect();
        let mut choices: Vec<Choice<_>> = choosers
            .iter_mut()
            .zip(rngs.iter_mut())
            .zip(outs.iter_mut())
            .enumerate()
            .map(|(i, ((chooser, rng), out))| Choice { chooser, hidden: &hidden[i], rng, out, head: &heads[i], within: within[i].as_deref() })
            .collect();
        choose_many(&heads[0], &mut choices, mode, sampling, &mut Default::default(), &mut Vec::new()).unwrap();
        drop(choices);
        for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
            assert_eq!((&got.tokens, &got.q_token), (&want.tokens, &want.q_token), "{mode:?}: sequence {i}");
            assert_eq!(got.q.first(), want.q.first(), "{mode:?}: sequence {i}'s q");
        }
    }
}
