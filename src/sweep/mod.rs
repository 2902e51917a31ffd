//! The sweep's core: every (ratio × temperature × repeat × prompt × turn) of a plan, run with common random
//! numbers on any engine. It knows nothing of files: `commands::sweep` keeps the folder, resume and the outputs.
//!
//! Seeding: each (seed, repeat, prompt, turn) has its own ChaCha20 stream (key from the seed, stream number from
//! repeat, prompt and turn), shared by every ratio and temperature, so differences between ratios are not noise
//! from different draws. At T = 0 decoding is deterministic: each (prompt, turn) runs once through the fast path
//! for every ratio together, and its records stand for every repeat.

pub mod shard;

use crate::text::chat::Message;
use crate::text::dataset::Question;
use crate::sampling::Sampling;
use crate::speculative::decode::{drafts_along, greedy_continuations, speculative_turns, TurnJob, Turns};
use crate::speculative::{Draft, DraftHead, DraftMode, SpecConfig, TargetModel, TurnRecord};
use crate::text::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

#[derive(Clone, Debug)]
pub struct Plan {
    pub ratios: Vec<f64>,
    pub temperatures: Vec<f32>,
    pub top_p: f32,
    pub repeats: u32,
    pub seed: u64,
    pub k: usize,
    /// 1: first turns only; 2: both (turn 2 re-prefills [user t1, assistant own answer, user t2]).
    pub turns: usize,
    pub max_new_tokens: usize,
    pub mode: DraftMode,
}

/// The most draft tokens a step may propose: EAGLE chains use 3–8, and a step's work and memory grow with k.
pub const MAX_K: usize = 64;

/// The most turns one sweep may hold: at a second a turn, eleven days.
pub const MAX_UNITS: u128 = 1_000_000;

impl Plan {
    pub fn validate(&self, questions: &[Question]) -> Result<()> {
        if self.ratios.is_empty() || self.temperatures.is_empty() || self.repeats == 0 || questions.is_empty() {
            bail!("the sweep matrix is empty: it needs at least one ratio, temperature, repeat and prompt");
        }
        for &r in &self.ratios {
            crate::vocab::KeepRule::Ratio(r).validate()?;
        }
        for &t in &self.temperatures {
            Sampling::new(t, self.top_p)?;
        }
        if self.k == 0 || self.max_new_tokens == 0 {
            bail!("k and max new tokens must be at least 1");
        }
        if self.k > MAX_K {
            bail!("k is {}: a step drafts at most {MAX_K} tokens", self.k);
        }
        let units = (self.temperatures.len() * questions.len()) as u128 * self.repeats as u128 * self.turns as u128;
        if units > MAX_UNITS {
            bail!("the sweep holds {units} turns (temperatures × prompts × repeats × turns); at most {MAX_UNITS} run in one sweep");
        }
        if !(1..=2).contains(&self.turns) {
            bail!("turns must be 1 or 2, got {}", self.turns);
        }
        if let Some(q) = questions.iter().find(|q| q.turns.len() < self.turns) {
            bail!("question {} has {} turn(s); the sweep asks for {}", q.id, q.turns.len(), self.turns);
        }
        Ok(())
    }
}

/// The random stream of one (seed, repeat, prompt, turn), the same for every ratio and temperature.
pub fn stream(seed: u64, repeat: u32, prompt: u32, turn: u32) -> ChaCha20Rng {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    rng.set_stream(((repeat as u64) << 40) | ((prompt as u64) << 8) | turn as u64);
    rng
}

/// One finished turn of the matrix.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// The cell's pruning ratio (with keep sizes: 1 − kept / vocabulary).
    pub ratio: f64,
    pub temperature: f32,
    pub repeat: u32,
    /// The question's position in the sweep's prompt list.
    pub prompt_index: u32,
    /// The question id.
    pub prompt: String,
    /// 0-based.
    pub turn: u32,
    pub record: TurnRecord,
}

impl Run {
    /// The run of `key`'s question at `plan.ratios[ratio]`, for `repeat` and `turn`.
    fn of(plan: &Plan, questions: &[Question], key: UnitKey, ratio: usize, repeat: u32, turn: usize, record: TurnRecord) -> Run {
        Run {
            ratio: plan.ratios[ratio],
            temperature: plan.temperatures[key.temperature],
            repeat,
            prompt_index: key.prompt as u32,
            prompt: questions[key.prompt].id.clone(),
            turn: turn as u32,
            record,
        }
    }
}

/// The unit of work, of progress and of resume: one temperature and question, and for a sampled temperature one
/// repeat. A greedy unit (`repeat: None`) runs once and its records stand for every repeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct UnitKey {
    pub temperature: usize,
    pub prompt: usize,
    pub repeat: Option<u32>,
}

impl UnitKey {
    /// A file name that sorts nowhere in particular but is unique per unit.
    pub fn file_name(&self) -> String {
        let repeat = self.repeat.map_or("all".to_string(), |r| r.to_string());
        format!("t{}-p{}-r{repeat}.json", self.temperature, self.prompt)
    }
}

impl Plan {
    /// Every unit of the plan over `prompts` questions, in the order they run.
    pub fn units(&self, prompts: usize) -> Vec<UnitKey> {
        let mut out = Vec::new();
        for (ti, &t) in self.temperatures.iter().enumerate() {
            for prompt in 0..prompts {
                if crate::sampling::is_greedy(t) {
                    out.push(UnitKey { temperature: ti, prompt, repeat: None });
                } else {
                    out.extend((0..self.repeats).map(|r| UnitKey { temperature: ti, prompt, repeat: Some(r) }));
                }
            }
        }
        out
    }

    /// Turns a unit produces: records for every ratio, turn and the repeats it stands for.
    pub fn runs_per_unit(&self, key: &UnitKey) -> usize {
        let repeats = if key.repeat.is_some() { 1 } else { self.repeats as usize };
        self.ratios.len() * self.turns * repeats
    }
}

/// The chat of turn `turn` (0-based) of `q`, given the model's own answers to the earlier turns.
fn messages(q: &Question, turn: usize, answers: &[String]) -> Vec<Message> {
    let mut m = Vec::new();
    for (t, answer) in answers.iter().enumerate().take(turn) {
        m.push(Message::new("user", &q.turns[t]));
        m.push(Message::new("assistant", answer));
    }
    m.push(Message::new("user", &q.turns[turn]));
    m
}

/// The target and the drafts a sweep runs on, on one engine: `heads[i]` serves `plan.ratios[i]`; each of the
/// `drafts` is a slot of the batch (as many sequences are decoded together as there are drafts).
pub struct Engine<'t, 'd, T: TargetModel> {
    pub target: &'t T,
    pub tokenizer: &'d Tokenizer,
    pub drafts: &'d mut [Box<dyn Draft<T> + 't>],
    pub heads: &'d [DraftHead<T::Head>],
}

/// An engine's drafts as the speculative core takes them, one per slot.
fn slots<'a, T: TargetModel>(drafts: &'a mut [Box<dyn Draft<T> + '_>]) -> Vec<&'a mut dyn Draft<T>> {
    drafts.iter_mut().map(|d| d.as_mut() as &mut dyn Draft<T>).collect()
}

/// What a running sweep reports to. Units of a batch run side by side: several may have started and not finished.
pub trait Observer {
    fn unit_started(&mut self, _key: &UnitKey) {}
    fn turn(&mut self, _run: &Run) {}
    fn unit_finished(&mut self, key: UnitKey, runs: Vec<Run>) -> Result<()>;
}

impl<F: FnMut(UnitKey, Vec<Run>) -> Result<()>> Observer for F {
    fn unit_finished(&mut self, key: UnitKey, runs: Vec<Run>) -> Result<()> {
        self(key, runs)
    }
}

/// Run `units` of the plan, as many sequences at a time as the engine has draft slots. Consecutive greedy units
/// go through the T = 0 fast path that many prompts at a time; consecutive sampled units through one speculative
/// loop whose slots take (unit, ratio) turns in plan order. Records do not depend on the batch size where the
/// engine's blocks do not depend on their neighbours (the CPU engine, tested).
pub fn run<T: TargetModel>(engine: &mut Engine<T>, questions: &[Question], plan: &Plan, units: &[UnitKey], observer: &mut dyn Observer) -> Result<()> {
    plan.validate(questions)?;
    if engine.heads.len() != plan.ratios.len() {
        bail!("one head per ratio is needed");
    }
    if engine.drafts.is_empty() {
        bail!("a sweep needs at least one draft slot");
    }
    for group in units.chunk_by(|a, b| a.temperature == b.temperature) {
        let sampling = Sampling::new(plan.temperatures[group[0].temperature], plan.top_p)?;
        if sampling.is_greedy() {
            for batch in group.chunks(engine.drafts.len()) {
                greedy_units(engine, questions, plan, batch, observer)?;
            }
        } else {
            sampled_units(engine, questions, plan, group, sampling, observer)?;
        }
    }
    Ok(())
}

/// A turn's ids as the text the next turn's chat carries.
fn answer(tok: &Tokenizer, tokens: &[u32]) -> Result<String> {
    let shown: Vec<u32> = tokens.iter().copied().filter(|t| !tok.is_stop(*t)).collect();
    tok.decode(&shown)
}

/// Greedy units, deterministic: each turn of every unit is the target's continuation, decoded for all units
/// together, and every ratio's draft runs along it; the records stand for every repeat.
fn greedy_units<T: TargetModel>(engine: &mut Engine<T>, questions: &[Question], plan: &Plan, units: &[UnitKey], observer: &mut dyn Observer) -> Result<()> {
    let tok = engine.tokenizer;
    let mut drafts = slots(engine.drafts);
    let heads: Vec<&DraftHead<T::Head>> = engine.heads.iter().collect();
    units.iter().for_each(|key| observer.unit_started(key));
    let mut answers: Vec<Vec<String>> = vec![Vec::new(); units.len()];
    let mut records: Vec<Vec<Vec<TurnRecord>>> = vec![Vec::new(); units.len()];
    for turn in 0..plan.turns {
        let prompts = units.iter().zip(&answers).map(|(key, a)| tok.chat_prompt(&messages(&questions[key.prompt], turn, a))).collect::<Result<Vec<_>>>()?;
        let continuations = greedy_continuations(engine.target, &tok.stop_ids, &prompts, plan.max_new_tokens, &drafts[0].target_layers())?;
        let along = drafts_along(engine.target, &tok.stop_ids, &mut drafts, &heads, &continuations, plan.k, plan.max_new_tokens)?;
        for (i, (c, per_head)) in continuations.iter().zip(along).enumerate() {
            records[i].push(per_head);
            answers[i].push(answer(tok, &c.tokens[c.prompt_len..])?);
        }
    }
    for (key, per_turn) in units.iter().zip(records) {
        let mut runs = Vec::with_capacity(plan.runs_per_unit(key));
        for (turn, per_ratio) in per_turn.iter().enumerate() {
            for repeat in 0..plan.repeats {
                for (ratio, record) in per_ratio.iter().enumerate() {
                    let run = Run::of(plan, questions, *key, ratio, repeat, turn, record.clone());
                    observer.turn(&run);
                    runs.push(run);
                }
            }
        }
        observer.unit_finished(*key, runs)?;
    }
    Ok(())
}

/// Sampled units of one temperature through one speculative loop. A chain is one unit's turns at one ratio (turn 2
/// carries the chain's own first answer); chains start in plan order (unit, then ratio), and a chain's next turn
/// goes before any chain not yet started, so a batch's composition is fixed by the plan and the batch size.
fn sampled_units<T: TargetModel>(engine: &mut Engine<T>, questions: &[Question], plan: &Plan, units: &[UnitKey], sampling: Sampling, observer: &mut dyn Observer) -> Result<()> {
    let cfg = SpecConfig { k: plan.k, mode: plan.mode, sampling, max_new_tokens: plan.max_new_tokens };
    let chains = (0..units.len()).flat_map(|u| (0..plan.ratios.len()).map(move |r| Chain { unit: u, ratio: r, answers: Vec::new() })).collect();
    let mut matrix = Matrix {
        plan,
        questions,
        units,
        heads: engine.heads,
        tokenizer: engine.tokenizer,
        observer,
        chains,
        fresh: 0,
        follow_ups: std::collections::VecDeque::new(),
        runs: units.iter().map(|k| vec![None; plan.runs_per_unit(k)]).collect(),
    };
    speculative_turns(engine.target, &engine.tokenizer.stop_ids, &mut slots(engine.drafts), &cfg, &mut matrix)
}

/// One unit's turns at one ratio.
struct Chain {
    unit: usize,
    ratio: usize,
    answers: Vec<String>,
}

/// The sampled units' turns as the speculative loop takes them, and their runs as they finish.
struct Matrix<'a, 'h, H> {
    plan: &'a Plan,
    questions: &'a [Question],
    units: &'a [UnitKey],
    heads: &'h [DraftHead<H>],
    tokenizer: &'a Tokenizer,
    observer: &'a mut dyn Observer,
    chains: Vec<Chain>,
    /// Chains not yet started are `chains[fresh..]`.
    fresh: usize,
    /// Chains whose next turn is ready.
    follow_ups: std::collections::VecDeque<usize>,
    /// Per unit, its runs by (ratio, turn) as they finish.
    runs: Vec<Vec<Option<Run>>>,
}

impl<'h, H> Turns<'h, H> for Matrix<'_, 'h, H> {
    fn next(&mut self) -> Result<Option<TurnJob<'h, H>>> {
        let id = match self.follow_ups.pop_front() {
            Some(id) => id,
            None if self.fresh < self.chains.len() => {
                self.fresh += 1;
                self.fresh - 1
            }
            None => return Ok(None),
        };
        let chain = &self.chains[id];
        let key = self.units[chain.unit];
        let turn = chain.answers.len();
        if turn == 0 && chain.ratio == 0 {
            self.observer.unit_started(&key);
        }
        let repeat = key.repeat.expect("a sampled unit");
        let prompt = self.tokenizer.chat_prompt(&messages(&self.questions[key.prompt], turn, &chain.answers))?;
        let rng = stream(self.plan.seed, repeat, key.prompt as u32, turn as u32);
        Ok(Some(TurnJob { id, prompt, head: &self.heads[chain.ratio], rng: Box::new(rng) }))
    }

    fn finished(&mut self, id: usize, tokens: Vec<u32>, record: TurnRecord) -> Result<()> {
        let chain = &mut self.chains[id];
        let key = self.units[chain.unit];
        let turn = chain.answers.len();
        chain.answers.push(answer(self.tokenizer, &tokens)?);
        let plan = self.plan;
        let run = Run::of(plan, self.questions, key, chain.ratio, key.repeat.expect("a sampled unit"), turn, record);
        self.observer.turn(&run);
        let (unit, slot) = (chain.unit, chain.ratio * plan.turns + turn);
        if turn + 1 < plan.turns {
            self.follow_ups.push_back(id);
        }
        self.runs[unit][slot] = Some(run);
        if self.runs[unit].iter().all(Option::is_some) {
            let runs = std::mem::take(&mut self.runs[unit]).into_iter().map(|r| r.expect("every run finished")).collect();
            self.observer.unit_finished(key, runs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngExt;

    #[test]
    fn streams_are_distinct_per_key_and_repeat_exactly() {
        let draw = |r: u32, p: u32, t: u32| stream(7, r, p, t).random::<u64>();
        assert_eq!(draw(1, 2, 1), draw(1, 2, 1));
        let keys = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (3, 80, 1)];
        let values: std::collections::HashSet<u64> = keys.iter().map(|&(r, p, t)| draw(r, p, t)).collect();
        assert_eq!(values.len(), keys.len());
        assert_ne!(stream(7, 0, 0, 0).random::<u64>(), stream(8, 0, 0, 0).random::<u64>());
    }

    #[test]
    fn turn_two_carries_the_first_answer() {
        let q = Question { id: "81".into(), category: None, turns: vec!["a".into(), "b".into()] };
        let m = messages(&q, 1, &["answer".into()]);
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "user"]);
        assert_eq!((m[1].content.as_str(), m[2].content.as_str()), ("answer", "b"));
    }
}
