#!/usr/bin/python3
"""Self-checks of dsv2_ref.py (the DeepSeek-V2 reference forward).

    /usr/bin/python3 models/train/check_dsv2_ref.py [V3_FIXTURE] [V2_FIXTURE ...]

V3_FIXTURE defaults to tests/fixtures/tiny-dsv3 (golden logits of DeepSeek's
official V3 inference code); V2_FIXTUREs default to tests/fixtures/tiny-dsv2-*.

1. Shared paths against the official V3 logits: dsv2_ref's model (its attention
   with q low-rank, kv path, RMSNorm, RoPE/YaRN tables, softmax scale, dense MLP,
   experts, shared experts, combine, final norm and head) loaded from tiny-dsv3,
   with only the router swapped for dsv3.Gate (sigmoid + correction bias, the one
   part V2 does not share). tiny-dsv3 has mscale = mscale_all_dim = 1 and
   max_position_embeddings > original, so the HF-V2 and official-V3 YaRN rules
   coincide there. Must match every logit, the routing and the hidden states to
   < 1e-4.
2. RoPE tables: dsv2_ref.inv_freq vs dsv3.rope_tables and vs HF's literal
   freq_inter = 1 / (factor * base^(2k/d)) form.
3. Router unit tests on hand-made softmax scores for greedy / "gready" /
   group_limited_greedy x norm_topk_prob x top_k, against values worked out by hand.
4. For each V2 fixture: an HF-literal forward (de-interleave + rotate_half with
   cat(freqs, freqs) tables times the YaRN multiplier, HF's gate code with
   sorted=False and 0-masking, HF moe_infer-style combine) must give the same logits
   as dsv2_ref, and dsv2_ref must reproduce the fixture's reference.json.
Exits 1 on any failure.
"""
import glob
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsv3  # noqa: E402
import dsv2_ref as R  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
TOL = 1e-4
FAILS = []


def expect(ok, msg):
    print(("ok    " if ok else "FAIL  ") + msg)
    if not ok:
        FAILS.append(msg)


# ----------------------------------------------------------------------------
# 1. shared paths vs the official V3 golden logits

def check_v3_shared(d):
    import json
    import numpy as np
    cfg3 = dsv3.Config.load(os.path.join(d, "config.json"))
    cfg2 = R.V2Config.load(os.path.join(d, "config.json"))
    model = R.load_model(d, gate_factory=lambda: dsv3.Gate(cfg3), cfg=cfg2)
    ref = json.load(open(os.path.join(d, "reference.json")))
    raw = open(os.path.join(d, "reference.bin"), "rb").read()

    def arr(rec):
        n = int(np.prod(rec["shape"]))
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4", count=n, offset=rec["offset"]).reshape(rec["shape"]).copy())

    # the V2 rules give the V3 numbers on this config
    expect(R.rope_mscale(cfg2) == 1.0, f"tiny-dsv3: V2 cos/sin multiplier is 1 (mscale == mscale_all_dim)")
    expect(abs(R.softmax_scale(cfg2) - dsv3.softmax_scale(cfg3)) < 1e-12,
           f"tiny-dsv3: V2 softmax scale {R.softmax_scale(cfg2):.9f} == V3 {dsv3.softmax_scale(cfg3):.9f}")
    worst = 0.0
    seqs = {s["name"]: s for s in ref["sequences"]}
    with torch.no_grad():
        for s in ref["sequences"]:
            got = model(torch.tensor([s["tokens"]]))[0]
            diff = (got - arr(s["logits"])).abs().max().item()
            worst = max(worst, diff)
            top = got.argmax(-1).tolist() == s["top1"]
            expect(diff < TOL and top, f"tiny-dsv3 {s['name']:<12} T={len(s['tokens']):<4} max|dlogit| vs official {diff:.2e}, top1 {'same' if top else 'DIFFERENT'}")
        r = ref["routing"]
        model(torch.tensor([seqs[r["sequence"]]["tokens"]]))
        for L in r["layers"]:
            w, ids, _ = model.moe_layers()[L["layer"]].last
            sets = all(set(ids[t].tolist()) == set(L["expert_ids"][t]) for t in range(len(L["expert_ids"])))
            dw = max(abs(dict(zip(ids[t].tolist(), w[t].tolist()))[e] - x)
                     for t in range(len(L["expert_ids"])) for e, x in zip(L["expert_ids"][t], L["weights"][t])) if sets else 1e9
            expect(sets and dw < TOL, f"tiny-dsv3 routing layer {L['layer']}: expert sets {'same' if sets else 'DIFFER'}, max|dweight| {dw:.2e}")
        dh = ref["debug_hidden"]
        _, hidden = model(torch.tensor([seqs[dh["sequence"]]["tokens"]]), return_hidden=True)
        names = ["embed_out"] + [f"layer{i}_out" for i in range(cfg2.num_hidden_layers)] + ["final_norm_out"]
        hd = max((h[0] - arr(dh[n])).abs().max().item() for n, h in zip(names, hidden))
        expect(hd < TOL, f"tiny-dsv3 debug hidden states max|diff| {hd:.2e}")
        # and against dsv3.py itself
        m3 = dsv3.load_model(d)
        s = ref["sequences"][-1]["tokens"]
        dd = (m3(torch.tensor([s]))[0] - model(torch.tensor([s]))[0]).abs().max().item()
        expect(dd < TOL, f"tiny-dsv3 dsv2_ref vs dsv3.py on T={len(s)}: max|dlogit| {dd:.2e}")
    print(f"      worst logit diff vs official V3 code: {worst:.2e}")


# ----------------------------------------------------------------------------
# 2. rope tables

def hf_inv_freq(cfg):
    """HF DeepseekV2YarnRotaryEmbedding._set_cos_sin_cache, literally."""
    y = R.yarn_params(cfg)
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    ar = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    freq_extra = 1.0 / (base ** ar)
    if y is None:
        return freq_extra
    freq_inter = 1.0 / (y["factor"] * base ** ar)

    def corr_dim(rot):
        return (dim * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi))) / (2 * math.log(base))
    low = max(math.floor(corr_dim(y["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(y["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    mask = 1.0 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return freq_inter * (1 - mask) + freq_extra * mask


def check_rope(v3dir, v2dirs):
    cfg3 = dsv3.Config.load(os.path.join(v3dir, "config.json"))
    cfg2 = R.V2Config.load(os.path.join(v3dir, "config.json"))
    c3, s3 = dsv3.rope_tables(cfg3, 256)
    c2, s2 = R.rope_tables(cfg2, 256)
    d = max((c3 - c2).abs().max().item(), (s3 - s2).abs().max().item())
    expect(d < 1e-6, f"rope tables dsv2_ref vs dsv3.rope_tables (tiny-dsv3, 256 positions): max|diff| {d:.2e}")
    for vd in v2dirs:
        cfg = R.V2Config.load(os.path.join(vd, "config.json"))
        a, b = R.inv_freq(cfg), hf_inv_freq(cfg)
        rel = ((a - b).abs() / b).max().item()
        expect(rel < 1e-6, f"{os.path.basename(vd)}: inv_freq vs HF literal form: max rel diff {rel:.1e} ({a.tolist()})")


# ----------------------------------------------------------------------------
# 3. router unit tests

def check_router():
    # 8 experts in 4 groups of 2. Group maxima: g0 .30, g1 .20, g2 .25, g3 .02
    p = torch.tensor([[0.30, 0.02, 0.20, 0.19, 0.25, 0.01, 0.02, 0.01]])
    logits = p.log() + 0.7  # softmax(log p + c) = p
    P = p[0].tolist()

    def run(**kw):
        w, ids, scores = R.route(logits, **kw)
        return dict(zip(ids[0].tolist(), w[0].tolist())), scores

    def same(got, want, what):
        ok = set(got) == set(want) and all(abs(got[e] - want[e]) < 1e-6 for e in want)
        expect(ok, f"router {what}: got {{{', '.join(f'{e}: {got[e]:.4f}' for e in sorted(got))}}}"
                   + ("" if ok else f" want {want}"))

    _, scores = run(top_k=3)
    expect((scores - p).abs().max().item() < 1e-6, "router softmax scores reproduce the hand-made probabilities")
    # greedy: top-3 of all = {0, 4, 2}
    same(run(top_k=3)[0], {0: P[0], 4: P[4], 2: P[2]}, "greedy k=3, no norm, scale 1")
    same(run(top_k=3, topk_method="gready", routed_scaling_factor=2.5)[0],
         {0: 2.5 * P[0], 4: 2.5 * P[4], 2: 2.5 * P[2]}, "'gready' spelling k=3, no norm, scale 2.5 (w = p * 2.5)")
    s = P[0] + P[4] + P[2]
    same(run(top_k=3, norm_topk_prob=True, routed_scaling_factor=2.5)[0],
         {0: P[0] / s, 4: P[4] / s, 2: P[2] / s}, "greedy k=3, norm_topk_prob, scale 2.5 NOT applied")
    same(run(top_k=1, norm_topk_prob=True, routed_scaling_factor=2.5)[0],
         {0: 2.5 * P[0]}, "greedy k=1, norm_topk_prob (top_k == 1: no norm, scale applied)")
    # group limited: keep groups g0 (.30) and g2 (.25) -> candidates {0, 1, 4, 5} -> top-3 {0, 4, 1}
    # (sum-of-top-2 group scores, V3's rule, would keep g1 (.39) and g0 (.32) -> {0, 2, 3})
    gl = dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    same(run(top_k=3, routed_scaling_factor=16.0, **gl)[0],
         {0: 16 * P[0], 4: 16 * P[4], 1: 16 * P[1]}, "group_limited_greedy 4/2 k=3, no norm, scale 16")
    s = P[0] + P[4] + P[1]
    same(run(top_k=3, norm_topk_prob=True, routed_scaling_factor=16.0, **gl)[0],
         {0: P[0] / s, 4: P[4] / s, 1: P[1] / s}, "group_limited_greedy 4/2 k=3, norm_topk_prob, scale NOT applied")
    same(run(top_k=2, topk_group=1, topk_method="group_limited_greedy", n_group=4)[0],
         {0: P[0], 1: P[1]}, "group_limited_greedy 4/1 k=2: only group 0")
    same(run(top_k=2, n_group=1, topk_group=1, topk_method="group_limited_greedy")[0],
         {0: P[0], 4: P[4]}, "group_limited_greedy with one group == greedy")
    # batch of rows, shuffled experts: routing is per row
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    lg2 = torch.cat([logits, logits[:, perm]])
    w, ids, _ = R.route(lg2, top_k=3)
    ok = set(ids[0].tolist()) == {0, 4, 2} and set(perm[ids[1]].tolist()) == {0, 4, 2}
    expect(ok, "router is per row (permuted experts in a second row select the same experts)")
    for bad in (dict(topk_method="noaux_tc"), dict(scoring_func="sigmoid")):
        try:
            R.route(logits, top_k=2, **bad)
            expect(False, f"router rejects {bad}")
        except NotImplementedError:
            expect(True, f"router rejects {bad}")


# ----------------------------------------------------------------------------
# 4. HF-literal forward vs dsv2_ref on the V2 fixtures

def hf_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_apply_rope(x, cos, sin):
    """x [B, H, T, d]; cos/sin [T, d] = cat(freqs, freqs) tables (HF apply_rotary_pos_emb)."""
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return x * cos + hf_rotate_half(x) * sin


def hf_gate(cfg, weight, x):
    """HF MoEGate.forward (inference), literally (sorted=False, masked_fill 0.0)."""
    logits = F.linear(x.float(), weight.float())
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    n = x.shape[0]
    if cfg.topk_method in ("greedy", "gready"):
        w, idx = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
    else:
        gs = scores.view(n, cfg.n_group, -1).max(dim=-1).values
        gi = torch.topk(gs, k=cfg.topk_group, dim=-1, sorted=False)[1]
        gm = torch.zeros_like(gs)
        gm.scatter_(1, gi, 1)
        sm = gm.unsqueeze(-1).expand(n, cfg.n_group, cfg.n_routed_experts // cfg.n_group).reshape(n, -1)
        w, idx = torch.topk(scores.masked_fill(~sm.bool(), 0.0), k=cfg.num_experts_per_tok, dim=-1, sorted=False)
    if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        w = w * cfg.routed_scaling_factor
    return idx, w


def hf_forward(model, tokens):
    cfg = model.cfg
    T = tokens.shape[1]
    inv = hf_inv_freq(cfg)
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    ms = R.rope_mscale(cfg)  # yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim), 1 without yarn
    cos, sin = emb.cos() * ms, emb.sin() * ms
    qd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    scale = qd ** -0.5
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("mscale_all_dim", 0):
        m = R.yarn_get_mscale(cfg.rope_scaling["factor"], cfg.rope_scaling["mscale_all_dim"])
        scale = scale * m * m
    H = cfg.num_attention_heads
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu_(1)
    h = model.model.embed_tokens(tokens).float()
    for L in model.model.layers:
        a = L.self_attn
        x = L.input_layernorm(h)
        q = a.q_proj(x) if cfg.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
        q = q.view(1, T, H, qd).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        ckv = a.kv_a_proj_with_mqa(x)
        ckv, k_pe = torch.split(ckv, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(1, T, 1, cfg.qk_rope_head_dim).transpose(1, 2)
        kv = a.kv_b_proj(a.kv_a_layernorm(ckv)).view(1, T, H, cfg.qk_nope_head_dim + cfg.v_head_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q_pe, k_pe = hf_apply_rope(q_pe, cos, sin), hf_apply_rope(k_pe, cos, sin)
        qs = torch.cat([q_nope, q_pe], dim=-1)
        ks = torch.cat([k_nope, k_pe.expand(1, H, T, cfg.qk_rope_head_dim)], dim=-1)
        att = torch.matmul(qs, ks.transpose(2, 3)) * scale + mask
        att = F.softmax(att, dim=-1, dtype=torch.float32)
        o = torch.matmul(att, v).transpose(1, 2).reshape(1, T, H * cfg.v_head_dim)
        h = h + a.o_proj(o)
        x = L.post_attention_layernorm(h)
        mlp = L.mlp
        if isinstance(mlp, R.MoE):
            xf = x.view(-1, x.shape[-1])
            idx, w = hf_gate(cfg, mlp.gate.weight, xf)
            # moe_infer: sort token copies by expert, run, unsort, weighted sum over k
            flat = idx.view(-1)
            order = flat.argsort()
            toks = xf[order // idx.shape[1]]
            outs = torch.empty_like(toks)
            for e in range(cfg.n_routed_experts):
                sel = flat[order] == e
                if sel.any():
                    outs[sel] = mlp.experts[e](toks[sel])
            new = torch.empty_like(outs)
            new[order] = outs
            y = (new.view(*idx.shape, -1) * w.unsqueeze(-1)).sum(dim=1)
            if cfg.n_shared_experts:
                y = y + mlp.shared_experts(xf)
            h = h + y.view_as(h)
        else:
            h = h + mlp(x)
    return model.head(model.model.norm(h))


def check_v2_fixture(d):
    name = os.path.basename(d.rstrip("/"))
    import json
    ref = json.load(open(os.path.join(d, "reference.json")))
    model = R.load_model(d)
    with torch.no_grad():
        worst = 0.0
        for s in ref["sequences"]:
            t = torch.tensor([s["tokens"]])
            worst = max(worst, (hf_forward(model, t)[0] - model(t)[0]).abs().max().item())
        expect(worst < 2e-5, f"{name}: HF-literal forward vs dsv2_ref, all sequences: max|dlogit| {worst:.2e}")
    print(f"      {name}: dsv2_ref vs its reference.json:")
    expect(R.check(d), f"{name}: reference.json reproduced")


def main():
    torch.set_num_threads(1)
    args = sys.argv[1:]
    v3 = args[0] if args else os.path.join(REPO, "tests/fixtures/tiny-dsv3")
    v2 = args[1:] or sorted(glob.glob(os.path.join(REPO, "tests/fixtures/tiny-dsv2-*")))
    print("== 1. shared paths vs official V3 logits (router swapped for dsv3.Gate)")
    check_v3_shared(v3)
    print("== 2. rope tables")
    check_rope(v3, v2)
    print("== 3. router")
    check_router()
    print("== 4. V2 fixtures")
    for d in v2:
        check_v2_fixture(d)
    print(f"{'PASS' if not FAILS else 'FAIL'} ({len(FAILS)} failures)")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
