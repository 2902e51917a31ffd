//! EAGLE-1 and EAGLE-3 head training on tiny synthetic targets: the loss falls, a resumed run continues exactly
//! where an uninterrupted one is, and the exported head computes in the engine what it computed in training (the
//! unrolled steps of the training-time test included).

use frspec::engine::cpu::draft::EagleDraft;
use frspec::engine::cpu::model::Model;
use frspec::engine::cpu::CpuFeatures;
use frspec::speculative::{Context, Draft};
use frspec::synthetic::{self, Shape};
use frspec::loading::target::Target;
use frspec::train::{self, Arch, Conversation, State, TrainSettings, Trainer};

fn corpus() -> Vec<String> {
    let words = ["the", "river", "town", "council", "voted", "to", "build", "a", "new", "bridge", "over", "quiet", "water", "and", "school"];
    (0..60).map(|i| (0..12).map(|j| words[(i * 7 + j * 3 + i * j) % words.len()]).collect::<Vec<_>>().join(" ")).collect()
}

fn settings(steps: usize) -> TrainSettings {
    TrainSettings {
        steps,
        seed: 5,
        batch: 2,
        lr: 3e-3,
        warmup: 4,
        weight_decay: 0.0,
        checkpoint_every: 10,
        classification_weight: frspec::train::EAGLE_CLASSIFICATION_WEIGHT,
        feature_weight: 1.0,
        unroll: 2,
        unroll_decay: frspec::train::EAGLE3_UNROLL_DECAY,
        arch: Arch::Eagle1,
        draft_vocab: 0,
    }
}

/// A tiny target of `layers` layers and its answers to eight prompts, with the inputs of the layers `arch` reads.
fn target_and_data(layers: usize, arch: Arch) -> (tempfile::TempDir, Target, Vec<Conversation>) {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(dir.path(), &Shape { layers, ..Shape::tiny() }, 3, candle_core::DType::F32).unwrap();
    let target = Target::load(dir.path().to_str().unwrap()).unwrap();
    let prompts = train::prompts(&corpus(), 8, 1, &train::TEMPLATES).unwrap();
    let data = train::teacher_data(&target, &prompts, 24, &arch.capture(&target.model.config), &mut |_| {}).unwrap();
    (dir, target, data)
}

fn setup() -> (tempfile::TempDir, Target, Vec<Conversation>) {
    target_and_data(Shape::tiny().layers, Arch::Eagle1)
}

#[test]
fn prompts_take_the_templates_in_turn_around_the_same_passages() {
    let builtin = train::prompts(&corpus(), 4, 1, &train::TEMPLATES).unwrap();
    let own = train::prompts(&corpus(), 4, 1, &["A: {}", "B {} end"]).unwrap();
    for (i, (b, o)) in builtin.iter().zip(&own).enumerate() {
        let passage = b.strip_prefix(&train::TEMPLATES[i].replace("{}", "")).unwrap();
        assert_eq!(o, &if i % 2 == 0 { format!("A: {passage}") } else { format!("B {passage} end") });
    }
}

#[test]
fn loss_falls_and_a_resumed_run_equals_an_uninterrupted_one() {
    let (dir, target, data) = setup();
    assert!(data.iter().all(|c| c.tokens.len() > c.prompt_len && c.features.len() == (c.tokens.len() - 1) * 64));
    let all: Vec<&Conversation> = data.iter().collect();
    let trainer = Trainer { target: &target, data: &data, keep: None, settings: settings(40) };
    let mut state = trainer.start().unwrap();
    let before = trainer.evaluate(&state, &all).unwrap();
    trainer.run(&mut state, 40, &mut |_, _| Ok(())).unwrap();
    let after = trainer.evaluate(&state, &all).unwrap();
    assert!(after.loss < 0.7 * before.loss, "loss {:.4} → {:.4}", before.loss, after.loss);
    assert!(after.regression < before.regression && after.classification < before.classification, "{before:?} → {after:?}");

    // 12 steps at once, or 6, a checkpoint on disk, and 6 more from it.
    let mut whole = trainer.start().unwrap();
    trainer.run(&mut whole, 12, &mut |_, _| Ok(())).unwrap();
    let mut first = trainer.start().unwrap();
    trainer.run(&mut first, 6, &mut |_, _| Ok(())).unwrap();
    let ckpt = dir.path().join("checkpoint.safetensors");
    first.save(&ckpt).unwrap();
    let mut resumed = State::load(&ckpt).unwrap();
    assert_eq!(resumed.step, 6);
    trainer.run(&mut resumed, 12, &mut |_, _| Ok(())).unwrap();
    assert!(whole.same_as(&resumed).unwrap(), "resumed weights and moments differ from the uninterrupted run's");
    assert!(!whole.same_as(&first).unwrap());
}

#[test]
fn the_loss_weighs_features_and_cross_entropy_as_set_and_adds_the_unrolled_steps() {
    let (_dir, target, data) = setup();
    let all: Vec<&Conversation> = data.iter().collect();
    let log_of = |s: TrainSettings| {
        let trainer = Trainer { target: &target, data: &data, keep: None, settings: s };
        trainer.evaluate(&trainer.start().unwrap(), &all).unwrap()
    };
    for (features, tokens) in [(1.0, 0.0), (1.0, 0.1), (0.3, 1.0), (0.0, 1.0)] {
        let log = log_of(TrainSettings { classification_weight: tokens, feature_weight: features, unroll: 0, ..settings(1) });
        let expected = features * log.regression + tokens * log.classification;
        assert!(log.classification > 0.0 && (log.loss - expected).abs() < 1e-5 * expected, "weights {features}, {tokens}: {log:?}");
        // Cross-entropy = forward KL + the teacher's entropy, which is positive over a vocabulary of 64.
        assert!(log.kl > 0.0 && log.kl < log.classification && log.unrolled_top1.is_empty(), "{log:?}");
    }
    // Unrolled steps add their losses on top, and log their agreement, one per step.
    let alone = log_of(TrainSettings { unroll: 0, ..settings(1) });
    let unrolled = log_of(settings(1));
    assert_eq!(unrolled.unrolled_top1.len(), 2);
    assert_eq!((unrolled.regression, unrolled.classification, unrolled.top1), (alone.regression, alone.classification, alone.top1));
    assert!(unrolled.loss > alone.loss + 0.1 * alone.loss, "{alone:?} → {unrolled:?}");
}

#[test]
fn the_kl_term_equals_its_hand_computed_value() {
    // Teacher [½, ¼, ¼], head [¼, ¼, ½]: KL = ½ ln 2 + ¼ ln 1 + ¼ ln ½ = ¼ ln 2. A second row with equal
    // distributions (shifted logits) adds 0, and the mean over the two rows halves it.
    let dev = candle_core::Device::Cpu;
    let ln2 = std::f32::consts::LN_2;
    let teacher = candle_core::Tensor::new(&[[ln2, 0.0, 0.0], [1.0, 2.0, 3.0]], &dev).unwrap();
    let head = candle_core::Tensor::new(&[[0.0, 0.0, ln2], [11.0, 12.0, 13.0]], &dev).unwrap();
    let kl = train::kl_divergence(&teacher, &head).unwrap().to_scalar::<f32>().unwrap();
    let expected = 0.25 * ln2 / 2.0;
    assert!((kl - expected).abs() < 1e-6, "{kl} against {expected}");
    // A teacher probability that underflows to 0 adds 0, not NaN.
    let sharp = candle_core::Tensor::new(&[[0.0f32, -200.0, 0.0]], &dev).unwrap();
    let flat = candle_core::Tensor::new(&[[0.0f32, 0.0, 0.0]], &dev).unwrap();
    let kl = train::kl_divergence(&sharp, &flat).unwrap().to_scalar::<f32>().unwrap();
    assert!((kl - (1.5f32).ln()).abs() < 1e-6, "{kl}");
}

#[test]
fn the_exported_head_runs_in_the_engine_as_it_trained() {
    let (dir, target, data) = setup();
    let trainer = Trainer { target: &target, data: &data, keep: None, settings: settings(5) };
    let mut state = trainer.start().unwrap();
    trainer.run(&mut state, 5, &mut |_, _| Ok(())).unwrap();
    let head = dir.path().join("head");
    std::fs::create_dir_all(&head).unwrap();
    train::export(&head, &state, &target.model, None).unwrap();

    let exported = State::from_head(&head).unwrap();
    let conv = &data[0];
    let expected = train::teacher_forced_logits(&target.model, &exported, conv).unwrap();
    let mut draft = EagleDraft::load(&head, &target.model).unwrap();
    let h = target.model.config.hidden;
    let features = CpuFeatures::from_hidden(conv.features_f32(), h);
    let ctx = Context { tokens: &conv.tokens, features: &features };
    let worst = worst_difference(&draft.teacher_forced_logits(&ctx).unwrap(), &expected);
    assert!(worst < 1e-3, "engine and training forward differ by {worst}");

    let unrolled = train::unrolled_outputs(&target.model, &exported, conv, 3).unwrap();
    assert_unrolled_steps_are_the_engines_drafts(&mut draft, &unrolled, conv, &features);
}

/// Unrolled step j at position i computes what the engine's (j + 1)-th draft of a step does: catch up on true
/// inputs through position i − j, then extend j times with the next tokens, each fed the head's own output.
fn assert_unrolled_steps_are_the_engines_drafts(draft: &mut dyn Draft<Model>, unrolled: &[Vec<f32>], conv: &Conversation, features: &CpuFeatures) {
    let h = unrolled[0].len() / (conv.tokens.len() - 1);
    for (j, step) in unrolled.iter().enumerate().map(|(j, s)| (j + 1, s)) {
        for i in [j, conv.tokens.len() / 2, conv.tokens.len() - 2] {
            draft.reset();
            // Features beyond the tokens given are not read.
            draft.catch_up(&Context { tokens: &conv.tokens[..=i + 1 - j], features }).unwrap();
            let mut got = Vec::new();
            for t in &conv.tokens[i + 2 - j..=i + 1] {
                got = draft.extend(*t).unwrap();
            }
            let worst = worst_difference(&got, &step[i * h..(i + 1) * h]);
            assert!(worst < 1e-3, "step {j}, position {i}: the engine's draft {} and the unrolled step differ by {worst}", j + 1);
        }
    }
}

fn worst_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
}

#[test]
fn an_eagle3_head_learns_and_runs_in_the_engine_as_it_trained() {
    let (dir, target, data) = target_and_data(8, Arch::Eagle3);
    let capture = Arch::Eagle3.capture(&target.model.config);
    assert_eq!(capture, [2, 4, 5]);
    assert!(data.iter().all(|c| c.layers.len() == (c.tokens.len() - 1) * 3 * 64));
    // Forcing an answer through the target gives the streams generating it recorded (how an EAGLE-1 run's teacher
    // data is taken over).
    for c in &data[..2] {
        assert_eq!(&train::forced(&target.model, c.tokens.clone(), c.prompt_len, &capture).unwrap(), c);
    }
    let vocab = train::draft_vocabulary(&data, 100, 260).unwrap();
    let (features, tokens) = Arch::Eagle3.loss_weights();
    let settings = TrainSettings { arch: Arch::Eagle3, feature_weight: features, classification_weight: tokens, draft_vocab: 100, ..settings(40) };
    let trainer = Trainer { target: &target, data: &data, keep: Some(&vocab), settings };
    let all: Vec<&Conversation> = data.iter().collect();
    let mut state = trainer.start().unwrap();
    let before = trainer.evaluate(&state, &all).unwrap();
    trainer.run(&mut state, 40, &mut |_, _| Ok(())).unwrap();
    let after = trainer.evaluate(&state, &all).unwrap();
    // The random target's next-token distributions are nearly flat, so the cross-entropy is mostly their entropy:
    // what the head learns shows in the KL.
    assert!(after.loss < before.loss && after.kl < 0.5 * before.kl && after.top1 > before.top1, "{before:?} → {after:?}");
    assert!(after.regression == 0.0 && after.unrolled_top1.len() == 2, "{after:?}");

    let head = dir.path().join("eagle3-head");
    std::fs::create_dir_all(&head).unwrap();
    train::export(&head, &state, &target.model, Some(&vocab)).unwrap();
    let exported = State::from_head(&head).unwrap();
    assert_eq!(exported.arch, Arch::Eagle3);
    let mut draft = EagleDraft::load_eagle3(&head, &target.model).unwrap();
    assert_eq!(draft.target_layers(), capture);
    assert_eq!(draft.lm_head().row_ids.as_deref(), Some(&vocab.ids), "d2t maps the draft rows to the draft vocabulary");
    let conv = &data[0];
    let mut features = CpuFeatures::new(64, &capture);
    (features.hidden, features.layers) = (conv.features_f32(), conv.layers_f32());
    let ctx = Context { tokens: &conv.tokens, features: &features };
    let worst = worst_difference(&draft.teacher_forced_logits(&ctx).unwrap(), &train::teacher_forced_logits(&target.model, &exported, conv).unwrap());
    assert!(worst < 1e-3, "engine and training forward differ by {worst}");
    let unrolled = train::unrolled_outputs(&target.model, &exported, conv, 3).unwrap();
    assert_unrolled_steps_are_the_engines_drafts(&mut draft, &unrolled, conv, &features);

    // Packed as heads ship (Q8_0 in model.gguf), the same head: its draft vocabulary and layers exactly, its logits
    // within Q8_0's rounding (a weight moves by at most half a step of its block's largest / 127).
    let packed = dir.path().join("eagle3-packed");
    frspec::loading::pack::pack(&head, &packed).unwrap();
    let first = std::fs::read(packed.join("model.gguf")).unwrap();
    frspec::loading::pack::pack(&head, &packed).unwrap();
    assert_eq!(std::fs::read(packed.join("model.gguf")).unwrap(), first, "the same head packs to the same bytes");
    assert!(!packed.join("model.safetensors").exists());
    let mut quantized = EagleDraft::load_eagle3(&packed, &target.model).unwrap();
    assert_eq!(quantized.target_layers(), capture);
    assert_eq!(quantized.lm_head().row_ids.as_deref(), Some(&vocab.ids));
    let (full, q8) = (draft.teacher_forced_logits(&ctx).unwrap(), quantized.teacher_forced_logits(&ctx).unwrap());
    let spread = full.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = worst_difference(&q8, &full);
    assert!(worst > 0.0 && worst < 0.02 * spread, "Q8_0 logits differ by {worst} (largest logit {spread})");
}

#[test]
fn the_draft_vocabulary_is_the_answers_most_frequent_ids_in_id_order() {
    let conv = |tokens: Vec<u32>, prompt_len| Conversation { tokens, prompt_len, features: Default::default(), layers: Default::default() };
    // Answers 5 5 7 and 7 7 2: 7 three times, 5 twice, 2 once; the prompts' 9s and 1 do not count.
    let data = [conv(vec![9, 9, 9, 5, 5, 7], 3), conv(vec![1, 7, 7, 2], 1)];
    let ids = |size| train::draft_vocabulary(&data, size, 10).unwrap().ids;
    assert_eq!(ids(1), [7]);
    assert_eq!(ids(2), [5, 7]);
    assert_eq!(ids(3), [2, 5, 7]);
    // Fewer distinct ids than asked for: the lowest unused ones fill it.
    assert_eq!(ids(5), [0, 1, 2, 5, 7]);
    for size in [0, 11] {
        let err = train::draft_vocabulary(&data, size, 10).unwrap_err().to_string();
        assert!(err.contains("--draft-vocab must be between 1 and the target's vocabulary of 10"), "{err}");
    }
}

#[test]
fn teacher_forcing_the_targets_own_answer_gives_its_generation_features() {
    let (_dir, target, data) = setup();
    for c in &data[..3] {
        assert_eq!(&train::forced(&target.model, c.tokens.clone(), c.prompt_len, &[]).unwrap(), c);
    }
    // A continuation is answered by the corpus passages that follow the one it quotes.
    let lines = corpus();
    let pairs = train::continuations(&lines, 5, 2).unwrap();
    let passages: Vec<String> = lines.chunks(3).map(|c| c.join(" ")).collect();
    for (prompt, answer) in &pairs {
        let p = passages.iter().position(|x| prompt.ends_with(x.as_str())).expect("the prompt quotes a passage");
        assert!(answer.starts_with(&passages[p + 1]), "{answer}");
    }
    let convs = train::teacher_forced(&target, &pairs, 10, &[], &mut |_| {}).unwrap();
    assert!(convs.iter().all(|c| c.tokens.len() == c.prompt_len + 10 && c.features.len() == (c.tokens.len() - 1) * 64));
}

#[test]
fn training_against_a_keep_set_learns_and_the_whole_vocabulary_as_keep_set_changes_nothing() {
    let (_dir, target, data) = setup();
    let all: Vec<&Conversation> = data.iter().collect();
    let vocab = target.model.config.vocab;
    let whole = frspec::vocab::KeepSet { ids: (0..vocab as u32).collect(), vocab };
    let plain = Trainer { target: &target, data: &data, keep: None, settings: settings(5) };
    let as_keep = Trainer { target: &target, data: &data, keep: Some(&whole), settings: settings(5) };
    let state = plain.start().unwrap();
    let (a, b) = (plain.evaluate(&state, &all).unwrap(), as_keep.evaluate(&state, &all).unwrap());
    assert!((a.loss - b.loss).abs() < 1e-5 && a.top1 == b.top1, "{a:?} vs {b:?}");

    // The byte tokens of the corpus and the chat specials; the head proposes only these.
    let kept = frspec::vocab::KeepSet { ids: (32..128).chain([256, 257]).collect(), vocab };
    let trainer = Trainer { target: &target, data: &data, keep: Some(&kept), settings: settings(30) };
    let mut state = trainer.start().unwrap();
    let before = trainer.evaluate(&state, &all).unwrap();
    trainer.run(&mut state, 30, &mut |_, _| Ok(())).unwrap();
    let after = trainer.evaluate(&state, &all).unwrap();
    assert!(after.classification < before.classification && after.loss < before.loss, "{before:?} → {after:?}");
}

#[test]
fn the_target_writes_its_own_requests_the_same_for_a_seed() {
    let (_dir, target, _) = setup();
    let requests = |count, seed, max_tokens| train::self_prompts(&target, count, seed, max_tokens, Default::default(), &mut |_| Ok(()));
    let a = requests(5, 7, 48).unwrap();
    assert_eq!(a, requests(5, 7, 48).unwrap());
    assert_ne!(a, requests(5, 8, 48).unwrap());
    assert_eq!(a.iter().collect::<std::collections::HashSet<_>>().len(), 5, "{a:?}");
    assert!(a.iter().all(|r| !r.is_empty() && r.trim() == r), "{a:?}");
    // A request does not depend on how many are asked for.
    assert_eq!(requests(2, 7, 48).unwrap(), a[..2]);
    // No turn can end with a request in one token: one clear error, not an endless loop.
    let err = requests(2, 7, 1).unwrap_err().to_string();
    assert!(err.contains("wrote only 0 usable requests"), "{err}");
}

#[test]
fn writing_requests_resumed_after_any_batch_writes_the_same_ones() {
    let (_dir, target, _) = setup();
    // More requests than one batch has attempts, so writing stops between batches at least once.
    let count = 20;
    let mut stops = Vec::new();
    let all = train::self_prompts(&target, count, 7, 48, Default::default(), &mut |so_far| {
        stops.push(so_far.clone());
        Ok(())
    })
    .unwrap();
    assert_eq!(all.len(), count);
    let unfinished: Vec<&train::WrittenRequests> = stops.iter().filter(|s| s.requests.len() < count).collect();
    assert!(unfinished.len() >= 2, "{} stops", stops.len());
    for stop in unfinished {
        assert_eq!(all[..stop.requests.len()], stop.requests[..]);
        let mut told = Vec::new();
        let resumed = train::self_prompts(&target, count, 7, 48, stop.clone(), &mut |so_far| {
            told.push(so_far.attempts);
            Ok(())
        })
        .unwrap();
        assert_eq!(resumed, all, "resumed after {} attempts", stop.attempts);
        assert!(told.iter().all(|&a| a > stop.attempts), "{told:?}");
    }
    // A state no writing stops in is one error, before any decoding.
    let first = stops.iter().find(|s| !s.requests.is_empty()).unwrap();
    for bad in [
        train::WrittenRequests { attempts: first.attempts + 1, ..first.clone() },
        train::WrittenRequests { attempts: 0, ..first.clone() },
        train::WrittenRequests { requests: vec!["same".into(), "same".into()], ..first.clone() },
    ] {
        let err = train::self_prompts(&target, count, 7, 48, bad, &mut |_| panic!("decoded")).unwrap_err().to_string();
        assert!(err.contains("is not where writing 20 in batches of 16 stops"), "{err}");
    }
}

#[test]
fn teacher_data_reads_back_as_saved_and_a_damaged_file_is_one_error_naming_it() {
    let (dir, _target, data) = target_and_data(8, Arch::Eagle3);
    let path = dir.path().join("teacher.safetensors");
    train::save_teacher(&path, &data, 64).unwrap();
    assert!(data.iter().all(|c| !c.layers.is_empty()));
    assert_eq!(train::load_teacher(&path, 64).unwrap(), data);
    // EAGLE-1 data has no streams, and the file then holds no layers tensor.
    let eagle1: Vec<Conversation> = data.iter().map(|c| Conversation { layers: Default::default(), ..c.clone() }).collect();
    train::save_teacher(&path, &eagle1, 64).unwrap();
    assert_eq!(train::load_teacher(&path, 64).unwrap(), eagle1);
    let saved = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    assert!(!saved.contains_key("layers"));
    // Loaded data is read in place from the file, and stays readable when the file is saved over (as a run caching
    // a part it completed does).
    train::save_teacher(&path, &data, 64).unwrap();
    let loaded = train::load_teacher(&path, 64).unwrap();
    assert!(loaded.iter().all(|c| matches!((&c.features, &c.layers), (train::Halves::Mapped { .. }, train::Halves::Mapped { .. }))));
    train::save_teacher(&path, &loaded[1..], 64).unwrap();
    assert_eq!(loaded, data);
    assert_eq!(train::load_teacher(&path, 64).unwrap(), data[1..]);

    let damaged = |change: &dyn Fn(&mut std::collections::HashMap<String, candle_core::Tensor>), hidden: usize| {
        let mut tensors = saved.clone();
        change(&mut tensors);
        let bad = dir.path().join("damaged.safetensors");
        candle_core::safetensors::save(&tensors, &bad).unwrap();
        let err = format!("{:#}", train::load_teacher(&bad, hidden).unwrap_err());
        assert!(err.contains(&bad.display().to_string()), "{err}");
        err
    };
    let ints = |v: Vec<i64>| candle_core::Tensor::new(v, &candle_core::Device::Cpu).unwrap();
    let offsets = saved["offsets"].to_vec1::<i64>().unwrap();
    let mut past_end = offsets.clone();
    *past_end.last_mut().unwrap() += 1;
    assert!(damaged(&|t| drop(t.insert("offsets".into(), ints(past_end.clone()))), 64).contains("offsets or prompt lengths do not split the tokens"));
    let mut one_token = offsets.clone();
    one_token[1] = 1;
    assert!(damaged(&|t| drop(t.insert("offsets".into(), ints(one_token.clone()))), 64).contains("conversations of two tokens or more"));
    assert!(damaged(&|t| drop(t.remove("prompt_lens")), 64).contains("no tensor prompt_lens"));
    let f32_features = saved["features"].to_dtype(candle_core::DType::F32).unwrap();
    assert!(damaged(&|t| drop(t.insert("features".into(), f32_features.clone())), 64).contains("tensor features is F32"));
    let fewer_rows = saved["features"].narrow(0, 1, saved["features"].dim(0).unwrap() - 1).unwrap();
    assert!(damaged(&|t| drop(t.insert("features".into(), fewer_rows.clone())), 64).contains("rows of features for"));
    assert!(damaged(&|_| (), 32).contains("features are 64 wide, the target's hidden size is 32"));
    let mut negative = saved["tokens"].to_vec1::<i64>().unwrap();
    negative[3] = -1;
    assert!(damaged(&|t| drop(t.insert("tokens".into(), ints(negative.clone()))), 64).contains("token -1"));

    std::fs::write(&path, b"not a safetensors file").unwrap();
    let err = format!("{:#}", train::load_teacher(&path, 64).unwrap_err());
    assert!(err.contains(&path.display().to_string()) && err.contains("is not a safetensors file"), "{err}");
}
