#!/usr/bin/env python3
"""Write tests/hostile/: small hostile inputs for every parser of outside bytes the frspec CLI reaches (issue 22),
with the command line that feeds each one to frspec. tests/hostile.rs runs them (`cargo test --release --test hostile`).

    python3 scripts/make_hostile.py [OUT_DIR]        # default: tests/hostile (relative to the repository root)

tests/hostile/ is generated: edit this script, not the folder, then regenerate with `python3 scripts/make_hostile.py`.
The folder is committed so that the test needs no Python.

Python 3 standard library only. Every file is deterministic (no randomness, fixed zip timestamps), so a rerun
writes the same bytes.

Layout of OUT_DIR:
  cases.tsv      one line per hostile case: `NAME<TAB>frspec arguments`. Each must end in exit 1 (check: its own 2
                 for unusable input) with a one-line `error: ...` last on stderr (only `note:`/`warning:` lines
                 before it): no panic, no abort, no OOM, no timeout.
  expect-ok.tsv  the same format for runs that must SUCCEED (exit 0): controls showing that every base command line
                 is valid with benign inputs (so a hostile case fails on the hostile bytes, not on a flag), inputs
                 the correct answer to which is to cope (a damaged journal entry is redone on --resume), and odd but
                 legitimate inputs.
  _aux/          benign helper inputs the command lines use (a tiny safetensors target with its tokenizer, a tiny
                 GGUF, a tiny EAGLE-1 head, a token file, a frequency file, a dataset).
  everything else: the cases (a file or a folder), named by the first column.

Placeholders in the arguments (arguments are split with shlex, so quotes work):
  {}      the path of the case (a runner copies the case into a fresh temporary folder first, so a command that
          writes beside its input never changes tests/hostile)
  {text}  the case file's contents as one argument (for --speculative-config, which takes JSON text, not a path)
  {tmp}   a fresh empty temporary folder for this run (for --out)
  {aux}   OUT_DIR/_aux (helpers; read-only use)
Lines starting with # are comments.
"""
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "hostile")
AUX = os.path.join(OUT, "_aux")
CASES = []      # (name, args)
OK = []         # (name, args) that must succeed
ZIP_TIME = (2024, 1, 1, 0, 0, 0)


def path(name):
    return os.path.join(OUT, name)


def write(name, data):
    p = path(name)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(p, "wb") as f:
        f.write(data)
    return p


def case(name, args, data=None):
    """A hostile case; `data` (bytes/str) is written to NAME unless the caller wrote it (a folder)."""
    if data is not None:
        write(name, data)
    CASES.append((name, args))


def values(n, seed=1):
    """n deterministic small floats."""
    return [(((i + seed) * 2654435761 % 1000) / 1000.0 - 0.5) * 0.2 for i in range(n)]


def f32(vals):
    return struct.pack(f"<{len(vals)}f", *vals)


# ----------------------------------------------------------------------------------------------------------------
# Tiny model shapes
# ----------------------------------------------------------------------------------------------------------------
H, HEADS, KV, I = 8, 2, 1, 8          # hidden, attention heads, KV heads (head_dim 4), intermediate
HD = H // HEADS
V_ST, LAYERS_ST = 16, 2               # safetensors target: vocabulary, layers (truncated:1 needs > 1)
V_GG, LAYERS_GG = 8, 1                # GGUF target

TOKENS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "Ġ", ".", "?", "<s>", "</s>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def llama_shapes(vocab, layers, hf):
    """(name, [rows, cols] or [n]) of a Llama; HF names if hf else GGUF names."""
    out = []
    if hf:
        out.append(("model.embed_tokens.weight", [vocab, H]))
        for l in range(layers):
            p = f"model.layers.{l}."
            out += [(p + "input_layernorm.weight", [H]), (p + "self_attn.q_proj.weight", [HEADS * HD, H]),
                    (p + "self_attn.k_proj.weight", [KV * HD, H]), (p + "self_attn.v_proj.weight", [KV * HD, H]),
                    (p + "self_attn.o_proj.weight", [H, HEADS * HD]), (p + "post_attention_layernorm.weight", [H]),
                    (p + "mlp.gate_proj.weight", [I, H]), (p + "mlp.up_proj.weight", [I, H]),
                    (p + "mlp.down_proj.weight", [H, I])]
        out += [("model.norm.weight", [H]), ("lm_head.weight", [vocab, H])]
    else:
        out.append(("token_embd.weight", [vocab, H]))
        for l in range(layers):
            p = f"blk.{l}."
            out += [(p + "attn_norm.weight", [H]), (p + "attn_q.weight", [HEADS * HD, H]),
                    (p + "attn_k.weight", [KV * HD, H]), (p + "attn_v.weight", [KV * HD, H]),
                    (p + "attn_output.weight", [H, HEADS * HD]), (p + "ffn_norm.weight", [H]),
                    (p + "ffn_gate.weight", [I, H]), (p + "ffn_up.weight", [I, H]), (p + "ffn_down.weight", [H, I])]
        out += [("output_norm.weight", [H]), ("output.weight", [vocab, H])]
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_values(name, shape, seed):
    n = numel(shape)
    if name.endswith("norm.weight") or "layernorm" in name:
        return [1.0] * n
    return values(n, seed)


# ----------------------------------------------------------------------------------------------------------------
# safetensors
# ----------------------------------------------------------------------------------------------------------------
def safetensors_bytes(tensors, metadata=None, header_override=None, header_len_override=None, data_override=None):
    """tensors: list of (name, dtype, shape, raw bytes). Offsets are laid out in order."""
    header, data, at = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    if header_override is not None:
        header = header_override(header)
    text = header if isinstance(header, bytes) else json.dumps(header, sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    n = len(text) if header_len_override is None else header_len_override
    return struct.pack("<Q", n) + text + (data if data_override is None else data_override)


def llama_safetensors(vocab=V_ST, layers=LAYERS_ST):
    return [(n, "F32", s, f32(tensor_values(n, s, k + 1))) for k, (n, s) in enumerate(llama_shapes(vocab, layers, True))]


def hf_config(vocab=V_ST, layers=LAYERS_ST, **over):
    c = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers,
         "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": vocab, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False, "hidden_act": "silu",
         "model_type": "llama", "torch_dtype": "float32", "bos_token_id": 12, "eos_token_id": 13}
    c.update(over)
    return json.dumps(c, indent=1)


def tokenizer_json():
    vocab = {t: i for i, t in enumerate(TOKENS)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(TOKENS) if t.startswith("<")]
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []}}, indent=1)


def tokenizer_config(template=TEMPLATE):
    return json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}, indent=1)


def model_folder(name, config=None, st=None, tokenizer=True, template=TEMPLATE, extra=None):
    """A model folder: config.json + model.safetensors (+ tokenizer). Returns its path."""
    write(f"{name}/config.json", hf_config() if config is None else config)
    if st is not False:
        write(f"{name}/model.safetensors", safetensors_bytes(llama_safetensors()) if st is None else st)
    if tokenizer:
        write(f"{name}/tokenizer.json", tokenizer_json())
        write(f"{name}/tokenizer_config.json", tokenizer_config(template))
    for rel, data in (extra or {}).items():
        write(f"{name}/{rel}", data)
    return path(name)


# ----------------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------------
GG_U32, GG_I32, GG_F32, GG_STR, GG_ARR, GG_U64 = 4, 5, 6, 8, 9, 10


def gstr(s, declared=None):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if declared is None else declared) + b


def gkv(key, vtype, payload):
    return gstr(key) + struct.pack("<I", vtype) + payload


def gu32(key, v):
    return gkv(key, GG_U32, struct.pack("<I", v))


def gf32(key, v):
    return gkv(key, GG_F32, struct.pack("<f", v))


def gs(key, v):
    return gkv(key, GG_STR, gstr(v))


def garr_str(key, items):
    return gkv(key, GG_ARR, struct.pack("<IQ", GG_STR, len(items)) + b"".join(gstr(t) for t in items))


def garr_i32(key, items):
    return gkv(key, GG_ARR, struct.pack("<IQ", GG_I32, len(items)) + b"".join(struct.pack("<i", t) for t in items))


def gguf_kvs(vocab=V_GG, **u32_over):
    toks = TOKENS[:vocab - 2] + ["<s>", "</s>"]
    nums = {"llama.embedding_length": H, "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV,
            "llama.feed_forward_length": I, "llama.block_count": LAYERS_GG, "llama.context_length": 128,
            "llama.vocab_size": vocab}
    nums.update(u32_over)
    kvs = [gs("general.architecture", "llama")]
    kvs += [gu32(k, v) for k, v in nums.items() if v is not None]
    kvs += [gf32("llama.attention.layer_norm_rms_epsilon", 1e-5), gf32("llama.rope.freq_base", 10000.0),
            gs("tokenizer.ggml.model", "gpt2"), garr_str("tokenizer.ggml.tokens", toks),
            garr_str("tokenizer.ggml.merges", []),
            garr_i32("tokenizer.ggml.token_type", [1] * (vocab - 2) + [3, 3]),
            gu32("tokenizer.ggml.bos_token_id", vocab - 2), gu32("tokenizer.ggml.eos_token_id", vocab - 1)]
    return kvs


def gguf_bytes(kvs=None, tensors=None, magic=b"GGUF", version=3, tensor_count=None, kv_count=None, align=32,
               info_patch=None, cut=None):
    """tensors: list of (name, [rows, cols] or [n], raw f32 bytes). info_patch(name, dims_ne, dtype, offset) may
    return replacements for one tensor's info (the data stays as laid out)."""
    kvs = gguf_kvs() if kvs is None else kvs
    if tensors is None:
        tensors = [(n, s, f32(tensor_values(n, s, k + 1))) for k, (n, s) in enumerate(llama_shapes(V_GG, LAYERS_GG, False))]
    infos, data = b"", b""
    for name, shape, raw in tensors:
        data += b"\0" * (-len(data) % align)
        ne, dtype, offset = list(reversed(shape)), 0, len(data)
        if info_patch:
            ne, dtype, offset = info_patch(name, ne, dtype, offset)
        infos += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        infos += struct.pack("<IQ", dtype, offset)
        data += raw
    head = magic + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                               len(kvs) if kv_count is None else kv_count)
    out = head + b"".join(kvs) + infos
    out += b"\0" * (-len(out) % align)
    out += data
    return out[:cut] if cut is not None else out


# ----------------------------------------------------------------------------------------------------------------
# PyTorch pickles (torch.save's zip layout, written by hand: frspec must read them as data)
# ----------------------------------------------------------------------------------------------------------------
PROTO2 = b"\x80\x02"
MARK, STOP, TUPLE, EMPTY_TUPLE, REDUCE, SETITEMS = b"(", b".", b"t", b")", b"R", b"u"
EMPTY_LIST, EMPTY_DICT, APPENDS, APPEND, NEWFALSE, NONE = b"]", b"}", b"e", b"a", b"\x89", b"N"


def glob(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def uni(s, declared=None):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b) if declared is None else declared) + b


def bint(v):
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if -2**31 <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)


def tup(items):
    return MARK + b"".join(items) + TUPLE


def ordered_dict():
    return glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE


def storage_pid(key, n, cls="FloatStorage", fields=None):
    items = [uni("storage"), glob("torch", cls), uni(key), uni("cpu"), bint(n)] if fields is None else fields
    return tup(items) + b"Q"


def rebuild(key, n, shape, stride=None, offset=0, cls="FloatStorage", args=None):
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)."""
    if stride is None:
        stride, acc = [], 1
        for d in reversed(shape):
            stride.insert(0, acc)
            acc *= d
    if args is None:
        args = [storage_pid(key, n, cls), bint(offset), tup([bint(d) for d in shape]), tup([bint(s) for s in stride]),
                NEWFALSE, ordered_dict()]
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(args) + REDUCE


def state_dict(entries):
    """entries: list of (key, pickle-expression bytes)."""
    return PROTO2 + ordered_dict() + MARK + b"".join(uni(k) + e for k, e in entries) + SETITEMS + STOP


def torch_zip(pkl, storages=(), prefix="archive", compress=zipfile.ZIP_STORED, extra=()):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compress) as z:
        def put(name, data):
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.compress_type = compress
            z.writestr(info, data)
        put(f"{prefix}/data.pkl", pkl)
        for key, raw in storages:
            put(f"{prefix}/data/{key}", raw)
        put(f"{prefix}/version", "3\n")
        for name, data in extra:
            put(name, data)
    return buf.getvalue()


EAGLE_KEYS = [("fc.weight", [H, 2 * H]), ("layers.0.self_attn.q_proj.weight", [HEADS * HD, H]),
              ("layers.0.self_attn.k_proj.weight", [KV * HD, H]), ("layers.0.self_attn.v_proj.weight", [KV * HD, H]),
              ("layers.0.self_attn.o_proj.weight", [H, HEADS * HD]),
              ("layers.0.post_attention_layernorm.weight", [H]), ("layers.0.mlp.gate_proj.weight", [I, H]),
              ("layers.0.mlp.up_proj.weight", [I, H]), ("layers.0.mlp.down_proj.weight", [H, I])]


def eagle_config():
    return hf_config(layers=1)


def eagle_head_pt(replace=None, drop_storage=None):
    """A valid EAGLE-1 head for the tiny target, as pytorch_model.bin bytes. replace: {key: pickle expression}."""
    entries, storages = [], []
    for k, (key, shape) in enumerate(EAGLE_KEYS):
        n = numel(shape)
        expr = (replace or {}).get(key) or rebuild(str(k), n, shape)
        entries.append((key, expr))
        if str(k) != drop_storage:
            storages.append((str(k), f32(tensor_values(key, shape, 100 + k))))
    return torch_zip(state_dict(entries), storages, prefix="pytorch_model")


def draft_folder(name, bin_bytes=None, st_bytes=None, config=None):
    write(f"{name}/config.json", eagle_config() if config is None else config)
    if bin_bytes is not None:
        write(f"{name}/pytorch_model.bin", bin_bytes)
    if st_bytes is not None:
        write(f"{name}/model.safetensors", st_bytes)
    return path(name)


# ----------------------------------------------------------------------------------------------------------------
# .npy
# ----------------------------------------------------------------------------------------------------------------
def npy(header_dict_text, data=b"", version=1, magic=b"\x93NUMPY", header_len=None):
    h = header_dict_text.encode()
    pre = 10 if version == 1 else 12
    h += b" " * (-(pre + len(h) + 1) % 64) + b"\n"
    n = len(h) if header_len is None else header_len
    size = struct.pack("<H", n) if version == 1 else struct.pack("<I", n)
    return magic + bytes([version, 0]) + size + h + data


def npy_i64(vals):
    return npy("{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }" % len(vals), struct.pack(f"<{len(vals)}q", *vals))


# ----------------------------------------------------------------------------------------------------------------
# Build everything
# ----------------------------------------------------------------------------------------------------------------
def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(AUX)

    # ---- helpers -------------------------------------------------------------------------------------------------
    target = model_folder("_aux/tiny-target")
    write("_aux/tokens.json", "[1, 2, 3]")
    write("_aux/tiny.gguf", gguf_bytes())
    draft_folder("_aux/tiny-head", eagle_head_pt())
    counts16 = [7, 1, 0, 40, 2, 90, 0, 0, 3, 40, 0, 0, 5, 0, 0, 1]
    write("_aux/freq16.npy", npy_i64(counts16))
    questions = [{"question_id": 1, "category": "writing", "turns": ["abc", "bad"]},
                 {"question_id": 2, "category": "math", "turns": ["cab", "dab"]},
                 {"question_id": 3, "category": "writing", "turns": ["fed"]}]
    write("_aux/questions.jsonl", "".join(json.dumps(q) + "\n" for q in questions))

    score = "score --model {} --tokens-file {aux}/tokens.json"
    freq_show = "freq show {}"
    gen_t = "generate --model {aux}/tiny-target --prompt abc --max-new-tokens 3"
    draft_gen = gen_t + " --draft {} --draft-kind eagle"
    freq_gen = gen_t + " --draft-kind truncated:1 --freq {} --ratio 0.5"
    sweep_base = ("sweep --model {aux}/tiny-target --draft-kind truncated:1 --ratios 0 --temperatures 0 --repeats 1 "
                  "--max-new-tokens 2 --turns 1 --quiet --out {tmp}/out")
    dataset_sweep = sweep_base + " --dataset {}"
    spec_sweep = ("sweep --model {aux}/tiny-target --draft-kind truncated:1 --freq {aux}/freq16.npy --temperatures 0 "
                  "--repeats 1 --max-new-tokens 2 --turns 1 --num-prompts 1 --dataset {aux}/questions.jsonl --quiet "
                  "--out {tmp}/out --speculative-config {text}")

    # controls: each base command line succeeds with benign inputs
    OK.extend([
        ("_aux/tiny.gguf", score),
        ("_aux/tiny-target", score),
        ("_aux/tiny-head", draft_gen),
        ("_aux/freq16.npy", freq_show),
        ("_aux/freq16.npy", freq_gen),
        ("_aux/questions.jsonl", dataset_sweep),
        ("_aux/spec-ok.json", spec_sweep),
        ("_aux/sweep-ok.toml", "sweep --config {} --out {tmp}/out --quiet"),
    ])
    write("_aux/spec-ok.json", json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "pruning_ratio": 0.5}))
    toml_base = ('model = "{aux}/tiny-target"\ndraft_kind = "truncated:1"\ndataset = "{aux}/questions.jsonl"\n'
                 'ratios = [0.0]\ntemperatures = [0.0]\nrepeats = 1\nmax_new_tokens = 2\nturns = 1\n')
    rel_aux = os.path.relpath(AUX, ROOT)
    toml_ok = toml_base.replace("{aux}", rel_aux)
    write("_aux/sweep-ok.toml", toml_ok)

    # ---- GGUF (target model) ---------------------------------------------------------------------------------------
    good = gguf_bytes()
    case("gguf-truncated-header.gguf", score, good[:14])
    case("gguf-truncated-tensor-data.gguf", score, good[:len(good) - 100])
    case("gguf-wrong-magic.gguf", score, b"GGUX" + good[4:])
    case("gguf-version-99.gguf", score, gguf_bytes(version=99))
    case("gguf-empty.gguf", score, b"")
    case("gguf-huge-tensor-count.gguf", score, gguf_bytes(tensor_count=2**62))
    case("gguf-huge-kv-count.gguf", score, gguf_bytes(kv_count=2**40))
    case("gguf-huge-string-length.gguf", score,
         gguf_bytes(kvs=[gstr("general.architecture") + struct.pack("<I", GG_STR) + gstr("llama", declared=2**62)]))
    case("gguf-huge-key-length.gguf", score, gguf_bytes(kvs=[gstr("x", declared=0xFFFFFFFFFFFF) + b"x"]))
    case("gguf-huge-array-length.gguf", score,
         gguf_bytes(kvs=gguf_kvs() + [gkv("tokenizer.junk", GG_ARR, struct.pack("<IQ", GG_U32, 2**40))]))
    case("gguf-nested-arrays.gguf", score,
         gguf_bytes(kvs=gguf_kvs() + [gkv("junk", GG_ARR, struct.pack("<IQ", GG_ARR, 1) * 200 + struct.pack("<IQ", GG_U32, 0))]))
    case("gguf-unknown-value-type.gguf", score, gguf_bytes(kvs=gguf_kvs() + [gkv("junk", 77, b"\0" * 8)]))
    case("gguf-offset-past-end.gguf", score,
         gguf_bytes(info_patch=lambda n, ne, t, o: (ne, t, o + 2**40 if n == "blk.0.ffn_up.weight" else o)))
    case("gguf-offset-wraps-u64.gguf", score,
         gguf_bytes(info_patch=lambda n, ne, t, o: (ne, t, 2**64 - 32 if n == "blk.0.ffn_up.weight" else o)))
    # token_embd [vocab=2^61, hidden=8]: 8 * 2^61 = 2^64 wraps to 0 elements, so no bytes look needed; no vocab_size key
    # so the vocabulary is taken from this tensor.
    tied = [(n, s, f32(tensor_values(n, s, k + 1))) for k, (n, s) in enumerate(llama_shapes(V_GG, LAYERS_GG, False))
            if n != "output.weight"]
    case("gguf-dim-product-overflow-embd.gguf", score,
         gguf_bytes(kvs=gguf_kvs(**{"llama.vocab_size": None}), tensors=tied,
                    info_patch=lambda n, ne, t, o: ([8, 2**61], t, o) if n == "token_embd.weight" else (ne, t, o)))
    case("gguf-dim-product-overflow-norm.gguf", score,
         gguf_bytes(info_patch=lambda n, ne, t, o: ([2**32, 2**32], t, o) if n == "blk.0.attn_norm.weight" else (ne, t, o)))
    case("gguf-dim-product-overflow-q4.gguf", score,
         gguf_bytes(info_patch=lambda n, ne, t, o: ([2**33, 2**32], 2, o) if n == "blk.0.ffn_up.weight" else (ne, t, o)))
    case("gguf-too-many-dims.gguf", score,
         gguf_bytes(info_patch=lambda n, ne, t, o: ([1] * 9, t, o) if n == "blk.0.ffn_up.weight" else (ne, t, o)))
    case("gguf-embd-zero-dims.gguf", score,
         gguf_bytes(kvs=gguf_kvs(**{"llama.vocab_size": None}),
                    info_patch=lambda n, ne, t, o: ([], t, o) if n == "token_embd.weight" else (ne, t, o)))
    # Q8_0 (8) and Q4_1 (3) rows of 48 columns: not whole blocks of 32, which the loader refuses before laying them
    # out for the kernel (96 values: 3 blocks' bytes, within the tensor's f32 data).
    for name, ggml_type in (("gguf-q8_0-columns-not-blocks.gguf", 8), ("gguf-q4_1-columns-not-blocks.gguf", 3)):
        case(name, score, gguf_bytes(info_patch=lambda n, ne, t, o, ggml_type=ggml_type:
                                     ([48, 2], ggml_type, o) if n == "blk.0.ffn_up.weight" else (ne, t, o)))
    case("gguf-unknown-ggml-type.gguf", score,
         gguf_bytes(info_patch=lambda n, ne, t, o: (ne, 99, o) if n == "blk.0.ffn_up.weight" else (ne, t, o)))
    case("gguf-alignment-zero.gguf", score, gguf_bytes(kvs=gguf_kvs() + [gu32("general.alignment", 0)]))
    case("gguf-alignment-huge.gguf", score, gguf_bytes(kvs=gguf_kvs() + [gu32("general.alignment", 0xFFFFFFFF)]))
    case("gguf-head-count-zero.gguf", score, gguf_bytes(kvs=gguf_kvs(**{"llama.attention.head_count": 0})))
    case("gguf-huge-dims-in-metadata.gguf", score,
         gguf_bytes(kvs=gguf_kvs(**{"llama.embedding_length": 0xFFFFFFFF, "llama.attention.head_count": 1,
                                    "llama.attention.head_count_kv": 1})))
    case("gguf-huge-context-length.gguf", score, gguf_bytes(kvs=gguf_kvs(**{"llama.context_length": 0xFFFFFFFF})))
    case("gguf-huge-block-count.gguf", score, gguf_bytes(kvs=gguf_kvs(**{"llama.block_count": 0xFFFFFFFF})))
    case("gguf-architecture-not-string.gguf", score,
         gguf_bytes(kvs=[gu32("general.architecture", 7)] + gguf_kvs()[1:]))
    case("gguf-tokenizer-tokens-not-strings.gguf", score,
         gguf_bytes(kvs=[kv for kv in gguf_kvs() if b"tokenizer.ggml.tokens" not in kv] + [garr_i32("tokenizer.ggml.tokens", [1, 2])]))
    case("gguf-bos-id-out-of-range.gguf", score,
         gguf_bytes(kvs=gguf_kvs() + [gu32("tokenizer.ggml.bos_token_id", 0xFFFFFFFF)]))

    # ---- safetensors (target model folders and files) ------------------------------------------------------------
    st_good = safetensors_bytes(llama_safetensors())
    st_cases = {
        "st-header-longer-than-file": safetensors_bytes(llama_safetensors(), header_len_override=1 << 40),
        "st-header-length-u64-max": safetensors_bytes(llama_safetensors(), header_len_override=2**64 - 1),
        "st-header-not-json": safetensors_bytes([], header_override=lambda h: b"{\"a\": [1, 2,"),
        "st-header-not-utf8": safetensors_bytes([], header_override=lambda h: b"{\"\xff\xfe\": 1}"),
        "st-empty-file": b"",
        "st-seven-bytes": b"\x08\0\0\0\0\0\0",
        "st-offsets-past-end": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(
            h, **{"lm_head.weight": dict(h["lm_head.weight"], data_offsets=[h["lm_head.weight"]["data_offsets"][0], 2**40])})),
        "st-offsets-overlap": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(
            h, **{"model.norm.weight": dict(h["model.norm.weight"], data_offsets=h["model.embed_tokens.weight"]["data_offsets"][:1] + [32])})),
        "st-offsets-reversed": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(
            h, **{"model.norm.weight": dict(h["model.norm.weight"], data_offsets=list(reversed(h["model.norm.weight"]["data_offsets"])))})),
        "st-dtype-unknown": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(
            h, **{"model.norm.weight": dict(h["model.norm.weight"], dtype="Q7")})),
        "st-dtype-int64-weight": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(
            h, **{"model.norm.weight": dict(h["model.norm.weight"], dtype="I64", shape=[H // 2])})),
        "st-shape-overflow": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(
            h, **{"model.norm.weight": dict(h["model.norm.weight"], shape=[2**32, 2**32, 2])})),
        "st-shape-mismatch-with-config": safetensors_bytes(
            [(n, "F32", [s[0] + 1] + s[1:], f32(values(numel([s[0] + 1] + s[1:])))) for n, s in llama_shapes(V_ST, LAYERS_ST, True)]),
        "st-norm-f8-e4m3": safetensors_bytes([(n, "F8_E4M3", s, bytes(numel(s))) if n == "model.norm.weight" else (n, d, s, r)
                                              for n, d, s, r in llama_safetensors()]),
        "st-lm-head-f8-e4m3": safetensors_bytes([(n, "F8_E4M3", s, bytes(numel(s))) if n == "lm_head.weight" else (n, d, s, r)
                                                 for n, d, s, r in llama_safetensors()]),
        "st-missing-tensor": safetensors_bytes([t for t in llama_safetensors() if t[0] != "model.norm.weight"]),
        "st-metadata-not-strings": safetensors_bytes(llama_safetensors(), header_override=lambda h: dict(h, __metadata__={"a": [1, 2]})),
        "st-truncated-data": st_good[:len(st_good) - 64],
    }
    for name, data in st_cases.items():
        model_folder(name, st=data)
        CASES.append((name, score))
    # A .safetensors file given directly (config.json and tokenizer beside it).
    model_folder("st-file-direct-offsets-past-end", st=st_cases["st-offsets-past-end"])
    CASES.append(("st-file-direct-offsets-past-end", "score --model {}/model.safetensors --tokens-file {aux}/tokens.json"))

    # Sharded folders whose index names files outside the folder.
    idx = lambda shard: json.dumps({"metadata": {}, "weight_map": {n: shard for n, _ in llama_shapes(V_ST, LAYERS_ST, True)}})
    model_folder("st-index-escape/model", st=False, extra={"model.safetensors.index.json": idx("../escape.safetensors")})
    write("st-index-escape/escape.safetensors", st_good)
    CASES.append(("st-index-escape", "score --model {}/model --tokens-file {aux}/tokens.json"))
    model_folder("st-index-absolute", st=False, extra={"model.safetensors.index.json": idx("/etc/passwd")})
    CASES.append(("st-index-absolute", score))
    model_folder("st-index-absolute-existing-safetensors", st=False,
                 extra={"model.safetensors.index.json": idx(os.path.join(AUX, "tiny-target", "model.safetensors"))})
    CASES.append(("st-index-absolute-existing-safetensors", score))
    model_folder("st-index-dotdot-inside", st=False, extra={"model.safetensors.index.json": idx("sub/../../x.safetensors")})
    CASES.append(("st-index-dotdot-inside", score))
    model_folder("st-index-not-json", st=False, extra={"model.safetensors.index.json": "{\"weight_map\": "})
    CASES.append(("st-index-not-json", score))
    model_folder("st-index-weight-map-list", st=False, extra={"model.safetensors.index.json": "{\"weight_map\": [1, 2]}"})
    CASES.append(("st-index-weight-map-list", score))
    model_folder("st-index-missing-shard", st=False, extra={"model.safetensors.index.json": idx("model-00001-of-00002.safetensors")})
    CASES.append(("st-index-missing-shard", score))
    model_folder("st-index-shard-is-folder", st=False, extra={"model.safetensors.index.json": idx("shard.safetensors"),
                                                             "shard.safetensors/x": "x"})
    CASES.append(("st-index-shard-is-folder", score))
    # config.json of a model folder
    for name, cfg in {
        "cfg-not-json": "{\"hidden_size\": ",
        "cfg-wrong-types": hf_config(hidden_size="eight"),
        "cfg-heads-zero": hf_config(num_attention_heads=0),
        "cfg-kv-heads-zero": hf_config(num_key_value_heads=0),
        "cfg-huge-hidden": hf_config(hidden_size=2**62, num_attention_heads=1, num_key_value_heads=1),
        "cfg-huge-vocab": hf_config(vocab_size=2**62),
        "cfg-huge-context": hf_config(max_position_embeddings=2**62),
        "cfg-huge-layers": hf_config(num_hidden_layers=2**62),
        "cfg-negative-eps": hf_config(rms_norm_eps=-1.0),
        "cfg-rope-theta-zero": hf_config(rope_theta=0.0),
        "cfg-rope-scaling-bad": hf_config(rope_scaling={"rope_type": "llama3", "factor": "x"}),
        "cfg-rope-scaling-zero": hf_config(rope_scaling={"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 1.0, "original_max_position_embeddings": 0}),
        "cfg-head-dim-odd": hf_config(head_dim=3),
        "cfg-head-dim-huge": hf_config(head_dim=2**40),
    }.items():
        model_folder(name, config=cfg)
        CASES.append((name, score))
    # Tokenizer files beside the weights
    model_folder("tok-json-not-json", extra={"tokenizer.json": "{\"model\": "})
    CASES.append(("tok-json-not-json", score))
    model_folder("tok-config-not-json", extra={"tokenizer_config.json": "{\"bos_token\": "})
    CASES.append(("tok-config-not-json", score))
    model_folder("tok-template-bomb", template="{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}")
    CASES.append(("tok-template-bomb", "generate --model {} --prompt abc --max-new-tokens 2"))
    model_folder("tok-template-recursion", template="{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    CASES.append(("tok-template-recursion", "generate --model {} --prompt abc --max-new-tokens 2"))
    model_folder("tok-more-tokens-than-vocab", config=hf_config(vocab=4), st=safetensors_bytes(llama_safetensors(vocab=4)))
    CASES.append(("tok-more-tokens-than-vocab", score))

    # ---- PyTorch pickles: frequency files (freq show) and EAGLE checkpoints (generate --draft) ---------------------
    def memo_bomb(levels=40):
        p = PROTO2 + EMPTY_LIST + b"q\x00"
        for i in range(1, levels):
            p += EMPTY_LIST + MARK + b"h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + APPENDS + b"q" + bytes([i])
        return p + STOP

    def nested_lists(depth):
        return PROTO2 + EMPTY_LIST * depth + APPEND * (depth - 1) + STOP

    t_short = glob("torch._utils", "_rebuild_tensor_v2")
    pickles = {
        "memo-bomb": memo_bomb(),
        "binunicode-huge-length": PROTO2 + uni("", declared=0xFFFFFFF0) + STOP,
        "rebuild-empty-args": PROTO2 + t_short + EMPTY_TUPLE + REDUCE + STOP,
        "rebuild-one-arg": PROTO2 + t_short + tup([bint(0)]) + REDUCE + STOP,
        "rebuild-three-args": PROTO2 + t_short + tup([storage_pid("0", 4, "LongStorage"), bint(0), tup([bint(4)])]) + REDUCE + STOP,
        "rebuild-from-type-short": PROTO2 + glob("torch._tensor", "_rebuild_from_type_v2") + tup([bint(1)]) + REDUCE + STOP,
        "rebuild-parameter-empty": PROTO2 + glob("torch._utils", "_rebuild_parameter") + EMPTY_TUPLE + REDUCE + STOP,
        "storage-pid-short": PROTO2 + rebuild("0", 2, [2], args=[tup([uni("storage")]) + b"Q", bint(0), tup([bint(2)]),
                                                                tup([bint(1)]), NEWFALSE, ordered_dict()]) + STOP,
        "storage-pid-not-tuple": PROTO2 + rebuild("0", 2, [2], args=[bint(5) + b"Q", bint(0), tup([bint(2)]),
                                                                    tup([bint(1)]), NEWFALSE, ordered_dict()]) + STOP,
        "storage-unknown-class": PROTO2 + rebuild("0", 2, [2], cls="ComplexFloatStorage") + STOP,
        # Sizes are pickled as BININT (i32) as torch does for them; 2^31 itself would be a LONG, which candle's
        # reader refuses as a size, so the big shapes are 2^31 - 1 (1-D) or 2^16 x 2^15.
        "shape-2pow31-storage-16-bytes": PROTO2 + rebuild("0", 2, [2**31 - 1], cls="LongStorage") + STOP,
        "shape-2pow31-stride-0": PROTO2 + rebuild("0", 2, [2**31 - 1], stride=[0], cls="LongStorage") + STOP,
        "shape-2d-2pow31-storage-16-bytes": PROTO2 + rebuild("0", 2, [2**16, 2**15], cls="LongStorage") + STOP,
        "shape-long-2pow31": PROTO2 + rebuild("0", 2, [2**31], cls="LongStorage") + STOP,
        "stride-huge": PROTO2 + rebuild("0", 2, [3], stride=[2**31 - 1], cls="LongStorage") + STOP,
        "negative-offset": PROTO2 + rebuild("0", 2, [2], offset=-1, cls="LongStorage") + STOP,
        "negative-size": PROTO2 + rebuild("0", 2, [-2], stride=[1], cls="LongStorage") + STOP,
        "declared-storage-huge": PROTO2 + rebuild("0", 2**40, [2], cls="LongStorage") + STOP,
        "storage-missing": PROTO2 + rebuild("7", 2, [2], cls="LongStorage") + STOP,
        "os-system": PROTO2 + glob("os", "system") + uni("touch /tmp/frspec-hostile-pwned") + b"\x85" + REDUCE + STOP,
        "builtins-eval": PROTO2 + glob("builtins", "eval") + uni("__import__('os').system('touch /tmp/frspec-hostile-pwned')") + b"\x85" + REDUCE + STOP,
        "truncated-no-stop": PROTO2 + EMPTY_LIST + MARK + bint(1) + bint(2),
        "empty-pickle": b"",
        "unknown-opcode": PROTO2 + b"\xff" + STOP,
        "binget-missing-memo": PROTO2 + b"h\x07" + STOP,
        "stack-underflow-reduce": PROTO2 + REDUCE + STOP,
        "append-to-int": PROTO2 + bint(1) + bint(2) + APPEND + STOP,
        "setitems-odd": PROTO2 + EMPTY_DICT + MARK + uni("a") + SETITEMS + STOP,
        "root-int": PROTO2 + bint(7) + STOP,
        "root-none": PROTO2 + NONE + STOP,
        "root-dict-of-strings": PROTO2 + EMPTY_DICT + MARK + uni("a") + uni("b") + uni("c") + uni("d") + SETITEMS + STOP,
        "root-list-of-strings": PROTO2 + EMPTY_LIST + MARK + uni("a") + uni("b") + APPENDS + STOP,
        "root-list-negative-ids": PROTO2 + EMPTY_LIST + MARK + bint(3) + bint(-1) + APPENDS + STOP,
        "root-list-huge-long": PROTO2 + EMPTY_LIST + MARK + bint(3) + bint(2**62) + APPENDS + STOP,
        "long1-255-bytes": PROTO2 + b"\x8a\xff" + b"\x01" * 255 + STOP,
        "mark-never-closed": PROTO2 + MARK * 1000 + STOP,
        "global-no-newline": PROTO2 + b"c" + b"A" * 2000,
    }
    for name, pkl in pickles.items():
        storages = [("0", struct.pack("<2q", 5, 9))]
        case(f"pt-{name}.pt", freq_show, torch_zip(pkl, storages))
    # Deep nesting of lists: a million levels, DEFLATE-compressed (the zip format allows it; a few KiB on disk).
    deep = torch_zip(nested_lists(1_000_000), compress=zipfile.ZIP_DEFLATED)
    case("pt-nested-lists-deflated.pt", freq_show, deep)
    case("pt-not-a-zip.pt", freq_show, b"PK\x03\x04" + b"\0" * 60)
    case("pt-zip-without-pkl.pt", freq_show, _zip_only([("archive/version", "3\n")]))
    case("pt-zip-pkl-huge-declared-size.pt", freq_show, _lie_about_size(torch_zip(PROTO2 + EMPTY_LIST + STOP)))
    case("pt-zip-two-data-pkl.pt", freq_show,
         _zip_only([("a/data.pkl", PROTO2 + bint(1) + STOP), ("b/data.pkl", PROTO2 + EMPTY_LIST + STOP)]))
    case("pt-zip-storage-path-escape.pt", freq_show,
         torch_zip(PROTO2 + rebuild("../../../etc/passwd", 2, [2], cls="LongStorage") + STOP, [("0", struct.pack("<2q", 5, 9))]))

    # Same pickles as an EAGLE-1 checkpoint: a state dict whose first tensor is the hostile part.
    for name, pkl in pickles.items():
        if name in ("empty-pickle", "truncated-no-stop", "global-no-newline", "unknown-opcode", "mark-never-closed",
                    "memo-bomb", "binunicode-huge-length", "binget-missing-memo", "stack-underflow-reduce",
                    "append-to-int", "setitems-odd", "root-int", "root-none", "root-dict-of-strings",
                    "root-list-of-strings", "os-system", "builtins-eval", "long1-255-bytes"):
            # Whole-pickle hostility: the checkpoint's pickle is exactly this.
            bin_bytes = torch_zip(pkl, [("0", f32([0.0] * 4))], prefix="pytorch_model")
        elif name in ("root-list-negative-ids", "root-list-huge-long"):
            continue
        else:
            # Tensor-level hostility: fc.weight is this expression (drop PROTO and STOP), the rest is a valid head.
            expr = pkl[2:-1]
            expr = expr.replace(b"LongStorage", b"FloatStorage")
            bin_bytes = eagle_head_pt(replace={"fc.weight": expr})
            if name == "shape-2pow31-storage-16-bytes":
                # candle allocates the declared shape before reading: f32 [2^31] = 8 GiB from a 16-byte storage
                pass
        draft_folder(f"draft-{name}", bin_bytes)
        CASES.append((f"draft-{name}", draft_gen))
    draft_folder("draft-nested-lists-deflated", torch_zip(nested_lists(1_000_000), prefix="pytorch_model",
                                                          compress=zipfile.ZIP_DEFLATED))
    CASES.append(("draft-nested-lists-deflated", draft_gen))
    draft_folder("draft-not-a-zip", b"\x80\x02]q\x00.")
    CASES.append(("draft-not-a-zip", draft_gen))
    draft_folder("draft-fc-wrong-shape", eagle_head_pt(replace={"fc.weight": rebuild("0", 2 * H * H, [2 * H, H])}))
    CASES.append(("draft-fc-wrong-shape", draft_gen))
    draft_folder("draft-fc-2pow31-dims", eagle_head_pt(replace={"fc.weight": rebuild("0", 2 * H * H, [2**31, 2**31])}))
    CASES.append(("draft-fc-2pow31-dims", draft_gen))
    draft_folder("draft-storage-short", eagle_head_pt(replace={"fc.weight": rebuild("0", 2, [H, 2 * H])}))
    CASES.append(("draft-storage-short", draft_gen))
    draft_folder("draft-storage-missing", eagle_head_pt(drop_storage="0"))
    CASES.append(("draft-storage-missing", draft_gen))
    draft_folder("draft-strided-fc", eagle_head_pt(replace={"fc.weight": rebuild("0", 2 * H * H, [H, 2 * H], stride=[1, H])}))
    CASES.append(("draft-strided-fc", draft_gen))
    draft_folder("draft-config-not-json", eagle_head_pt(), config="{\"hidden_size\": ")
    CASES.append(("draft-config-not-json", draft_gen))
    draft_folder("draft-config-hidden-mismatch", eagle_head_pt(), config=hf_config(layers=1, hidden_size=2**40))
    CASES.append(("draft-config-hidden-mismatch", draft_gen))
    draft_folder("draft-no-checkpoint")
    CASES.append(("draft-no-checkpoint", draft_gen))
    st_head = [(k, "F32", s, f32(values(numel(s)))) for k, s in EAGLE_KEYS]
    draft_folder("draft-st-header-longer-than-file", st_bytes=safetensors_bytes(st_head, header_len_override=1 << 40))
    CASES.append(("draft-st-header-longer-than-file", draft_gen))
    draft_folder("draft-st-offsets-past-end", st_bytes=safetensors_bytes(st_head, header_override=lambda h: dict(
        h, **{"fc.weight": dict(h["fc.weight"], data_offsets=[0, 2**40])})))
    CASES.append(("draft-st-offsets-past-end", draft_gen))
    draft_folder("draft-st-dtype-unknown", st_bytes=safetensors_bytes(st_head, header_override=lambda h: dict(
        h, **{"fc.weight": dict(h["fc.weight"], dtype="Q7")})))
    CASES.append(("draft-st-dtype-unknown", draft_gen))
    draft_folder("draft-st-f8-e4m3", st_bytes=safetensors_bytes(
        [(k, "F8_E4M3", s, bytes(numel(s))) for k, s in EAGLE_KEYS]))
    CASES.append(("draft-st-f8-e4m3", draft_gen))
    draft_folder("draft-st-int-weights", st_bytes=safetensors_bytes(
        [(k, "I32", s, struct.pack(f"<{numel(s)}i", *range(numel(s)))) for k, s in EAGLE_KEYS]))
    CASES.append(("draft-st-int-weights", draft_gen))

    # ---- .npy frequency files ------------------------------------------------------------------------------------
    d16 = struct.pack("<16q", *counts16)
    npys = {
        "bad-magic": b"\x93NUMPX\x01\x00" + npy_i64(counts16)[8:],
        "empty": b"",
        "magic-only": b"\x93NUMPY",
        "huge-shape": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776,), }", d16),
        "shape-product-overflow": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4611686018427387904,), }", d16),
        "shape-2d": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4, 4), }", d16),
        "shape-2d-overflow": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", d16),
        "shape-negative": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (-16,), }", d16),
        "shape-scalar": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (), }", d16[:8]),
        "shape-zero": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (0,), }"),
        "fortran-order": npy("{'descr': '<i8', 'fortran_order': True, 'shape': (16,), }", d16),
        "fortran-order-2d": npy("{'descr': '<i8', 'fortran_order': True, 'shape': (4, 4), }", d16),
        "dtype-complex": npy("{'descr': '<c16', 'fortran_order': False, 'shape': (8,), }", d16),
        "dtype-bool": npy("{'descr': '|b1', 'fortran_order': False, 'shape': (16,), }", bytes(16)),
        "dtype-unicode": npy("{'descr': '<U4', 'fortran_order': False, 'shape': (8,), }", d16),
        "dtype-object": npy("{'descr': '|O', 'fortran_order': False, 'shape': (16,), }", d16),
        "dtype-structured": npy("{'descr': [('a', '<i8')], 'fortran_order': False, 'shape': (16,), }", d16),
        "dtype-big-endian": npy("{'descr': '>i8', 'fortran_order': False, 'shape': (16,), }", struct.pack(">16q", *counts16)),
        "dtype-u8-above-i64": npy("{'descr': '<u8', 'fortran_order': False, 'shape': (2,), }", struct.pack("<2Q", 2**64 - 1, 1)),
        "dtype-f16": npy("{'descr': '<f2', 'fortran_order': False, 'shape': (16,), }", bytes(32)),
        "dtype-int8": npy("{'descr': '|i1', 'fortran_order': False, 'shape': (16,), }", bytes(range(16))),
        "dtype-garbage": npy("{'descr': '<zz99', 'fortran_order': False, 'shape': (16,), }", d16),
        "truncated-data": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (16,), }", d16[:40]),
        "header-len-past-end": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (16,), }", d16, header_len=0xFFFF),
        "v2-header-len-huge": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (16,), }", d16, version=2, header_len=0xFFFFFFF0),
        "header-not-dict": npy("[1, 2, 3]", d16),
        "header-python-garbage": npy("{'descr': '<i8', 'shape': (16,, }", d16),
        "header-missing-keys": npy("{'descr': '<i8'}", d16),
        "header-nested-deep": npy("{'descr': '<i8', 'fortran_order': False, 'shape': " + "(" * 5000 + ")" * 5000 + ", }", d16),
        "float-nan": npy("{'descr': '<f8', 'fortran_order': False, 'shape': (4,), }", struct.pack("<4d", 1.0, float("nan"), 2.0, 3.0)),
        "float-inf": npy("{'descr': '<f8', 'fortran_order': False, 'shape': (4,), }", struct.pack("<4d", 1.0, float("inf"), 2.0, 3.0)),
        "negative-counts": npy_i64([3, -5, 2, 1]),
        "i64-min": npy_i64([3, -2**63, 2, 1]),
    }
    for name, data in npys.items():
        case(f"npy-{name}.npy", freq_show, data)
    # length not the target's vocabulary (16): must be refused at generate/sweep
    case("npy-length-not-vocab.npy", freq_gen, npy_i64(counts16[:10]))
    case("npy-length-above-vocab.npy", freq_gen, npy_i64(counts16 + [5] * 100))

    # ---- frequency safetensors -----------------------------------------------------------------------------------
    def freq_st(tensors, metadata=None, **kw):
        return safetensors_bytes(tensors, metadata, **kw)
    fcases = {
        "2d": [("freq", "I64", [4, 4], d16)],
        "dtype-bool": [("freq", "BOOL", [16], bytes(16))],
        "dtype-f8": [("freq", "F8_E4M3", [16], bytes(16))],
        "dtype-f8-e8m0": [("freq", "F8_E8M0", [16], bytes(16))],
        "dtype-f4": [("freq", "F4", [16], bytes(8))],
        "dtype-unknown": None,
        "nan": [("freq", "F32", [4], f32([1.0, float("nan"), 2.0, 3.0]))],
        "two-unrelated-tensors": [("a", "I64", [2], d16[:16]), ("b", "I64", [2], d16[16:32])],
        "no-tensors": [],
        "ids-counts-length-differ": [("ids", "I64", [3], struct.pack("<3q", 0, 1, 2)), ("counts", "I64", [2], struct.pack("<2q", 5, 1))],
        "ids-negative": [("ids", "I64", [2], struct.pack("<2q", 0, -1)), ("counts", "I64", [2], struct.pack("<2q", 5, 1))],
        "ids-2d": [("ids", "I64", [2, 2], struct.pack("<4q", 0, 1, 2, 3)), ("counts", "I64", [2, 2], struct.pack("<4q", 4, 3, 2, 1))],
        "counts-unsorted": [("ids", "I64", [2], struct.pack("<2q", 0, 1)), ("counts", "I64", [2], struct.pack("<2q", 1, 5))],
        "ids-duplicated": [("ids", "I64", [2], struct.pack("<2q", 3, 3)), ("counts", "I64", [2], struct.pack("<2q", 5, 1))],
        "ids-strings-dtype": [("ids", "U8", [2], b"ab"), ("counts", "I64", [2], struct.pack("<2q", 5, 1))],
    }
    for name, tensors in fcases.items():
        if tensors is None:
            data = freq_st([("freq", "I64", [16], d16)], header_override=lambda h: dict(h, freq=dict(h["freq"], dtype="Q7")))
        else:
            data = freq_st(tensors)
        # frspec's own ids + counts form names no vocabulary unless its metadata does: give it one.
        case(f"fst-{name}.safetensors", freq_show + (" --vocab 16" if name.startswith(("ids", "counts")) else ""), data)
    case("fst-header-longer-than-file.safetensors", freq_show, freq_st([("freq", "I64", [16], d16)], header_len_override=1 << 40))
    case("fst-offsets-past-end.safetensors", freq_show, freq_st([("freq", "I64", [16], d16)],
         header_override=lambda h: dict(h, freq=dict(h["freq"], data_offsets=[0, 2**40]))))
    case("fst-length-not-vocab.safetensors", freq_gen, freq_st([("freq", "I64", [10], d16[:80])]))
    case("fst-vocab-metadata-mismatch.safetensors", freq_gen, freq_st(
        [("ids", "I64", [3], struct.pack("<3q", 5, 3, 9)), ("counts", "I64", [3], struct.pack("<3q", 9, 5, 1))],
        metadata={"vocab": "49152", "format": "frspec-frequencies-v1"}))
    case("fst-ids-out-of-vocab.safetensors", freq_gen, freq_st(
        [("ids", "I64", [3], struct.pack("<3q", 5, 3, 4000000000)), ("counts", "I64", [3], struct.pack("<3q", 9, 5, 1))]))
    case("fst-ids-duplicated-at-generate.safetensors", freq_gen, freq_st(
        [("ids", "I64", [2], struct.pack("<2q", 3, 3)), ("counts", "I64", [2], struct.pack("<2q", 5, 1))], metadata={"vocab": "16"}))
    case("fst-ids-u8-at-generate.safetensors", freq_gen, freq_st(
        [("ids", "U8", [2], bytes([3, 4])), ("counts", "I64", [2], struct.pack("<2q", 5, 1))], metadata={"vocab": "16"}))
    case("freq-unknown-extension.txt", freq_show, "5 3 9\n")
    case("pt-length-not-vocab.pt", freq_gen, torch_zip(PROTO2 + rebuild("0", 10, [10], cls="LongStorage") + STOP,
                                                       [("0", struct.pack("<10q", *counts16[:10]))]))

    # ---- dataset JSONL -------------------------------------------------------------------------------------------
    q = lambda i, t="abc": json.dumps({"question_id": i, "category": "writing", "turns": [t]})
    datasets = {
        "invalid-json-line": q(1) + "\n{\"question_id\": 2, \"turns\": [\n",
        "missing-turns": q(1) + "\n" + json.dumps({"question_id": 2, "category": "x"}) + "\n",
        "turns-not-strings": json.dumps({"question_id": 1, "turns": [1, 2]}) + "\n",
        "turns-empty": json.dumps({"question_id": 1, "turns": []}) + "\n",
        "turns-object": json.dumps({"question_id": 1, "turns": {"a": 1}}) + "\n",
        "repeated-ids": q(1) + "\n" + q(1, "bad") + "\n" + q(2) + "\n",
        "repeated-ids-string-vs-int": q(1) + "\n" + json.dumps({"question_id": "1", "turns": ["bad"]}) + "\n",
        "zero-bytes": "",
        "only-blank-lines": "\n\n   \n",
        "binary-junk": q(1) + "\n" + "\x00\x01\x02\xff\xfe garbage \x9c\n",
        "not-utf8": b"\xff\xfe\xfd\n",
        "root-array": "[1, 2, 3]\n",
        "question-id-object": json.dumps({"question_id": {"a": 1}, "turns": ["abc"]}) + "\n",
        "question-id-float-nan-like": "{\"question_id\": 1e999, \"turns\": [\"abc\"]}\n",
        "deep-nesting": "[" * 30000 + "]" * 30000 + "\n",
        "empty-turn-text": json.dumps({"question_id": 1, "turns": [""]}) + "\n",
    }
    for name, data in datasets.items():
        case(f"jsonl-{name}.jsonl", dataset_sweep, data)
    os.makedirs(path("jsonl-dataset-is-folder"), exist_ok=True)
    CASES.append(("jsonl-dataset-is-folder", dataset_sweep))

    # ---- sweep TOML ----------------------------------------------------------------------------------------------
    tomls = {
        "unknown-key": toml_ok + "ratio_of_everything = 3\n",
        "nan-ratio": toml_ok.replace("ratios = [0.0]", "ratios = [nan]"),
        "inf-temperature": toml_ok.replace("temperatures = [0.0]", "temperatures = [inf]"),
        "nan-top-p": toml_ok + "top_p = nan\n",
        "ratio-above-one": toml_ok.replace("ratios = [0.0]", "ratios = [1.5]"),
        "ratio-negative": toml_ok.replace("ratios = [0.0]", "ratios = [-0.5]"),
        "wrong-types": toml_ok.replace("repeats = 1", "repeats = \"many\""),
        "ratios-not-array": toml_ok.replace("ratios = [0.0]", "ratios = 0.5"),
        "huge-repeats": toml_ok.replace("repeats = 1", "repeats = 4294967295").replace("temperatures = [0.0]", "temperatures = [1.0]"),
        "repeats-overflow": toml_ok.replace("repeats = 1", "repeats = 99999999999999999999"),
        "huge-k": toml_ok + "k = 1000000000000\n",
        "k-zero": toml_ok + "k = 0\n",
        "huge-max-new-tokens": toml_ok.replace("max_new_tokens = 2", "max_new_tokens = 1000000000000000"),
        "huge-num-prompts": toml_ok + "num_prompts = 1000000000000\n",
        "turns-seven": toml_ok.replace("turns = 1", "turns = 7"),
        "huge-batch": toml_ok + "batch = 1000000000\n",
        "many-ratios": toml_ok.replace("ratios = [0.0]", "ratios = [" + ", ".join(f"{i / 5000:.6f}" for i in range(5000)) + "]")
        + "freq = \"" + os.path.join(rel_aux, "freq16.npy") + "\"\n",
        "huge-keeps": toml_ok.replace("ratios = [0.0]", "keeps = [18446744073709551615]") + "freq = \"" + os.path.join(rel_aux, "freq16.npy") + "\"\n",
        "draft-kind-truncated-huge": toml_ok.replace("truncated:1", "truncated:4294967295"),
        "draft-kind-truncated-zero": toml_ok.replace("truncated:1", "truncated:0"),
        "not-toml": "ratios = [0.0\n[[[\n",
        "binary-junk": b"\x00\xff\xfe\x01 = \x02\n",
        "unknown-preset": toml_ok + "preset = \"../../etc\"\n",
        "device-bogus": toml_ok + "device = \"cuda:99999999999999999999\"\n",
        "dtype-bogus": toml_ok + "dtype = \"f7\"\n",
        "deep-nesting": "a = " + "[" * 30000 + "]" * 30000 + "\n",
        "temperature-negative": toml_ok.replace("temperatures = [0.0]", "temperatures = [-1.0]"),
        "top-p-zero": toml_ok + "top_p = 0.0\n",
    }
    for name, data in tomls.items():
        case(f"toml-{name}.toml", "sweep --config {} --out {tmp}/out --quiet", data)

    # ---- --speculative-config JSON (the case file's text is the argument) ----------------------------------------
    specs = {
        "invalid-json": "{\"method\": \"eagle\",",
        "root-array": "[1, 2]",
        "root-string": "\"eagle\"",
        "method-number": "{\"method\": 3}",
        "method-unknown": "{\"method\": \"medusa\"}",
        "k-negative": "{\"num_speculative_tokens\": -1}",
        "k-float": "{\"num_speculative_tokens\": 2.5}",
        "k-huge": "{\"num_speculative_tokens\": 18446744073709551615}",
        "k-zero": "{\"num_speculative_tokens\": 0}",
        "ratio-string-nan": "{\"pruning_ratio\": \"NaN\"}",
        "ratio-bare-nan": "{\"pruning_ratio\": NaN}",
        "ratio-overflow-1e999": "{\"pruning_ratio\": 1e999}",
        "ratio-negative": "{\"pruning_ratio\": -0.5}",
        "ratio-one": "{\"pruning_ratio\": 1.0}",
        "freq-not-string": "{\"token_ids_by_frequency\": [1, 2]}",
        "freq-missing-file": "{\"token_ids_by_frequency\": \"/nonexistent/freq.pt\"}",
        "deep-nesting": "{\"a\": " + "[" * 10000 + "]" * 10000 + "}",
        "empty": "",
    }
    for name, data in specs.items():
        # token_ids_by_frequency is only read when no --freq flag overrides it
        case(f"spec-{name}.json", spec_sweep.replace(" --freq {aux}/freq16.npy", "") if name.startswith("freq") else spec_sweep, data)

    # ---- sweep output folders: report / check / plot / sweep --resume --------------------------------------------
    # A real sweep's tables (the smollm2 sweep under results/sweeps), each damaged in turn.
    base = os.path.join(ROOT, "results", "sweeps", sorted(os.listdir(os.path.join(ROOT, "results", "sweeps")))[0])
    real = {}
    for fn in ("manifest.json", "summary.parquet", "timing_summary.parquet"):
        with open(os.path.join(base, fn), "rb") as f:
            real[fn] = f.read()
    manifest, summary = real["manifest.json"], real["summary.parquet"]

    def sweep_out(name, files):
        files = dict(files)
        if "manifest.json" in files or "summary.parquet" in files:
            files.setdefault("timing_summary.parquet", real["timing_summary.parquet"])
        for rel, data in files.items():
            if data is None:
                os.makedirs(path(f"{name}/{rel}"), exist_ok=True)
            else:
                write(f"{name}/{rel}", data)

    folders = {
        "out-manifest-not-json": {"manifest.json": "{\"frspec\": ", "summary.parquet": summary},
        "out-manifest-wrong-types": {"manifest.json": json.dumps({"frspec": 1, "settings": [1, 2], "files": "x"}), "summary.parquet": summary},
        "out-manifest-missing": {"summary.parquet": summary},
        "out-parquet-junk": {"manifest.json": manifest, "summary.parquet": b"\x00junk" * 100},
        "out-parquet-empty": {"manifest.json": manifest, "summary.parquet": b""},
        "out-parquet-truncated": {"manifest.json": manifest, "summary.parquet": summary[:len(summary) // 2]},
        "out-parquet-magic-only": {"manifest.json": manifest, "summary.parquet": b"PAR1" + b"\0" * 8 + b"PAR1"},
        "out-parquet-footer-len-huge": {"manifest.json": manifest, "summary.parquet": b"PAR1" + b"\0" * 16 + struct.pack("<I", 0xFFFFFFF0) + b"PAR1"},
        "out-parquet-footer-damaged": {"manifest.json": manifest,
                                       "summary.parquet": summary[:-200] + bytes(b ^ 0x5A for b in summary[-200:-8]) + summary[-8:]},
        "out-parquet-is-folder": {"manifest.json": manifest, "summary.parquet": None},
        "out-empty-folder": {".keep": ""},
        "out-timing-parquet-junk": {"manifest.json": manifest, "summary.parquet": summary, "timing_summary.parquet": b"PAR1junkPAR1"},
        "out-manifest-settings-nan": {"manifest.json": manifest.replace(b'"top_p": 1.0', b'"top_p": NaN'), "summary.parquet": summary},
        "out-summary-is-baseline-manifest": {"manifest.json": manifest, "summary.parquet": manifest},
    }
    sweep_out("_aux/out-valid", {"manifest.json": manifest, "summary.parquet": summary})
    OK.extend([("_aux/out-valid", "report {}"), ("_aux/out-valid", "plot {}"),
               ("_aux/out-valid", "check --baseline {} --current {aux}/out-valid")])
    for name, files in folders.items():
        sweep_out(name, files)
        CASES.append((name, "report {}"))
        CASES.append((name, "plot {}"))
        CASES.append((name, "check --baseline {} --current {aux}/out-valid"))
        CASES.append((name, "check --baseline {aux}/out-valid --current {}"))

    # --resume over a journal: identity of the sweep `resume_args` runs (tiny target, truncated:1, the aux dataset)
    resume_args = ("sweep --model {aux}/tiny-target --draft-kind truncated:1 --ratios 0 --temperatures 0 --repeats 1 "
                   "--max-new-tokens 2 --turns 1 --num-prompts 2 --dataset {aux}/questions.jsonl --quiet --resume --out {}")
    identity = {
        "settings": {"activations": "q8", "categories": [], "dataset": "{aux}/questions.jsonl", "device": "cpu", "draft": None,
                     "draft_kind": "truncated:1", "draft_mode": "argmax", "dtype": "f32", "freq": None, "k": 4,
                     "max_new_tokens": 2, "model": "{aux}/tiny-target", "num_prompts": 2, "preset": None,
                     "pruning": {"ratios": [0.0]}, "repeats": 1, "seed": 0, "temperatures": [0.0], "top_p": 1.0, "turns": 1},
        "files": {"dataset": {"path": "x", "sha256": sha256_file(os.path.join(AUX, "questions.jsonl"))},
                  "model": {"path": "x", "sha256": sha256_folder(os.path.join(AUX, "tiny-target"))}},
    }
    id_text = json.dumps(identity, indent=2).replace("{aux}", rel_aux)
    unit0 = {"key": {"temperature": 0, "prompt": 0, "repeat": None}, "secs": 0.01, "runs": [
        {"ratio": 0.0, "temperature": 0.0, "repeat": 0, "prompt_index": 0, "prompt": "1", "turn": 0,
         "record": {"prompt_tokens": 5, "generated": 2, "drafts": 1, "draft_tokens": 4, "accepted": 1,
                    "accepted_per_pos": [1, 0, 0, 0], "expected_accepted": 1.0, "stop": "max_tokens",
                    "draft_secs": 0.001, "target_secs": 0.001}}]}
    resumes = {
        "resume-identity-not-json": ({"units/sweep.json": "{\"settings\": "}, False),
        "resume-identity-wrong-types": ({"units/sweep.json": json.dumps({"settings": 5, "files": [1]})}, False),
        "resume-identity-empty": ({"units/sweep.json": ""}, False),
        "resume-identity-is-folder": ({"units/sweep.json": None}, False),
        "resume-units-is-file": ({"units": "junk"}, False),
        "resume-other-sweep": ({"units/sweep.json": id_text.replace("\"repeats\": 1", "\"repeats\": 2")}, False),
        # Damaged entries of the right sweep: the right answer is to redo them and say which (exit 0).
        "resume-unit-not-json": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": "{\"key\": "}, True),
        "resume-unit-wrong-key": ({"units/sweep.json": id_text,
                                   "units/t0-p1-rall.json": json.dumps(unit0)}, True),
        "resume-unit-binary-junk": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": b"\x00\xff" * 50}, True),
        "resume-unit-huge-numbers": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": json.dumps(unit0).replace(
            "\"accepted\": 1", "\"accepted\": 1e300")}, True),
        "resume-unit-negative-counts": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": json.dumps(unit0).replace(
            "\"generated\": 2", "\"generated\": -2")}, True),
        "resume-unit-more-accepted-than-drafted": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": json.dumps(unit0).replace(
            "\"accepted\": 1,", "\"accepted\": 99,")}, True),
        "resume-unit-is-folder": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": None}, False),
        "resume-stray-entry": ({"units/sweep.json": id_text, "units/t9-p9-rall.json": "junk"}, True),
        "resume-valid-journal": ({"units/sweep.json": id_text, "units/t0-p0-rall.json": json.dumps(unit0)}, True),
    }
    for name, (files, ok) in resumes.items():
        sweep_out(name, files)
        (OK if ok else CASES).append((name, resume_args))

    # Inputs that look odd but are valid, so the right answer is to read them (kept as checks that they still are):
    # a Fortran-contiguous (column-major) EAGLE weight, a 1-D Fortran-order .npy, a big-endian .npy; `check`
    # reads no timing table. Also odd inputs that are not wrong, so frspec may accept them: a context length far
    # beyond any run (a run uses only the positions it reaches), a BOS id outside the vocabulary (score feeds the
    # token ids it is given), a question id that is an object, an empty turn, 5000 ratios.
    legit = {"draft-strided-fc", "npy-fortran-order.npy", "npy-dtype-big-endian.npy", "cfg-huge-context",
             "gguf-huge-context-length.gguf", "gguf-bos-id-out-of-range.gguf", "jsonl-question-id-object.jsonl",
             "jsonl-empty-turn-text.jsonl", "toml-many-ratios.toml"}
    for row in list(CASES):
        if row[0] in legit or (row[0] == "out-timing-parquet-junk" and row[1].startswith("check")):
            CASES.remove(row)
            OK.append(row)

    # Some cases are a folder where a file belongs, empty: git keeps no empty folder, so each gets a `.keep` file
    # (it is still a folder, which is what those cases are about).
    for dirpath, dirs, files in os.walk(OUT):
        if not dirs and not files:
            open(os.path.join(dirpath, ".keep"), "w").close()

    # ---- write the tables ------------------------------------------------------------------------------------------
    header = ("# Generated by scripts/make_hostile.py: edit it and rerun, not this file.\n"
              "# NAME<TAB>frspec arguments. {} = the case's path (copied into a fresh temporary folder first), "
              "{text} = the case file's contents, {tmp} = a fresh empty folder, {aux} = this folder's _aux.\n")
    with open(path("cases.tsv"), "w") as f:
        f.write(header + "# Each must exit 1 (check: 2, its code for unusable input) with one line on stderr.\n")
        for name, args in CASES:
            f.write(f"{name}\t{args}\n")
    with open(path("expect-ok.tsv"), "w") as f:
        f.write(header + "# Each must exit 0: controls (benign inputs on the same command lines) and inputs the right "
                "answer to which is to cope.\n")
        for name, args in OK:
            f.write(f"{name}\t{args}\n")
    big = []
    for dirpath, _, files in os.walk(OUT):
        for fn in files:
            p = os.path.join(dirpath, fn)
            if os.path.getsize(p) >= 64 * 1024:
                big.append((os.path.relpath(p, OUT), os.path.getsize(p)))
    print(f"{len(CASES)} hostile cases, {len(OK)} must-succeed runs in {os.path.relpath(OUT, ROOT)}")
    if big:
        print("files of 64 KiB or more:", big)


def _zip_only(entries):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries:
            z.writestr(zipfile.ZipInfo(name, ZIP_TIME), data)
    return buf.getvalue()


def _lie_about_size(zbytes):
    """Set data.pkl's uncompressed size to 0xFFFFFFF0 in its local header and central directory entry."""
    b = bytearray(zbytes)
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        i = b.find(sig)
        struct.pack_into("<I", b, i + size_at, 0xFFFFFFF0)
    return bytes(b)


def sha256_file(p):
    with open(p, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def sha256_folder(d):
    """frspec's folder digest: sha256 over `name digest\\n` of each file, sorted by path; sub-folders skipped."""
    h = hashlib.sha256()
    for fn in sorted(os.listdir(d)):
        p = os.path.join(d, fn)
        if os.path.isfile(p):
            h.update(f"{fn} {sha256_file(p)}\n".encode())
    return h.hexdigest()


if __name__ == "__main__":
    main()
