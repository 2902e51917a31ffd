//! SmolLM2 with the shipped heads, as the speculative tests use it: the target, a Brown frequency ranking, MT-Bench
//! prompts, a batched sweep in process and drafts fed alone and together.

use super::asset;
use frspec::loading::target::Target;
use frspec::speculative::{Draft, DraftHead, HeadMode, TargetModel};
use frspec::sweep::{Engine, Plan, Run, UnitKey};
use frspec::text::chat::Message;
use frspec::vocab::{corpus_lines, count_tokens, CorpusFormat, Frequencies, KeepRule, KeepSet};
use std::sync::OnceLock;

pub fn smollm2() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| Target::load("smollm2").unwrap_or_else(|e| panic!("{e:#}")))
}

/// SmolLM2 token frequencies over part of the Brown corpus (enough for a realistic ranking).
pub fn brown_frequencies() -> &'static Frequencies {
    static F: OnceLock<Frequencies> = OnceLock::new();
    F.get_or_init(|| {
        let t = smollm2();
        let mut files: Vec<_> = std::fs::read_dir(asset("brown")).unwrap().map(|e| e.unwrap().path()).collect();
        files.retain(|p| p.file_name().unwrap().to_str().unwrap().starts_with('c'));
        files.sort();
        let lines: Vec<String> = files[..40].iter().flat_map(|f| corpus_lines(f, CorpusFormat::Tagged).unwrap()).collect();
        Frequencies::from_counts(&count_tokens(&t.tokenizer, &lines, t.model.config.vocab).unwrap(), &asset("brown"))
    })
}

pub fn keep(ratio: f64) -> Option<KeepSet> {
    let t = smollm2();
    (ratio > 0.0).then(|| brown_frequencies().keep_set(KeepRule::Ratio(ratio), t.model.config.vocab, &t.tokenizer.stop_ids).unwrap())
}

pub fn mt_bench_prompts(n: usize) -> Vec<Vec<u32>> {
    let t = smollm2();
    std::fs::read_to_string(asset("mt-bench"))
        .unwrap()
        .lines()
        .take(n)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            t.tokenizer.chat_prompt(&[Message::new("user", v["turns"][0].as_str().unwrap())]).unwrap()
        })
        .collect()
}

pub fn batched_sweep<'t, T: TargetModel>(target: &'t T, drafts: Vec<Box<dyn Draft<T> + 't>>, questions: &[frspec::text::dataset::Question], plan: &Plan) -> Vec<Run> {
    let t = smollm2();
    let heads: Vec<_> = plan.ratios.iter().map(|&r| DraftHead::new(drafts[0].lm_head(), keep(r), HeadMode::Slice).unwrap()).collect();
    let mut drafts = drafts;
    let mut engine = Engine { target, tokenizer: &t.tokenizer, drafts: &mut drafts, heads: &heads };
    let mut runs = Vec::new();
    frspec::sweep::run(&mut engine, questions, plan, &plan.units(questions.len()), &mut |_: UnitKey, unit: Vec<Run>| {
        runs.extend(unit.into_iter().map(|r| Run { record: r.record.without_timings(), ..r }));
        Ok(())
    })
    .unwrap();
    runs
}

/// Turns handed to `speculative_turns` in order, and what each gave back.
pub struct Queue<'h, H> {
    pub jobs: std::collections::VecDeque<frspec::speculative::decode::TurnJob<'h, H>>,
    pub done: Vec<(usize, Vec<u32>, frspec::speculative::decode::TurnRecord)>,
}

impl<'h, H> frspec::speculative::decode::Turns<'h, H> for Queue<'h, H> {
    fn next(&mut self) -> anyhow::Result<Option<frspec::speculative::decode::TurnJob<'h, H>>> {
        Ok(self.jobs.pop_front())
    }

    fn finished(&mut self, id: usize, tokens: Vec<u32>, record: frspec::speculative::decode::TurnRecord) -> anyhow::Result<()> {
        self.done.push((id, tokens, record));
        Ok(())
    }
}

/// Feed the drafts (three) at four positions, each alone, then together through `feed_drafts`: catching up on
/// prompts of different lengths, two drafted tokens for all, then a third for the first and the last only (on the
/// candle engine their streams are then rows 0 and 2 of the previous position's outputs, gathered; consecutive ones
/// are a view of them). `check(draft, position, row together, row alone)`, rows on the host (`rows`). The drafts are
/// left reset and fed together.
pub fn fed_alone_and_together<T: TargetModel>(target: &T, drafts: &mut [Box<dyn Draft<T> + '_>], rows: impl Fn(frspec::speculative::Row<T>) -> Vec<f32>, mut check: impl FnMut(usize, usize, Vec<f32>, &[f32])) {
    use frspec::speculative::{Context, Feed};
    let prompts = mt_bench_prompts(drafts.len());
    let contexts: Vec<Vec<u32>> = prompts.iter().map(|p| [&p[..], &[42]].concat()).collect();
    let layers = drafts[0].target_layers();
    let features: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut f = target.new_features(&layers);
            target.forward(p, &mut target.new_cache(), &[], Some(&mut f), &mut Vec::new()).unwrap();
            f
        })
        .collect();
    let everyone: [usize; 3] = [0, 1, 2];
    let feeds: Vec<(&[usize], Vec<Feed<_>>)> = vec![
        (&everyone, contexts.iter().zip(&features).map(|(c, f)| Feed::CatchUp(Context { tokens: c, features: f })).collect()),
        (&everyone, vec![Feed::Extend(7); 3]),
        (&everyone, vec![Feed::Extend(8); 3]),
        (&[0, 2], vec![Feed::Extend(9); 2]),
    ];
    let alone: Vec<Vec<Option<Vec<f32>>>> = drafts
        .iter_mut()
        .enumerate()
        .map(|(i, d)| feeds.iter().map(|(fed, step)| fed.iter().position(|&j| j == i).map(|at| rows(step[at].to(d.as_mut()).unwrap()))).collect())
        .collect();
    drafts.iter_mut().for_each(|d| d.reset());
    let mut slots: Vec<&mut dyn Draft<T>> = drafts.iter_mut().map(|d| d.as_mut() as _).collect();
    for (step, (fed, feeds)) in feeds.iter().enumerate() {
        let mut together = Vec::new();
        target.feed_drafts(&mut slots, fed, feeds, &mut together).unwrap();
        for (&i, row) in fed.iter().zip(together) {
            check(i, step, rows(row), alone[i][step].as_ref().expect("fed alone too"));
        }
    }
}
