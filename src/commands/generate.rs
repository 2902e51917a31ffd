//! `frspec generate`: one chat reply from the target, alone or speculatively; the reply goes to stdout, what decoding
//! did (tokens/s, or acceptance with the draft and its head) to stderr.

use crate::loading::target::Target;
use crate::sampling::Sampling;
use crate::speculative::{speculative_turn, DraftHead, DraftKind, DraftMode, HeadMode, SpecConfig};
use crate::text::chat::Message;
use crate::vocab::KeepSet;
use anyhow::Result;
use rand::SeedableRng;

pub struct Request<'a> {
    pub prompt: &'a str,
    /// Without one the chat template's default applies.
    pub system: Option<&'a str>,
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// None: target-only decoding.
    pub speculative: Option<Speculative<'a>>,
}

/// The draft, its pruned head and how it proposes.
pub struct Speculative<'a> {
    pub kind: DraftKind,
    pub draft: Option<&'a str>,
    pub keep: Option<KeepSet>,
    pub head: HeadMode,
    pub k: usize,
    pub mode: DraftMode,
}

/// Reply to `r` with `target` (loaded from `target_spec`, which a truncated draft loads again).
pub fn run(target: &Target, target_spec: &str, r: &Request) -> Result<()> {
    let mut messages: Vec<Message> = r.system.iter().map(|s| Message::new("system", s)).collect();
    messages.push(Message::new("user", r.prompt));
    let ids = target.tokenizer.chat_prompt(&messages)?;
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(r.seed);
    let (tokens, summary) = match &r.speculative {
        Some(s) => {
            let mut draft = crate::engine::cpu::draft::build(&s.kind, s.draft, target, target_spec)?;
            let head = DraftHead::new(draft.lm_head(), s.keep.clone(), s.head)?;
            let cfg = SpecConfig { k: s.k, mode: s.mode, sampling: r.sampling, max_new_tokens: r.max_new_tokens };
            let (tokens, rec) = speculative_turn(&target.model, &target.tokenizer.stop_ids, draft.as_mut(), &head, &ids, &cfg, &mut rng)?;
            let summary = format!(
                "draft: {}, head keeps {} of {} ids\nmean acceptance length {:.3}, acceptance rate {:.1}% \
                 ({} accepted of {} draft tokens in {} steps); draft {:.2}s, target {:.2}s",
                draft.describe(),
                head.kept(),
                target.model.config.vocab,
                rec.mean_acceptance_length(),
                rec.acceptance_rate(),
                rec.accepted,
                rec.draft_tokens,
                rec.drafts,
                rec.draft_secs,
                rec.target_secs
            );
            (tokens, summary)
        }
        None => {
            let g = crate::speculative::generate(&target.model, &target.tokenizer.stop_ids, &ids, r.max_new_tokens, r.sampling, &mut rng)?;
            let summary = format!(
                "prompt {} tokens, {:.1} tokens/s prefill; generated {} tokens, {:.1} tokens/s; stop: {:?}",
                g.prompt_tokens,
                g.prompt_tokens as f64 / g.prefill_secs,
                g.tokens.len(),
                g.tokens.len() as f64 / g.decode_secs.max(1e-9),
                g.stop
            );
            (g.tokens, summary)
        }
    };
    let shown: Vec<u32> = tokens.iter().copied().filter(|t| !target.tokenizer.is_stop(*t)).collect();
    println!("{}", target.tokenizer.decode(&shown)?);
    eprintln!("{summary}");
    Ok(())
}
