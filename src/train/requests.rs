//! What the target is asked: chat prompts made from a text corpus, continuations whose answer is the corpus
//! itself, ShareGPT's real requests (openings, and later requests with the turns before them), and requests the
//! target writes itself (Magpie). Never the evaluation set.

use super::teacher::ANSWER_BATCH;
use crate::loading::target::Target;
use crate::sampling::Sampling;
use crate::speculative::generate::StopReason;
use crate::text::chat::Message;
use anyhow::{anyhow, bail, Context, Result};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::path::Path;

/// Instructions wrapped around corpus passages to make chat prompts (the default set, `--templates` replaces it);
/// they cover writing, explanation, extraction, reasoning, arithmetic and code so the answers resemble what chat
/// benchmarks ask for. The first one also frames the continuations.
pub const TEMPLATES: [&str; 10] = [
    "Continue this text in the same style:\n\n{}",
    "Explain the following passage in simple terms:\n\n{}",
    "Write a short story inspired by this passage:\n\n{}",
    "Summarize the main point of this passage and say why it matters:\n\n{}",
    "What questions would a curious reader ask about this passage? Answer two of them.\n\n{}",
    "Rewrite this passage as a friendly email to a colleague:\n\n{}",
    "List three facts or ideas from this passage, then comment on each:\n\n{}",
    "Give practical advice to someone in the situation described here:\n\n{}",
    "Make up a simple arithmetic word problem based on this passage and solve it step by step:\n\n{}",
    "Write a short Python function related to this passage and explain how it works:\n\n{}",
];

/// Corpus lines as readable text: Brown's quote marks and the spaces its tokenization puts before punctuation
/// removed.
fn readable(line: &str) -> String {
    let mut s = line.replace("``", "\"").replace("''", "\"");
    for p in [" .", " ,", " ;", " :", " ?", " !", " 's", " n't"] {
        s = s.replace(p, &p[1..]);
    }
    s
}

/// Passages of three consecutive corpus lines, in corpus order, with at least 8 words.
fn passages(lines: &[String]) -> Result<Vec<String>> {
    let passages: Vec<String> = lines.chunks(3).map(|c| c.iter().map(|l| readable(l)).collect::<Vec<_>>().join(" ")).collect();
    let passages: Vec<String> = passages.into_iter().filter(|p| p.split_whitespace().count() >= 8).collect();
    if passages.is_empty() {
        bail!("the corpus holds no passage of 8 words or more");
    }
    Ok(passages)
}

/// Instruction templates from a JSON file: a list of strings, each holding `{}` once, where the passage goes.
pub fn load_templates(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read templates file {}", path.display()))?;
    let templates: Vec<String> =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: not a JSON list of template strings: {e}", path.display()))?;
    if templates.is_empty() {
        bail!("{}: holds no template", path.display());
    }
    if let Some((i, _)) = templates.iter().enumerate().find(|(_, t)| t.matches("{}").count() != 1) {
        bail!("{}: template {} must hold {{}} (where the passage goes) exactly once", path.display(), i + 1);
    }
    Ok(templates)
}

/// `count` chat prompts from the corpus: passages drawn in a seeded order, each wrapped in one of the templates
/// (in turn).
pub fn prompts(lines: &[String], count: usize, seed: u64, templates: &[impl AsRef<str>]) -> Result<Vec<String>> {
    let passages = passages(lines)?;
    let order = shuffled(passages.len(), &mut ChaCha20Rng::seed_from_u64(seed));
    Ok((0..count).map(|i| templates[i % templates.len()].as_ref().replace("{}", &passages[order[i % order.len()]])).collect())
}

/// `count` (prompt, answer) pairs whose answer is the corpus itself: a passage to continue, drawn in a seeded order
/// (another stream than `prompts`), and the passages that follow it.
pub fn continuations(lines: &[String], count: usize, seed: u64) -> Result<Vec<(String, String)>> {
    let passages = passages(lines)?;
    if passages.len() < 2 {
        bail!("the corpus holds fewer than two passages, so none has a continuation");
    }
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    rng.set_stream(1);
    let order = shuffled(passages.len() - 1, &mut rng);
    Ok((0..count)
        .map(|i| {
            let p = order[i % order.len()];
            let answer = passages[p + 1..passages.len().min(p + 4)].join(" ");
            (TEMPLATES[0].replace("{}", &passages[p]), answer)
        })
        .collect())
}

/// Longest ShareGPT request taken, in tokens of the chat prompt. A tenth of the openings are pasted documents or
/// code of thousands of tokens; one of them costs the prefill of dozens of short ones and teaches the head little
/// more, and chat benchmarks ask in a few hundred.
pub const SHAREGPT_MAX_PROMPT_TOKENS: usize = 512;

/// The first `count` distinct requests that open a ShareGPT conversation, in file order, whose chat prompt is at
/// most `max_tokens` tokens. File order keeps the selection prefix-stable: the first n of more are the n alone.
pub fn sharegpt_prompts(conversations: &[crate::text::sharegpt::Conversation], count: usize, tok: &crate::text::tokenizer::Tokenizer, max_tokens: usize) -> Result<Vec<String>> {
    let (mut out, mut seen) = (Vec::with_capacity(count), std::collections::HashSet::new());
    for request in conversations.iter().filter_map(|c| c.first_human_turn()).map(str::trim).filter(|r| !r.is_empty()) {
        if out.len() == count {
            break;
        }
        if seen.insert(request) && tok.chat_prompt(&[Message::new("user", request)])?.len() <= max_tokens {
            out.push(request.to_string());
        }
    }
    if out.len() < count {
        bail!("the ShareGPT file holds only {} distinct opening requests of at most {max_tokens} tokens, not {count}", out.len());
    }
    Ok(out)
}

/// The first `count` distinct later requests of ShareGPT conversations, each with the turns before it as ShareGPT
/// recorded them (the assistant's answers are not the target's), in file order, whose chat prompt is at most
/// `max_tokens` tokens. A conversation's requests are taken in turn until the first whose chat is longer: the later
/// ones only add to it. Prefix-stable like `sharegpt_prompts`.
pub fn sharegpt_follow_ups(conversations: &[crate::text::sharegpt::Conversation], count: usize, tok: &crate::text::tokenizer::Tokenizer, max_tokens: usize) -> Result<Vec<Vec<Message>>> {
    let (mut out, mut seen) = (Vec::with_capacity(count), std::collections::HashSet::new());
    'conversations: for conversation in conversations {
        for turns in conversation.follow_ups() {
            if out.len() == count {
                break 'conversations;
            }
            let chat: Vec<Message> = turns.iter().map(|t| Message::new(if t.from == "human" { "user" } else { "assistant" }, t.value.trim())).collect();
            if chat.last().is_some_and(|request| request.content.is_empty()) {
                continue;
            }
            let prompt = tok.chat_prompt(&chat)?;
            if prompt.len() > max_tokens {
                break;
            }
            if seen.insert(prompt) {
                out.push(chat);
            }
        }
    }
    if out.len() < count {
        bail!("the ShareGPT file holds only {} distinct later requests whose conversation so far is at most {max_tokens} tokens, not {count}", out.len());
    }
    Ok(out)
}

/// 0..n in a seeded random order (Fisher–Yates).
pub(super) fn shuffled(n: usize, rng: &mut ChaCha20Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    order
}

/// Magpie's sampling (Xu et al. 2024): temperature 1 over the whole vocabulary, so requests are as varied as what
/// the model was tuned on.
const SELF_PROMPT_SAMPLING: Sampling = Sampling { temperature: 1.0, top_p: 1.0 };

/// How far writing requests has got: the requests kept from the first `attempts` attempts, in order. Writing
/// thousands takes an hour on 2 cores, so a run saves this between batches and resumes from it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WrittenRequests {
    pub attempts: usize,
    pub requests: Vec<String>,
}

impl WrittenRequests {
    /// Whether writing `count` requests can stop here: after whole batches, no more requests than attempts, none twice.
    pub fn check(&self, count: usize) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        if self.attempts % ANSWER_BATCH != 0 || self.requests.len() > self.attempts.min(count) || !self.requests.iter().all(|r| seen.insert(r)) {
            bail!("{} requests after {} attempts is not where writing {count} in batches of {ANSWER_BATCH} stops", self.requests.len(), self.attempts);
        }
        Ok(())
    }
}

/// `count` requests the target writes itself (Magpie): the chat up to the user's turn, continued by sampling until
/// the turn ends, going on from `from`. Attempt a draws from its own stream of `seed`, so a request does not depend on
/// the batch it was decoded in, nor on where writing was resumed; attempts that run past `max_tokens`, come out blank
/// or repeat an earlier request are dropped. `on_batch` is told how far writing has got after each batch of attempts;
/// an error from it stops the writing.
pub fn self_prompts(
    target: &Target,
    count: usize,
    seed: u64,
    max_tokens: usize,
    from: WrittenRequests,
    on_batch: &mut dyn FnMut(&WrittenRequests) -> Result<()>,
) -> Result<Vec<String>> {
    let tok = &target.tokenizer;
    let prefix = tok.user_turn_prefix()?;
    from.check(count)?;
    let WrittenRequests { mut attempts, requests: mut out } = from;
    let mut seen: std::collections::HashSet<String> = out.iter().cloned().collect();
    while out.len() < count {
        if attempts >= 4 * count + 64 {
            bail!("the target wrote only {} usable requests in {attempts} attempts (each must end its turn within {max_tokens} tokens and be new)", out.len());
        }
        let mut streams: Vec<ChaCha20Rng> = (attempts..attempts + ANSWER_BATCH)
            .map(|a| {
                let mut rng = ChaCha20Rng::seed_from_u64(seed ^ 0x5e1f_9e37_79b9_7f4a);
                rng.set_stream(a as u64);
                rng
            })
            .collect();
        attempts += ANSWER_BATCH;
        let written = crate::speculative::decode::continuations(&target.model, &tok.stop_ids, &vec![prefix.as_slice(); ANSWER_BATCH], max_tokens, &[], SELF_PROMPT_SAMPLING, &mut |i| streams[i].random())?;
        for c in written.into_iter().filter(|c| c.stop == StopReason::EndOfTurn) {
            let request = tok.decode(&c.tokens[prefix.len()..c.tokens.len() - 1])?.trim().to_string();
            if out.len() < count && !request.is_empty() && seen.insert(request.clone()) {
                out.push(request);
            }
        }
        // Moved in and out rather than cloned: the requests grow to megabytes.
        let so_far = WrittenRequests { attempts, requests: out };
        on_batch(&so_far)?;
        out = so_far.requests;
    }
    Ok(out)
}
