#!/usr/bin/env python3
"""check_gen.py -- verify a DeepSeek-V2/V3 Hugging Face model directory.

Written for the output of gen_synth, but it checks any directory in the same
layout (for example the tiny-dsv3 fixture).  Python 3 standard library only.

    python3 models/gen/check_gen.py DIR [--no-values] [--full-copies] [-v]

Checks:
  * config.json: the fields a DeepSeek-V2/V3 loader needs are present;
  * files: model.safetensors.index.json (or a lone model.safetensors), every
    shard it names exists, no stray or *.partial shard files;
  * every shard: 8-byte header length, JSON header (padded to 8), dtype and
    shape of each tensor, data_offsets inside the data area, byte count ==
    dtype size * prod(shape), tensors back to back with no hole, no overlap
    and no trailing bytes;
  * the index: weight_map names exactly the tensors found, each in the shard
    that holds it; metadata.total_size == the sum of tensor bytes;
  * names, shapes and dtypes == what config.json implies (MLA with or without
    q_lora, dense and MoE layers, e_score_correction_bias for noaux_tc, shared
    experts, the MTP layers, fp8 weights with 128x128 F32 _scale_inv blocks);
  * values (unless --no-values), from a sample of each tensor: finite, and the
    mean / std gen_synth promises (embeddings N(0,1), projections
    N(0,1)/sqrt(fan_in) with lm_head gain 2, norms 1+0.1 N(0,1),
    e_score_correction_bias N(0,0.1)); fp8 blocks of the first 128 rows hit
    +-448 and their scales are positive; the MTP copies of the embedding and
    head are byte-identical to the originals (sampled, or whole with
    --full-copies).
Prints the parameter counts; exits 1 if anything failed.
"""
import argparse
import hashlib
import json
import math
import os
import re
import struct
import sys

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F64": 8, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E5M2": 1}

# float8 e4m3fn code -> value (0x7f / 0xff are NaN)
def _e4m3(code):
    s = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 7
    if e == 15 and m == 7:
        return float("nan")
    if e == 0:
        return s * m / 8.0 * 2.0 ** -6
    return s * (1 + m / 8.0) * 2.0 ** (e - 7)

E4M3 = [_e4m3(c) for c in range(256)]


class Report:
    def __init__(self, verbose):
        self.fails = []
        self.warns = []
        self.verbose = verbose

    def fail(self, msg):
        self.fails.append(msg)
        if len(self.fails) <= 50:
            print("FAIL  " + msg)

    def warn(self, msg):
        self.warns.append(msg)
        print("warn  " + msg)

    def ok(self, msg):
        print("ok    " + msg)


def human(n):
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return "%.2f%s" % (n / div, unit)
    return str(int(n))


# --------------------------------------------------------------------------
# what the config implies
# --------------------------------------------------------------------------

def expected_tensors(cfg, fp8):
    """name -> (dtype, shape, kind, gain, fan_in) in DeepSeek's HF naming."""
    h = cfg["hidden_size"]
    V = cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qlr = cfg.get("q_lora_rank")
    kvr = cfg["kv_lora_rank"]
    E = cfg.get("n_routed_experts") or 0
    ns = cfg.get("n_shared_experts") or 0
    mi = cfg.get("moe_intermediate_size") or 0
    I = cfg.get("intermediate_size") or 0
    nl = cfg["num_hidden_layers"]
    nextn = cfg.get("num_nextn_predict_layers") or 0
    fk = cfg.get("first_k_dense_replace") or 0
    freq = cfg.get("moe_layer_freq") or 1
    bias = cfg.get("topk_method") == "noaux_tc"
    tie = bool(cfg.get("tie_word_embeddings"))
    out = {}

    def proj(name, rows, cols, gain=1.0, quant=True, kind="proj"):
        if fp8 and quant:
            out[name] = ("F8_E4M3", [rows, cols], kind, gain, cols)
            out[name + "_scale_inv"] = ("F32", [-(-rows // 128), -(-cols // 128)], "scale", 0, 0)
        else:
            out[name] = ("BF16", [rows, cols], kind, gain, cols)

    def norm(name, n):
        out[name] = ("BF16", [n], "norm", 0, 0)

    def is_moe(L):
        return E > 0 and L >= fk and L % freq == 0

    def layer(L, mtp):
        p = "model.layers.%d." % L
        if mtp:
            out[p + "embed_tokens.weight"] = ("BF16", [V, h], "embed", 1.0, h)
            norm(p + "enorm.weight", h)
            norm(p + "hnorm.weight", h)
            proj(p + "eh_proj.weight", h, 2 * h, quant=False)
        norm(p + "input_layernorm.weight", h)
        if qlr:
            proj(p + "self_attn.q_a_proj.weight", qlr, h)
            norm(p + "self_attn.q_a_layernorm.weight", qlr)
            proj(p + "self_attn.q_b_proj.weight", H * (nope + rope), qlr)
        else:
            proj(p + "self_attn.q_proj.weight", H * (nope + rope), h)
        proj(p + "self_attn.kv_a_proj_with_mqa.weight", kvr + rope, h)
        norm(p + "self_attn.kv_a_layernorm.weight", kvr)
        proj(p + "self_attn.kv_b_proj.weight", H * (nope + vd), kvr)
        proj(p + "self_attn.o_proj.weight", h, H * vd)
        norm(p + "post_attention_layernorm.weight", h)
        if is_moe(L):
            proj(p + "mlp.gate.weight", E, h, quant=False)
            if bias:
                out[p + "mlp.gate.e_score_correction_bias"] = ("F32", [E], "bias", 0, 0)
            for e in range(E):
                q = p + "mlp.experts.%d." % e
                proj(q + "gate_proj.weight", mi, h, kind="expert")
                proj(q + "up_proj.weight", mi, h, kind="expert")
                proj(q + "down_proj.weight", h, mi, kind="expert")
            if ns:
                proj(p + "mlp.shared_experts.gate_proj.weight", mi * ns, h)
                proj(p + "mlp.shared_experts.up_proj.weight", mi * ns, h)
                proj(p + "mlp.shared_experts.down_proj.weight", h, mi * ns)
        else:
            proj(p + "mlp.gate_proj.weight", I, h)
            proj(p + "mlp.up_proj.weight", I, h)
            proj(p + "mlp.down_proj.weight", h, I)
        if mtp:
            norm(p + "shared_head.norm.weight", h)
            if tie:
                out[p + "shared_head.head.weight"] = ("BF16", [V, h], "embed", 1.0, h)
            else:
                out[p + "shared_head.head.weight"] = ("BF16", [V, h], "proj", 2.0, h)

    out["model.embed_tokens.weight"] = ("BF16", [V, h], "embed", 1.0, h)
    for L in range(nl):
        layer(L, False)
    norm("model.norm.weight", h)
    if not tie:
        proj("lm_head.weight", V, h, gain=2.0, quant=False)
    for k in range(nextn):
        layer(nl + k, True)
    return out


def layer_of(name):
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------
# safetensors reading
# --------------------------------------------------------------------------

def read_header(path, rep):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            rep.fail("%s: shorter than 8 bytes" % path)
            return None, 0, 0
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8 or n > 100 << 20:
            rep.fail("%s: header length %d does not fit the file (%d bytes)" % (path, n, size))
            return None, 0, 0
        text = f.read(n)
    try:
        hdr = json.loads(text.decode("utf-8"))
    except Exception as e:  # noqa: BLE001
        rep.fail("%s: header is not JSON: %s" % (path, e))
        return None, 0, 0
    if n % 8:
        rep.warn("%s: header length %d is not a multiple of 8" % (os.path.basename(path), n))
    return hdr, 8 + n, size - 8 - n


def sample_values(path, base, t, count):
    """up to `count` decoded values from the start of tensor t."""
    dt = t["dtype"]
    b0, b1 = t["data_offsets"]
    esz = DTYPE_SIZE[dt]
    n = min(count, (b1 - b0) // esz)
    with open(path, "rb") as f:
        f.seek(base + b0)
        raw = f.read(n * esz)
    if dt == "BF16":
        u = struct.unpack("<%dH" % n, raw)
        return list(struct.unpack("<%df" % n, struct.pack("<%dI" % n, *[x << 16 for x in u])))
    if dt == "F32":
        return list(struct.unpack("<%df" % n, raw))
    if dt == "F8_E4M3":
        return [E4M3[c] for c in raw]
    return []


def stats(xs):
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / n
    return m, math.sqrt(var)


def file_digest(path, base, t, limit=None):
    b0, b1 = t["data_offsets"]
    n = b1 - b0 if limit is None else min(limit, b1 - b0)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(base + b0)
        left = n
        while left:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--no-values", action="store_true", help="skip the value checks")
    ap.add_argument("--samples", type=int, default=4096, help="values sampled per tensor (default 4096)")
    ap.add_argument("--full-copies", action="store_true", help="compare MTP copies in full, not sampled")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    rep = Report(a.verbose)
    d = a.dir

    # ---- config
    try:
        cfg = json.load(open(os.path.join(d, "config.json")))
    except Exception as e:  # noqa: BLE001
        print("FAIL  cannot read %s/config.json: %s" % (d, e))
        return 1
    need = ["model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
            "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob",
            "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq", "rope_theta",
            "rope_scaling", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "hidden_act", "torch_dtype"]
    missing = [k for k in need if k not in cfg]
    if missing:
        rep.fail("config.json lacks %s" % ", ".join(missing))
    if cfg.get("model_type") == "deepseek_v3" and "num_nextn_predict_layers" not in cfg:
        rep.fail("config.json (deepseek_v3) lacks num_nextn_predict_layers")
    arch = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
    if cfg.get("architectures") != [arch.get(cfg.get("model_type"), "?")]:
        rep.fail("architectures %s do not match model_type %s" % (cfg.get("architectures"), cfg.get("model_type")))
    rs = cfg.get("rope_scaling")
    if rs is not None:
        for k in ("type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim"):
            if k not in rs and not (k == "type" and "rope_type" in rs):
                rep.fail("rope_scaling lacks %s" % k)
    qc = cfg.get("quantization_config")
    fp8 = bool(qc) and qc.get("quant_method") == "fp8"
    if fp8 and (qc.get("fmt") != "e4m3" or qc.get("weight_block_size") != [128, 128]
                or qc.get("activation_scheme") != "dynamic"):
        rep.fail("quantization_config %s is not DeepSeek's fp8 e4m3 [128,128] dynamic" % qc)
    if missing:
        return 1
    rep.ok("config.json: %s, %d layers + %d MTP, %s" % (
        cfg["model_type"], cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0,
        "fp8" if fp8 else "bf16"))

    # ---- files
    files = sorted(os.listdir(d))
    idx_path = os.path.join(d, "model.safetensors.index.json")
    index = None
    if os.path.exists(idx_path):
        index = json.load(open(idx_path))
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not isinstance(index.get("metadata", {}).get("total_size"), int):
            rep.fail("index lacks weight_map or metadata.total_size")
            return 1
        shards = sorted(set(wm.values()))
    elif "model.safetensors" in files:
        shards = ["model.safetensors"]
    else:
        rep.fail("neither model.safetensors.index.json nor model.safetensors in %s" % d)
        return 1
    for s in shards:
        if s not in files:
            rep.fail("index names %s, which is missing" % s)
    m = [re.match(r"model-(\d{5})-of-(\d{5})\.safetensors$", s) for s in shards]
    if index is not None and all(m):
        total = {int(x.group(2)) for x in m}
        nums = sorted(int(x.group(1)) for x in m)
        if len(total) != 1 or nums != list(range(1, total.pop() + 1)):
            rep.fail("shard names are not model-0000k-of-0000N for k = 1..N: %s" % shards)
    stray = [f for f in files if (f.endswith(".safetensors") and f not in shards) or f.endswith(".partial")]
    if stray:
        rep.fail("stray files not in the index: %s" % stray)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if f not in files:
            rep.warn("no %s" % f)

    # ---- shards
    found = {}   # name -> (shard, header entry, data base)
    total_bytes = 0
    for s in shards:
        path = os.path.join(d, s)
        if not os.path.exists(path):
            continue
        hdr, base, dlen = read_header(path, rep)
        if hdr is None:
            continue
        meta = hdr.pop("__metadata__", None)
        if meta is not None and meta.get("format") != "pt":
            rep.warn("%s: __metadata__.format is %s, not pt" % (s, meta.get("format")))
        spans = []
        for name, t in hdr.items():
            dt, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
            if dt not in DTYPE_SIZE or not isinstance(shape, list) or not isinstance(offs, list) or len(offs) != 2:
                rep.fail("%s: %s: bad entry %s" % (s, name, t))
                continue
            n = 1
            for x in shape:
                n *= x
            b0, b1 = offs
            if not 0 <= b0 <= b1 <= dlen:
                rep.fail("%s: %s: data_offsets %s outside the data area (%d bytes)" % (s, name, offs, dlen))
            if b1 - b0 != n * DTYPE_SIZE[dt]:
                rep.fail("%s: %s: %d bytes for %s %s (expected %d)" % (s, name, b1 - b0, dt, shape, n * DTYPE_SIZE[dt]))
            if name in found:
                rep.fail("%s is in both %s and %s" % (name, found[name][0], s))
            found[name] = (s, t, base)
            spans.append((b0, b1, name))
            total_bytes += b1 - b0
        spans.sort()
        pos = 0
        for b0, b1, name in spans:
            if b0 != pos:
                rep.fail("%s: %s at %d: %s at byte %d" % (s, "hole" if b0 > pos else "overlap", pos, name, b0))
            pos = max(pos, b1)
        if pos != dlen:
            rep.fail("%s: tensors end at %d but the data area has %d bytes" % (s, pos, dlen))
        if a.verbose:
            print("      %s: %d tensors, %d data bytes" % (s, len(spans), dlen))
    rep.ok("%d shard(s), %d tensors, %d bytes of tensor data" % (len(shards), len(found), total_bytes))

    # ---- index
    if index is not None:
        wm = index["weight_map"]
        extra = sorted(set(wm) - set(found))
        unlisted = sorted(set(found) - set(wm))
        if extra:
            rep.fail("index names %d tensors found in no shard, e.g. %s" % (len(extra), extra[:3]))
        if unlisted:
            rep.fail("%d tensors are missing from the index, e.g. %s" % (len(unlisted), unlisted[:3]))
        wrong = [n for n in found if n in wm and wm[n] != found[n][0]]
        if wrong:
            rep.fail("%d tensors are in a shard other than the index says, e.g. %s" % (len(wrong), wrong[:3]))
        if index["metadata"]["total_size"] != total_bytes:
            rep.fail("index total_size %d != %d bytes of tensors" % (index["metadata"]["total_size"], total_bytes))
        if not (extra or unlisted or wrong):
            rep.ok("index covers every tensor; total_size %d matches" % index["metadata"]["total_size"])

    # ---- names / shapes / dtypes
    exp = expected_tensors(cfg, fp8)
    miss = sorted(set(exp) - set(found))
    unexp = sorted(set(found) - set(exp))
    if miss:
        rep.fail("%d expected tensors missing, e.g. %s" % (len(miss), miss[:5]))
    if unexp:
        rep.fail("%d unexpected tensors, e.g. %s" % (len(unexp), unexp[:5]))
    bad = 0
    for name, (dt, shape, _k, _g, _f) in exp.items():
        if name in found:
            t = found[name][1]
            if t["dtype"] != dt or t["shape"] != shape:
                bad += 1
                if bad <= 5:
                    rep.fail("%s: %s %s, expected %s %s" % (name, t["dtype"], t["shape"], dt, shape))
    if not (miss or unexp or bad):
        rep.ok("names, shapes and dtypes match config.json (%d tensors)" % len(exp))

    # ---- parameter counts
    nl = cfg["num_hidden_layers"]
    E = cfg.get("n_routed_experts") or 0
    k = cfg.get("num_experts_per_tok") or 0
    tot = main_ = mtp = act = 0
    for name, (s, t, base) in found.items():
        if name.endswith("_scale_inv"):
            continue
        n = 1
        for x in t["shape"]:
            n *= x
        tot += n
        L = layer_of(name)
        if L is not None and L >= nl:
            mtp += n
            continue
        main_ += n
        if name == "model.embed_tokens.weight":
            continue
        act += n * k / E if ".mlp.experts." in name and E else n
    print("params total %s (%d) = main model %s + MTP %s; active per token %s "
          "(main model, top-%d of %d experts, embedding table excluded)"
          % (human(tot), tot, human(main_), human(mtp), human(act), k, E))

    # ---- values
    if not a.no_values:
        nbad = 0
        checked = 0
        for name, (dt, shape, kind, gain, fan_in) in exp.items():
            if name not in found:
                continue
            s, t, base = found[name]
            path = os.path.join(d, s)
            xs = sample_values(path, base, t, a.samples)
            if not xs:
                continue
            checked += 1
            if any(not math.isfinite(x) for x in xs):
                rep.fail("%s: non-finite values" % name)
                nbad += 1
                continue
            if kind == "scale":
                if min(xs) <= 0:
                    rep.fail("%s: non-positive block scale" % name)
                    nbad += 1
                continue
            if t["dtype"] == "F8_E4M3":
                # dequantise the sample with its block scales
                sc = found[name + "_scale_inv"]
                scales = sample_values(os.path.join(d, sc[0]), sc[2], sc[1], 1 << 30)
                cols = shape[1]
                cb = -(-cols // 128)
                xs = [x * scales[(i // cols) // 128 * cb + (i % cols) // 128] for i, x in enumerate(xs)]
                # every block of the first 128-row strip reaches +-448
                rows = min(128, shape[0])
                strip = sample_values(path, base, t, rows * cols)
                for b in range(cb):
                    amax = max(abs(strip[r * cols + c]) for r in range(rows)
                               for c in range(b * 128, min(cols, b * 128 + 128)))
                    if amax != 448.0:
                        rep.fail("%s: block (0,%d) max |q| = %g, expected 448" % (name, b, amax))
                        nbad += 1
                        break
            if kind == "norm":
                mu, sd = 1.0, 0.1
            elif kind == "bias":
                mu, sd = 0.0, 0.1
            elif kind == "embed":
                mu, sd = 0.0, 1.0
            else:
                mu, sd = 0.0, gain / math.sqrt(fan_in)
            n = len(xs)
            m, s_ = stats(xs)
            tol_m = 5 * sd / math.sqrt(n) + 0.01 * sd
            tol_s = sd * (5 / math.sqrt(2 * n) + 0.02 + (0.06 if t["dtype"] == "F8_E4M3" else 0))
            if abs(m - mu) > tol_m or abs(s_ - sd) > tol_s:
                nbad += 1
                rep.fail("%s: mean %.4f std %.4f, expected %.4f / %.4f (n=%d)" % (name, m, s_, mu, sd, n))
            elif a.verbose:
                print("      %-64s mean %+.4f std %.4f (expected %.4f)" % (name, m, s_, sd))
        # MTP copies
        for L in range(nl, nl + (cfg.get("num_nextn_predict_layers") or 0)):
            pairs = [("model.layers.%d.embed_tokens.weight" % L, "model.embed_tokens.weight"),
                     ("model.layers.%d.shared_head.head.weight" % L,
                      "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight")]
            for cp, src in pairs:
                if cp in found and src in found:
                    lim = None if a.full_copies else 1 << 20
                    h1 = file_digest(os.path.join(d, found[cp][0]), found[cp][2], found[cp][1], lim)
                    h2 = file_digest(os.path.join(d, found[src][0]), found[src][2], found[src][1], lim)
                    if h1 != h2:
                        rep.warn("%s is not a byte copy of %s (DeepSeek's release stores copies)" % (cp, src))
        if not nbad:
            rep.ok("values: %d tensors sampled (up to %d values each): finite, distributions as promised"
                   % (checked, a.samples))

    if rep.fails:
        print("RESULT: FAIL (%d problems, %d warnings)" % (len(rep.fails), len(rep.warns)))
        return 1
    print("RESULT: OK (%d warnings)" % len(rep.warns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
