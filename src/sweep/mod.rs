//! The sweep's core: every (ratio × temperature × repeat × prompt × turn) of a plan, run with common random
//! numbers on any engine. It knows nothing of files: `commands::sweep` keeps the folder, resume and the outputs.
//!
//! Seeding: each (seed, repeat, prompt, turn) has its own ChaCha20 stream (key from the seed, stream number from
//! repeat, prompt and turn), shared by every ratio and temperature, so differences between ratios are not noise
//! from different draws. At T = 0 decoding is deterministic: each (prompt, turn) runs once through the fast path
//! for every ratio together, and its records stand for every repeat.

use crate::text::chat::Message;
use crate::text::dataset::Question;
use crate::sampling::Sampling;
use crate::speculative::{greedy_turns, speculative_turn, Draft, DraftHead, DraftMode, SpecConfig, TargetModel, TurnRecord};
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

/// The target and the drafts a sweep runs on, on one engine: `drafts[i]` and `heads[i]` serve `plan.ratios[i]`.
pub struct Engine<'t, 'd, T: TargetModel> {
    pub target: &'t T,
    pub tokenizer: &'d Tokenizer,
    pub drafts: &'d mut [Box<dyn Draft<T> + 't>],
    pub heads: &'d [DraftHead<T::Head>],
}

/// What a running sweep reports to.
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

/// Run `units` of the plan.
pub fn run<T: TargetModel>(engine: &mut Engine<T>, questions: &[Question], plan: &Plan, units: &[UnitKey], observer: &mut dyn Observer) -> Result<()> {
    plan.validate(questions)?;
    if engine.drafts.len() != plan.ratios.len() || engine.heads.len() != plan.ratios.len() {
        bail!("one draft and one head per ratio are needed");
    }
    for &key in units {
        observer.unit_started(&key);
        let runs = run_unit(engine, questions, plan, key, observer)?;
        observer.unit_finished(key, runs)?;
    }
    Ok(())
}

fn run_unit<T: TargetModel>(engine: &mut Engine<T>, questions: &[Question], plan: &Plan, key: UnitKey, observer: &mut dyn Observer) -> Result<Vec<Run>> {
    let tok = engine.tokenizer;
    let answer = |tokens: &[u32]| -> Result<String> {
        let shown: Vec<u32> = tokens.iter().copied().filter(|t| !tok.is_stop(*t)).collect();
        tok.decode(&shown)
    };
    let temperature = plan.temperatures[key.temperature];
    let sampling = Sampling::new(temperature, plan.top_p)?;
    let q = &questions[key.prompt];
    let mut runs = Vec::with_capacity(plan.runs_per_unit(&key));
    let mut emit = |repeat: u32, ratio: f64, turn: usize, record: TurnRecord| {
        let run = Run { ratio, temperature, repeat, prompt_index: key.prompt as u32, prompt: q.id.clone(), turn: turn as u32, record };
        observer.turn(&run);
        runs.push(run);
    };
    let Some(repeat) = key.repeat else {
        // Deterministic: one pass for all ratios, standing for every repeat.
        let mut answers = Vec::new();
        for turn in 0..plan.turns {
            let prompt = tok.chat_prompt(&messages(q, turn, &answers))?;
            let mut pairs: Vec<(&mut dyn Draft<T>, &DraftHead<T::Head>)> =
                engine.drafts.iter_mut().zip(engine.heads).map(|(d, h)| (d.as_mut() as &mut dyn Draft<T>, h)).collect();
            let (tokens, records) = greedy_turns(engine.target, &tok.stop_ids, &mut pairs, &prompt, plan.k, plan.max_new_tokens)?;
            answers.push(answer(&tokens)?);
            for repeat in 0..plan.repeats {
                for (&ratio, record) in plan.ratios.iter().zip(&records) {
                    emit(repeat, ratio, turn, record.clone());
                }
            }
        }
        return Ok(runs);
    };
    for ((&ratio, draft), head) in plan.ratios.iter().zip(engine.drafts.iter_mut()).zip(engine.heads) {
        let mut answers = Vec::new();
        for turn in 0..plan.turns {
            let prompt = tok.chat_prompt(&messages(q, turn, &answers))?;
            let cfg = SpecConfig { k: plan.k, mode: plan.mode, sampling, max_new_tokens: plan.max_new_tokens };
            let mut rng = stream(plan.seed, repeat, key.prompt as u32, turn as u32);
            let (tokens, record) = speculative_turn(engine.target, &tok.stop_ids, draft.as_mut(), head, &prompt, &cfg, &mut rng)?;
            answers.push(answer(&tokens)?);
            emit(repeat, ratio, turn, record);
        }
    }
    Ok(runs)
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
