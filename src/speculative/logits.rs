//! The target's logit rows after a forward, as the loop decides with them: a token's probability, and a draw with a
//! uniform number the loop takes from the sequence's own stream. An engine keeps the rows where it computed them and
//! answers these questions there: on a GPU, a batch of 64 sequences verifying k + 1 = 5 tokens of Llama-3's 128,256
//! would otherwise bring 164 MB of logits to the host every step and compute 320 distributions over them on one core.

use crate::sampling::{draw_with, Sampling};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// One draw: from the distribution of `row` under the loop's sampling, less `without` (then renormalised), with the
/// uniform number `u` in [0, 1).
pub struct DrawRequest<'a> {
    pub row: usize,
    pub u: f64,
    pub without: Without<'a>,
}

/// What a draw leaves out of the target's distribution p: speculative sampling's recovery draws from
/// norm(max(0, p − q)), q being the draft's distribution at the rejected position.
#[derive(Clone, Copy)]
pub enum Without<'a> {
    Nothing,
    /// q is a point mass on this token (argmax drafts).
    Token(u32),
    /// q over a draft head's rows; head row i is target id `ids.id(i)`.
    Distribution { q: &'a [f32], ids: &'a dyn TokenIds },
}

/// The target ids of a draft head's rows.
pub trait TokenIds {
    fn id(&self, index: usize) -> u32;
}

/// The logit rows of one forward of several blocks (`TargetModel::forward_blocks`), in batch order.
pub trait LogitRows {
    /// `p(token)` of each `(row, token)` under `sampling`, into `out` in order.
    fn probabilities(&mut self, sampling: Sampling, picks: &[(usize, u32)], out: &mut Vec<f32>) -> Result<()>;

    /// One token for each request, into `out` in order. A distribution with nothing left after `without` (p ≤ q
    /// everywhere, so p = q and rejection had probability zero) is drawn from as p itself.
    fn draw(&mut self, sampling: Sampling, requests: &[DrawRequest<'_>], out: &mut Vec<u32>) -> Result<()>;
}

/// Logit rows `[rows, vocab]` on the host, with the buffers their distributions reuse. The CPU engine's rows, and the
/// reference the others follow: distributions as `Sampling::distribution` computes them, draws as `sampling::draw`.
#[derive(Default)]
pub struct HostLogits {
    rows: Vec<f32>,
    vocab: usize,
    p: Vec<f32>,
    residual: Vec<f32>,
    order: Vec<u32>,
}

impl HostLogits {
    /// Take `rows` (`[rows.len() / vocab, vocab]`); the buffers stay.
    pub fn fill(&mut self, rows: Vec<f32>, vocab: usize) {
        (self.rows, self.vocab) = (rows, vocab);
    }

    /// The rows' buffer, for the next forward to write over and `fill` with again; no rows are left.
    pub fn take_rows(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.rows)
    }

    fn distribution(&mut self, sampling: Sampling, row: usize) -> Result<()> {
        sampling.distribution(row_of(&self.rows, self.vocab, row)?, &mut self.p, &mut self.order);
        Ok(())
    }
}

/// Row `row` of `[_, vocab]` logits.
fn row_of(rows: &[f32], vocab: usize, row: usize) -> Result<&[f32]> {
    match rows.get(row * vocab..(row + 1) * vocab) {
        Some(r) if vocab > 0 => Ok(r),
        _ => bail!("logit row {row} asked of {} rows", rows.len() / vocab.max(1)),
    }
}

impl LogitRows for HostLogits {
    /// The distributions are computed side by side on rayon's threads, each pick's as it is alone: with a batch of
    /// sampled sequences these (k a sequence a step, each over the whole vocabulary) ran on one core while the
    /// engine's threads waited for the next forward.
    fn probabilities(&mut self, sampling: Sampling, picks: &[(usize, u32)], out: &mut Vec<f32>) -> Result<()> {
        thread_local! {
            static BUFFERS: std::cell::RefCell<(Vec<f32>, Vec<u32>)> = std::cell::RefCell::default();
        }
        let (rows, vocab) = (&self.rows, self.vocab);
        let probability = |(p_token, &(row, token)): (&mut f32, &(usize, u32))| {
            let logits = row_of(rows, vocab, row)?;
            *p_token = BUFFERS.with_borrow_mut(|(p, order)| {
                sampling.distribution(logits, p, order);
                p[token as usize]
            });
            Ok(())
        };
        out.clear();
        out.resize(picks.len(), 0.0);
        match sampling.is_greedy() || picks.len() < 2 {
            true => out.iter_mut().zip(picks).try_for_each(probability),
            false => out.par_iter_mut().zip(picks).try_for_each(probability),
        }
    }

    fn draw(&mut self, sampling: Sampling, requests: &[DrawRequest<'_>], out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        for r in requests {
            if sampling.is_greedy() {
                // The point mass on the argmax, whatever u is and whatever is left out (greedy verification rejects
                // only tokens other than the argmax).
                out.push(crate::sampling::argmax(row_of(&self.rows, self.vocab, r.row)?));
                continue;
            }
            self.distribution(sampling, r.row)?;
            out.push(residual_draw(&self.p, r.without, r.u, &mut self.residual));
        }
        Ok(())
    }
}

/// A draw with `u` from norm(max(0, p − q)), q as `without` says; from p itself when nothing is left.
fn residual_draw(p: &[f32], without: Without<'_>, u: f64, residual: &mut Vec<f32>) -> u32 {
    // A plain draw (a prompt's first token, a bonus token) needs no copy of the row.
    if let Without::Nothing = without {
        return draw_with(p, u);
    }
    residual.clear();
    residual.extend_from_slice(p);
    if let Without::Token(x) = without {
        residual[x as usize] = (residual[x as usize] - 1.0).max(0.0);
    }
    if let Without::Distribution { q, ids } = without {
        for (index, qv) in q.iter().enumerate() {
            if *qv > 0.0 {
                let t = ids.id(index) as usize;
                residual[t] = (residual[t] - qv).max(0.0);
            }
        }
    }
    let total: f64 = residual.iter().map(|r| *r as f64).sum();
    if total <= 0.0 {
        return draw_with(p, u);
    }
    let inv = (1.0 / total) as f32;
    residual.iter_mut().for_each(|r| *r *= inv);
    draw_with(residual, u)
}
