//! The sweep core on a tiny synthetic target with a separate synthetic draft model.

use frspec::text::dataset::Question;
use frspec::speculative::decode::TurnRecord;
use frspec::engine::cpu::draft::build;
use frspec::engine::cpu::model::Model;
use frspec::speculative::{Draft, DraftHead, DraftKind, DraftMode, HeadMode};
use frspec::sweep::{run, Engine, Plan, Run, UnitKey};
use frspec::synthetic::{self, Shape};
use frspec::loading::target::Target;
use frspec::vocab::{Frequencies, KeepRule};

fn questions(turns: usize) -> Vec<Question> {
    (0..3)
        .map(|i| Question { id: format!("{}", 81 + i), category: None, turns: (0..turns).map(|t| format!("question {i} turn {t}")).collect() })
        .collect()
}

fn plan(ratios: Vec<f64>) -> Plan {
    Plan { ratios, temperatures: vec![0.0, 1.0], top_p: 1.0, repeats: 2, seed: 11, k: 3, turns: 2, max_new_tokens: 8, mode: DraftMode::Sample }
}

fn sweep(target: &Target, draft_dir: &str, plan: &Plan, qs: &[Question]) -> anyhow::Result<Vec<Run>> {
    sweep_batched(target, draft_dir, plan, qs, 2)
}

/// The sweep with `batch` sequences decoded together (one draft per slot).
fn sweep_batched(target: &Target, draft_dir: &str, plan: &Plan, qs: &[Question], batch: usize) -> anyhow::Result<Vec<Run>> {
    let freqs = Frequencies::from_counts(&(0..260u64).map(|i| (i * 31) % 89).collect::<Vec<_>>(), std::path::Path::new("synthetic"));
    let mut drafts: Vec<Box<dyn Draft<Model> + '_>> =
        (0..batch).map(|_| build(&DraftKind::Model, Some(draft_dir), target, "unused")).collect::<anyhow::Result<_>>()?;
    let heads = plan
        .ratios
        .iter()
        .map(|&r| {
            let keep = (r > 0.0).then(|| freqs.keep_set(KeepRule::Ratio(r), 260, &target.tokenizer.stop_ids)).transpose()?;
            DraftHead::new(drafts[0].lm_head(), keep, HeadMode::Slice)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut runs = Vec::new();
    let mut engine = Engine { target: &target.model, tokenizer: &target.tokenizer, drafts: &mut drafts, heads: &heads };
    run(&mut engine, qs, plan, &plan.units(qs.len()), &mut |_: UnitKey, unit: Vec<Run>| {
        runs.extend(unit.into_iter().map(|r| Run { record: TurnRecord { draft_secs: 0.0, target_secs: 0.0, ..r.record }, ..r }));
        Ok(())
    })?;
    Ok(runs)
}

#[test]
fn the_matrix_runs_every_cell_repeats_exactly_and_shares_streams_across_ratios() {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(&dir.path().join("target"), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    synthetic::write_model(&dir.path().join("draft"), &Shape::tiny(), 2, candle_core::DType::F32).unwrap();
    let target = Target::load(dir.path().join("target").to_str().unwrap()).unwrap();
    let draft = dir.path().join("draft");
    let draft = draft.to_str().unwrap();
    let qs = questions(2);

    let p = plan(vec![0.0, 0.5]);
    let a = sweep(&target, draft, &p, &qs).unwrap();
    assert_eq!(a.len(), 2 * 2 * 2 * 3 * 2, "ratios × temperatures × repeats × prompts × turns");
    assert_eq!(a, sweep(&target, draft, &p, &qs).unwrap(), "same seed, same records");
    assert!(a.iter().all(|r| r.record.generated > 0 && r.record.accepted <= r.record.draft_tokens));

    // Two cells with the same ratio draw from the same streams: identical records at T = 1 too. Sampled runs come
    // per prompt and repeat as [slot 0: turn 0, turn 1], [slot 1: turn 0, turn 1].
    let twin = sweep(&target, draft, &plan(vec![0.5, 0.5]), &qs).unwrap();
    let sampled: Vec<&Run> = twin.iter().filter(|r| r.temperature == 1.0).collect();
    for c in sampled.chunks(4) {
        assert_eq!((&c[0].record, &c[1].record), (&c[2].record, &c[3].record), "prompt {} repeat {}", c[0].prompt, c[0].repeat);
    }
    assert!(sampled.chunks(4).any(|c| c[0].record != sampled[0].record), "streams differ between prompts and repeats");
}

#[test]
fn the_batch_size_changes_no_record_and_second_turns_follow_their_own_first() {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(&dir.path().join("target"), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    synthetic::write_model(&dir.path().join("draft"), &Shape::tiny(), 2, candle_core::DType::F32).unwrap();
    let target = Target::load(dir.path().join("target").to_str().unwrap()).unwrap();
    let draft = dir.path().join("draft");
    let (qs, p) = (questions(2), plan(vec![0.0, 0.5, 0.9]));
    let key = |r: &Run| (r.temperature.to_bits(), r.ratio.to_bits(), r.repeat, r.prompt_index, r.turn);
    let sorted = |mut runs: Vec<Run>| {
        runs.sort_by_key(key);
        runs
    };
    let one = sorted(sweep_batched(&target, draft.to_str().unwrap(), &p, &qs, 1).unwrap());
    assert_eq!(one.len(), 3 * 2 * 2 * 3 * 2);
    for batch in [3, 8] {
        assert_eq!(sorted(sweep_batched(&target, draft.to_str().unwrap(), &p, &qs, batch).unwrap()), one, "batch {batch}");
    }
}

#[test]
fn bad_plans_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(dir.path(), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    let target = Target::load(dir.path().to_str().unwrap()).unwrap();
    let d = dir.path().to_str().unwrap();
    let err = sweep(&target, d, &plan(vec![0.0]), &questions(1)).unwrap_err().to_string();
    assert!(err.contains("question 81 has 1 turn(s); the sweep asks for 2"), "{err}");
    let err = sweep(&target, d, &plan(vec![]), &questions(2)).unwrap_err().to_string();
    assert!(err.contains("the sweep matrix is empty"), "{err}");
    let err = sweep(&target, d, &plan(vec![0.5, 1.0]), &questions(2)).unwrap_err().to_string();
    assert!(err.contains("pruning ratio must be in [0, 1)"), "{err}");
}
