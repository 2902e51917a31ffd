//! Shared test helpers: a naive f64 reference forward with HF transformers' semantics, and paths of the
//! fetched offline assets.
#![allow(dead_code)]

use frspec::synthetic::Shape;
use std::collections::BTreeMap;
use std::path::PathBuf;

pub mod smollm2;

pub type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// A fetched asset; a missing one fails the test with the command that fetches it.
pub fn asset(name: &str) -> PathBuf {
    frspec::loading::assets::require(name).unwrap_or_else(|e| panic!("{e:#}"))
}

fn matvec(w: &[f32], rows: usize, x: &[f64]) -> Vec<f64> {
    let cols = x.len();
    (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c]).sum()).collect()
}

fn rms(x: &[f64], w: &[f32]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + 1e-5).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * *w as f64).collect()
}

fn rope_halves(x: &mut [f64], head_dim: usize, pos: usize, theta: f64) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-((2 * i) as f64) / head_dim as f64);
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * angle.cos() - b * angle.sin();
            head[i + half] = b * angle.cos() + a * angle.sin();
        }
    }
}

/// Logits at every position of `tokens`, computed the obvious way in f64 from HF-named weights.
pub fn reference_logits(w: &Weights, s: &Shape, tokens: &[u32]) -> Vec<Vec<f64>> {
    let get = |n: &str| &w.get(n).unwrap_or_else(|| panic!("no {n}")).1;
    let (h, d) = (s.hidden, s.hidden / s.heads);
    let bias = |n: String, v: &mut Vec<f64>| {
        if let Some((_, b)) = w.get(&n) {
            v.iter_mut().zip(b).for_each(|(v, b)| *v += *b as f64);
        }
    };
    let mut xs: Vec<Vec<f64>> =
        tokens.iter().map(|&t| get("model.embed_tokens.weight")[t as usize * h..(t as usize + 1) * h].iter().map(|v| *v as f64).collect()).collect();
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let xn = rms(x, get(&format!("{p}.input_layernorm.weight")));
            let mut q = matvec(get(&format!("{p}.self_attn.q_proj.weight")), s.heads * d, &xn);
            let mut k = matvec(get(&format!("{p}.self_attn.k_proj.weight")), s.kv_heads * d, &xn);
            let mut v = matvec(get(&format!("{p}.self_attn.v_proj.weight")), s.kv_heads * d, &xn);
            bias(format!("{p}.self_attn.q_proj.bias"), &mut q);
            bias(format!("{p}.self_attn.k_proj.bias"), &mut k);
            bias(format!("{p}.self_attn.v_proj.bias"), &mut v);
            rope_halves(&mut q, d, pos, 10000.0);
            rope_halves(&mut k, d, pos, 10000.0);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0.0; s.heads * d];
            for hd in 0..s.heads {
                let kvh = hd / (s.heads / s.kv_heads);
                let q = &qs[pos][hd * d..(hd + 1) * d];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| q.iter().zip(&ks[j][kvh * d..(kvh + 1) * d]).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for i in 0..d {
                        attn[hd * d + i] += ej / sum * vs[j][kvh * d + i];
                    }
                }
            }
            let o = matvec(get(&format!("{p}.self_attn.o_proj.weight")), h, &attn);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let xn = rms(x, get(&format!("{p}.post_attention_layernorm.weight")));
            let g = matvec(get(&format!("{p}.mlp.gate_proj.weight")), s.intermediate, &xn);
            let u = matvec(get(&format!("{p}.mlp.up_proj.weight")), s.intermediate, &xn);
            let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = matvec(get(&format!("{p}.mlp.down_proj.weight")), h, &a);
            x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
        }
    }
    let head = if s.tied { get("model.embed_tokens.weight") } else { get("lm_head.weight") };
    xs.iter().map(|x| matvec(head, s.vocab, &rms(x, get("model.norm.weight")))).collect()
}

/// The frspec binary built for these tests.
pub fn frspec() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_frspec"))
}

/// Exact f32 activations for this test process, as the candle engine computes: a binary whose tests compare the two
/// engines' records calls this first in every test, since the mode is chosen once per process, before any product.
pub fn exact_activations() {
    use frspec::engine::cpu::tensor::Activations;
    Activations::set(Activations::F32).unwrap();
}
