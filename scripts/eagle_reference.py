#!/usr/bin/env python3
"""Reference draft logits for frspec's EAGLE-1 and EAGLE-3 implementations, computed independently in torch.

Why: lossless tests show the engine never changes the target's output, not that the drafts compute what EAGLE
computes. This script builds a tiny Llama target (datasets/fixtures/tiny-llama, HF layout, fp16), runs it with HF
transformers for its hidden states, then runs the committed EAGLE fixtures (eagle1-tiny, eagle3-tiny) with a
direct torch transcription of SafeAILab's cnets1.py (EAGLE-1) and vLLM's llama_eagle3.py (EAGLE-3), teacher-forced
along one fixed token sequence, and writes every position's draft logits to
datasets/fixtures/eagle_reference_logits.json. A Rust test compares frspec's logits with them.

Run in the venv of scripts/setup-numerics-env.sh:  ~/.cache/frspec-py/bin/python scripts/eagle_reference.py
"""
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "datasets" / "fixtures"
H, INTER, HEADS, KV, VOCAB, LAYERS = 64, 96, 4, 2, 260, 4
D = H // HEADS
TOKENS = [256, 72, 105, 33, 10, 257, 3, 200, 45, 99]


def make_target():
    torch.manual_seed(2)
    def lin(o, i): return (torch.rand(o, i) * 2 - 1) / i ** 0.5
    sd = {"model.embed_tokens.weight": torch.rand(VOCAB, H) * 2 - 1, "model.norm.weight": 1 + 0.2 * (torch.rand(H) * 2 - 1),
          "lm_head.weight": lin(VOCAB, H)}
    for l in range(LAYERS):
        p = f"model.layers.{l}"
        sd[f"{p}.input_layernorm.weight"] = 1 + 0.2 * (torch.rand(H) * 2 - 1)
        sd[f"{p}.post_attention_layernorm.weight"] = 1 + 0.2 * (torch.rand(H) * 2 - 1)
        sd[f"{p}.self_attn.q_proj.weight"] = lin(HEADS * D, H)
        sd[f"{p}.self_attn.k_proj.weight"] = lin(KV * D, H)
        sd[f"{p}.self_attn.v_proj.weight"] = lin(KV * D, H)
        sd[f"{p}.self_attn.o_proj.weight"] = lin(H, HEADS * D)
        sd[f"{p}.mlp.gate_proj.weight"] = lin(INTER, H)
        sd[f"{p}.mlp.up_proj.weight"] = lin(INTER, H)
        sd[f"{p}.mlp.down_proj.weight"] = lin(H, INTER)
    out = FIX / "tiny-llama"
    out.mkdir(exist_ok=True)
    save_file({k: v.half().contiguous() for k, v in sd.items()}, out / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": INTER,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": VOCAB,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
              "hidden_act": "silu", "model_type": "llama", "torch_dtype": "float16"}
    json.dump(config, open(out / "config.json", "w"), indent=2)
    return out


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):  # x: [n, heads, d], HF rotate_half convention
    n, _, d = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :], torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def layer(w, p, attn_in, residual, theta):
    """One Llama layer: attention over attn_in (causal), residual add, post-attention norm, MLP, residual add."""
    n = attn_in.shape[0]
    q = (attn_in @ w[f"{p}self_attn.q_proj.weight"].T).view(n, HEADS, D)
    k = (attn_in @ w[f"{p}self_attn.k_proj.weight"].T).view(n, KV, D)
    v = (attn_in @ w[f"{p}self_attn.v_proj.weight"].T).view(n, KV, D)
    q, k = rope(q, theta), rope(k, theta)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)
    scores = scores + torch.triu(torch.full((n, n), float("-inf"), dtype=scores.dtype), 1)
    attn = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(n, HEADS * D)
    x = residual + attn @ w[f"{p}self_attn.o_proj.weight"].T
    m = rms(x, w[f"{p}post_attention_layernorm.weight"])
    g, u = m @ w[f"{p}mlp.gate_proj.weight"].T, m @ w[f"{p}mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(g) * u) @ w[f"{p}mlp.down_proj.weight"].T


def main():
    from transformers import AutoModelForCausalLM
    target_dir = make_target()
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]  # inputs of layers 0..L-1, then the final normed output
    features = hs[LAYERS]
    embed = model.model.embed_tokens.weight.double()
    lm_head = model.lm_head.weight.double()
    nxt = torch.tensor(TOKENS[1:])

    w1 = {k: v.double() for k, v in torch.load(FIX / "eagle1-tiny" / "pytorch_model.bin").items()}
    theta1 = json.load(open(FIX / "eagle1-tiny" / "config.json"))["rope_theta"]
    # EAGLE-1: position j pairs (f_j, t_{j+1}); h = fc(cat(embed, f)); layer without input norm; target lm_head.
    x = torch.cat([embed[nxt], features[:-1]], -1) @ w1["fc.weight"].T
    e1 = layer(w1, "layers.0.", x, x, theta1) @ lm_head.T

    w3 = {k: (v.double() if v.is_floating_point() else v) for k, v in torch.load(FIX / "eagle3-tiny" / "pytorch_model.bin").items()}
    theta3 = json.load(open(FIX / "eagle3-tiny" / "config.json"))["rope_theta"]
    aux = torch.cat([hs[2], hs[LAYERS // 2], hs[LAYERS - 3]], -1)[:-1]
    g = aux @ w3["fc.weight"].T
    attn_in = torch.cat([rms(embed[nxt], w3["midlayer.input_layernorm.weight"]), rms(g, w3["midlayer.hidden_norm.weight"])], -1)
    pre = layer(w3, "midlayer.", attn_in, g, theta3)
    e3 = rms(pre, w3["norm.weight"]) @ w3["lm_head.weight"].T

    result = {"tokens": TOKENS, "target": "tiny-llama", "transformers_dtype": "float64",
              "eagle1_logits": e1.float().tolist(), "eagle3_logits": e3.float().tolist(),
              "target_logits": out.logits[0].float().tolist()}
    json.dump(result, open(FIX / "eagle_reference_logits.json", "w"))
    print(f"wrote {FIX / 'eagle_reference_logits.json'}: {len(TOKENS) - 1} draft positions")


if __name__ == "__main__":
    main()
