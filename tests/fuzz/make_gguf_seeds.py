#!/usr/bin/env python3
"""make_gguf_seeds.py -- writes the GGUF harness's seeds
(tests/fuzz/corpus/gguf/): a micro deepseek2 model (one layer each of a
dense and a MoE block, small tensors in F32, F16, BF16, Q8_0 and Q4_K,
split attn_k_b/attn_v_b, expert bias, an 8-token byte-level vocabulary with
merges, a chat template) and a vocab-only file.  GGUF is written by hand
here (struct), so the seeds do not depend on the library they test.
Run from the repository root."""
import os
import struct

OUT = "tests/fuzz/corpus/gguf"
U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9


def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, t, v):
    out = s(key) + struct.pack("<I", t)
    if t == U32:
        out += struct.pack("<I", v)
    elif t == F32:
        out += struct.pack("<f", v)
    elif t == BOOL:
        out += struct.pack("<B", v)
    elif t == STR:
        out += s(v)
    elif t == ARR:
        et, items = v
        out += struct.pack("<IQ", et, len(items))
        for it in items:
            out += s(it) if et == STR else struct.pack("<i", it)
    return out


def f16(x):
    return struct.pack("<e", x)


def tensor_bytes(kind, rows, cols, seed):
    vals = [((i * 37 + seed * 11) % 17 - 8) / 64.0 for i in range(rows * cols)]
    if kind == 0:  # F32
        return b"".join(struct.pack("<f", v) for v in vals)
    if kind == 1:  # F16
        return b"".join(f16(v) for v in vals)
    if kind == 30:  # BF16
        return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in vals)
    if kind == 8:  # Q8_0
        out = b""
        for r in range(rows * cols // 32):
            out += f16(1 / 64.0) + bytes(((i * 7 + r) % 17 - 8) & 0xFF for i in range(32))
        return out
    if kind == 12:  # Q4_K: d, dmin, 12 scale bytes, 128 nibble bytes
        out = b""
        for r in range(rows * cols // 256):
            out += f16(1 / 256.0) + f16(1 / 512.0) + bytes((i * 5 + r) % 64 for i in range(12))
            out += bytes((i * 29 + r) % 256 for i in range(128))
        return out
    raise ValueError(kind)


def model(vocab_only=False):
    D, F, H, NOPE, ROPE, V_HEAD, KVL, E = 32, 256, 2, 32, 16, 32, 32, 4
    toks = ["a", "b", "c", "Ġ", "Ċ", "ab", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    types = [1, 1, 1, 1, 1, 1, 3, 3]
    meta = [
        kv("general.architecture", STR, "deepseek2"),
        kv("tokenizer.ggml.model", STR, "gpt2"),
        kv("tokenizer.ggml.pre", STR, "deepseek-v3"),
        kv("tokenizer.ggml.tokens", ARR, (STR, toks)),
        kv("tokenizer.ggml.token_type", ARR, (I32, types)),
        kv("tokenizer.ggml.merges", ARR, (STR, ["a b"])),
        kv("tokenizer.ggml.bos_token_id", U32, 6),
        kv("tokenizer.ggml.eos_token_id", U32, 7),
        kv("tokenizer.chat_template", STR, "{{bos_token}}{% for m in messages %}<｜User｜>{{m['content']}}{% endfor %}"),
    ]
    tensors = []
    if not vocab_only:
        p = "deepseek2."
        meta += [kv(p + "block_count", U32, 2), kv(p + "embedding_length", U32, D), kv(p + "feed_forward_length", U32, F),
                 kv(p + "attention.head_count", U32, H), kv(p + "attention.kv_lora_rank", U32, KVL),
                 kv(p + "attention.key_length_mla", U32, NOPE + ROPE), kv(p + "attention.value_length_mla", U32, V_HEAD),
                 kv(p + "rope.dimension_count", U32, ROPE), kv(p + "leading_dense_block_count", U32, 1),
                 kv(p + "expert_count", U32, E), kv(p + "expert_used_count", U32, 2), kv(p + "expert_shared_count", U32, 1),
                 kv(p + "expert_feed_forward_length", U32, 32), kv(p + "expert_gating_func", U32, 2),
                 kv(p + "expert_weights_norm", BOOL, 1), kv(p + "expert_weights_scale", F32, 2.5),
                 kv(p + "attention.layer_norm_rms_epsilon", F32, 1e-6), kv(p + "vocab_size", U32, len(toks)),
                 kv(p + "rope.scaling.type", STR, "yarn"), kv(p + "rope.scaling.factor", F32, 4.0),
                 kv(p + "rope.scaling.original_context_length", U32, 64), kv(p + "rope.scaling.yarn_log_multiplier", F32, 0.1)]
        FE = 32
        tensors += [("token_embd.weight", 8, [D, len(toks)]), ("output_norm.weight", 0, [D])]
        for l in range(2):
            b = f"blk.{l}."
            tensors += [(b + "attn_norm.weight", 0, [D]), (b + "attn_q.weight", 30, [D, H * (NOPE + ROPE)]),
                        (b + "attn_kv_a_mqa.weight", 1, [D, KVL + ROPE]), (b + "attn_kv_a_norm.weight", 0, [KVL]),
                        (b + "attn_k_b.weight", 8, [NOPE, KVL, H]), (b + "attn_v_b.weight", 0, [KVL, V_HEAD, H]),
                        (b + "attn_output.weight", 8, [H * V_HEAD, D]), (b + "ffn_norm.weight", 0, [D])]
            if l == 0:
                tensors += [(b + "ffn_gate.weight", 0, [D, F]), (b + "ffn_up.weight", 1, [D, F]), (b + "ffn_down.weight", 12, [F, D])]   # F = 256: whole Q4_K blocks
            else:
                tensors += [(b + "ffn_gate_inp.weight", 0, [D, E]), (b + "exp_probs_b.bias", 0, [E]),
                            (b + "ffn_gate_exps.weight", 8, [D, FE, E]), (b + "ffn_up_exps.weight", 8, [D, FE, E]),
                            (b + "ffn_down_exps.weight", 8, [FE, D, E]), (b + "ffn_gate_shexp.weight", 0, [D, FE]),
                            (b + "ffn_up_shexp.weight", 0, [D, FE]), (b + "ffn_down_shexp.weight", 8, [FE, D])]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta)
    infos, blobs, off = b"", [], 0
    for i, (name, kind, ne) in enumerate(tensors):
        cols, rows = ne[0], 1
        for d in ne[1:]:
            rows *= d
        data = tensor_bytes(kind, rows, cols, i)
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", kind, off)
        pad = (32 - len(data) % 32) % 32
        blobs.append(data + b"\0" * pad)
        off += len(data) + pad
    out = head + infos
    out += b"\0" * ((32 - len(out) % 32) % 32)
    return out + b"".join(blobs)


os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "micro-model.gguf"), "wb") as f:
    f.write(model())
with open(os.path.join(OUT, "vocab-only.gguf"), "wb") as f:
    f.write(model(vocab_only=True))
