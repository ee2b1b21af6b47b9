#!/usr/bin/env python3
"""hf2gguf.py -- a DeepSeek-V2/V3 checkpoint (config.json, safetensors,
tokenizer.json) as a GGUF of llama.cpp's `deepseek2` architecture, for
`make bench` to run llama.cpp on the same weights as cm384.

    python3 tests/peer/hf2gguf.py MODEL_DIR OUT.gguf      (bf16 or f32 weights as stored)
    PEER_DIR/bin/llama-quantize OUT.gguf OUT-q8_0.gguf Q8_0

It writes what llama.cpp's own convert_hf_to_gguf.py writes for these models
(its metadata keys; tensor names from gguf-py's map; routed experts stacked;
kv_b_proj split into attn_k_b, transposed, and attn_v_b; MTP layers left
out; 1-D tensors in f32) without needing torch or transformers, which this
machine's package registries do not carry.  Needs numpy and gguf-py (from
the peer's source: PYTHONPATH=PEER_DIR/llama.cpp/gguf-py; tests/peer/gguf.sh
sets it).  Not a general converter: only what the bench models use.
"""
import json
import os
import re
import struct
import sys

import numpy as np
import gguf


def load_safetensors(model_dir):
    """name -> (dtype string, shape, memmapped uint8 view of its bytes)"""
    out = {}
    for fn in sorted(os.listdir(model_dir)):
        if not fn.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, fn)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        base = 8 + n
        for name, t in header.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            out[name] = (t["dtype"], t["shape"], mm[base + a:base + b])
    return out


def as_array(entry):
    """(numpy array, gguf raw dtype or None): bf16 stays 16-bit"""
    dtype, shape, raw = entry
    if dtype == "BF16":
        return raw.view(np.uint16).reshape(shape), gguf.GGMLQuantizationType.BF16
    if dtype == "F16":
        return raw.view(np.float16).reshape(shape), None
    if dtype == "F32":
        return raw.view(np.float32).reshape(shape), None
    sys.exit(f"hf2gguf: tensor dtype {dtype} is not handled")


def to_f32(arr, raw):
    if raw == gguf.GGMLQuantizationType.BF16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: hf2gguf.py MODEL_DIR OUT.gguf")
    model_dir, out_path = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    n_layer = cfg["num_hidden_layers"]
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    tmap = gguf.get_tensor_name_map(arch, n_layer)

    # ---- hyperparameters, as convert_hf_to_gguf.py's DeepseekV2Model ----
    kv_lora = cfg.get("kv_lora_rank", 512)
    w.add_block_count(n_layer)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)                      # MLA as MQA over the latent
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    sf = cfg.get("scoring_func", "softmax")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sf == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    w.add_vocab_size(cfg["vocab_size"])
    # written even when 0 (no q_lora, V2-Lite): llama.cpp takes a model
    # without the key for V2-Lite only at 26 or 27 layers, and with it at 0
    # loads the plain q projection at any depth (the 4-layer cut)
    w.add_q_lora_rank(cfg.get("q_lora_rank") or 0)
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + cfg["qk_rope_head_dim"])
    w.add_value_length(kv_lora)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    rs = cfg.get("rope_scaling")
    if rs and rs.get("type", rs.get("rope_type")) == "yarn" and rs.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        if rs.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])

    # ---- tokenizer: byte-level BPE from tokenizer.json ----
    tj = json.load(open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8"))
    vocab = dict(tj["model"]["vocab"])
    special = set()
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    rev = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i in rev:
            tokens.append(rev[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(cfg["eos_token_id"])

    # ---- tensors ----
    st = load_safetensors(model_dir)
    wrote_bf16 = False

    def put(hf_name, arr, raw):
        nonlocal wrote_bf16
        if hf_name.endswith("e_score_correction_bias"):   # the converter's renaming
            hf_name = hf_name[:-len("_bias")] + ".bias"
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            sys.exit(f"hf2gguf: no GGUF name for {hf_name}")
        if arr.ndim <= 1:                       # norms, biases: f32 as the converter writes them
            arr, raw = to_f32(arr, raw), None
        arr = np.ascontiguousarray(arr)
        if raw is not None:
            wrote_bf16 = True
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=raw)
        else:
            w.add_tensor(name, arr)

    n_exp, stacked = cfg["n_routed_experts"], set()
    H, nope, vdim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name in sorted(st):
        m = re.match(r"model\.layers\.(\d+)\.", name)
        bid = int(m.group(1)) if m else None
        if bid is not None and bid >= n_layer:
            continue                            # MTP layers: llama.cpp leaves them out
        if ".mlp.experts." in name:
            if bid in stacked:
                continue                        # stacked when the layer's first expert came by
            stacked.add(bid)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                parts = [as_array(st[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"]) for x in range(n_exp)]
                put(f"model.layers.{bid}.mlp.experts.{proj}.weight", np.stack([p[0] for p in parts]), parts[0][1])
            continue
        arr, raw = as_array(st[name])
        if name.endswith("kv_b_proj.weight"):
            kv = arr.reshape(H, nope + vdim, arr.shape[-1])
            put(name.replace("kv_b_proj", "k_b_proj"), kv[:, :nope, :].transpose(0, 2, 1), raw)
            put(name.replace("kv_b_proj", "v_b_proj"), kv[:, nope:, :], raw)
            continue
        put(name, arr, raw)

    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if wrote_bf16 else gguf.LlamaFileType.ALL_F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
