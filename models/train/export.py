#!/usr/bin/python3
"""Export the trained model to models/shakespeare/ and compute its golden data.

    /usr/bin/python3 models/train/export.py [--ckpt models/train/out/ckpt.pt]

Writes, in models/shakespeare/:
  config.json, model.safetensors (BF16; e_score_correction_bias F32; HF names;
  the MTP module as model.layers.{num_hidden_layers}.* with copies of the
  embedding and head), tokenizer.json, tokenizer_config.json,
  reference.json + reference.bin (fp32 outputs of dsv3.py run on the weights
  read BACK from model.safetensors, i.e. the bf16-rounded weights),
  train_log.csv, loss.png, samples.txt.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsv3  # noqa: E402
from train import para_starts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "models", "shakespeare")
TOK_SRC = "/work/shared/fixtures/tiny-tokenizer"
VAL_WINDOW = 256


def export_weights(ckpt):
    cfgd = ckpt["config"]
    cfg = dsv3.Config(cfgd)
    model = dsv3.DeepseekV3(cfg, tie_mtp=True)
    model.load_state_dict(ckpt["state_dict"])
    sd = model.state_dict()  # tied MTP embed/head appear under both names: copies
    L = cfg.num_hidden_layers
    assert f"model.layers.{L}.embed_tokens.weight" in sd and f"model.layers.{L}.shared_head.head.weight" in sd

    def key(n):  # natural order: embed, layers by index, norm, head
        parts = n.split(".")
        if parts[1] == "layers":
            return (1, int(parts[2]), n)
        return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}[n], 0, n)

    tensors = {}
    for n in sorted(sd, key=key):
        t = sd[n].detach().float()
        tensors[n] = t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    os.makedirs(OUT, exist_ok=True)
    dsv3.write_safetensors(os.path.join(OUT, "model.safetensors"), tensors)
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(cfgd, f, indent=2, sort_keys=True)
        f.write("\n")
    for fn in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copyfile(os.path.join(TOK_SRC, fn), os.path.join(OUT, fn))
    return len(tensors), sum(t.numel() for t in tensors.values())


class Bin:
    def __init__(self):
        self.chunks, self.off = [], 0

    def add(self, t):
        a = np.ascontiguousarray(t.detach().float().numpy().astype("<f4"))
        rec = {"offset": self.off, "shape": list(a.shape)}
        self.chunks.append(a.tobytes())
        self.off += a.nbytes
        return rec


def margins(logits):
    top2 = logits.topk(2, dim=-1)[0]
    m = (top2[:, 0] - top2[:, 1])
    return [round(x, 6) for x in m.tolist()], m.min().item()


@torch.no_grad()
def val_metrics(model, ids, L):
    """The val_loss protocol (see README): non-overlapping windows of L tokens,
    ids[kL:(k+1)L], last partial window included, each run from position 0 with
    no BOS; every position j < n-1 of a window predicts window[j+1]. val_loss =
    sum of NLL / number of predictions. MTP: position j < n-2 of the window (fed
    window[j+1]) predicts window[j+2]."""
    cfg = model.cfg
    nll, n, macc, mnll, mn = 0.0, 0, 0, 0.0, 0
    E = cfg.n_routed_experts
    layer_ids = [i for i, l in enumerate(model.model.layers) if isinstance(l.mlp, dsv3.MoE)]
    counts = {i: torch.zeros(E) for i in layer_ids}
    windows = 0
    for a in range(0, len(ids), L):
        w = ids[a:a + L][None]
        if w.shape[1] < 2:
            break
        windows += 1
        # main model on the full window (this is what perplexity scores)
        logits = model(w)[0]
        nll += F.cross_entropy(logits[:-1], w[0, 1:], reduction="sum").item()
        n += w.shape[1] - 1
        for i in layer_ids[:-1] if cfg.num_nextn_predict_layers else layer_ids:
            counts[i] += torch.bincount(model.model.layers[i].mlp.last[0].reshape(-1), minlength=E).float()
        if w.shape[1] >= 3:
            _, mlog = model(w[:, :-1], mtp_tokens=w[:, 1:-1])
            tgt = w[0, 2:]
            mnll += F.cross_entropy(mlog[0], tgt, reduction="sum").item()
            macc += (mlog[0].argmax(-1) == tgt).sum().item()
            mn += tgt.numel()
            if cfg.num_nextn_predict_layers:
                i = layer_ids[-1]
                counts[i] += torch.bincount(model.model.layers[i].mlp.last[0].reshape(-1), minlength=E).float()
    load = {}
    for i, c in counts.items():
        share = c / c.sum()
        load[str(i)] = {"tokens_per_expert": [int(x) for x in c.tolist()],
                        "max_over_mean": round((share.max() * E).item(), 4),
                        "min_over_mean": round((share.min() * E).item(), 4),
                        "max_share": round(share.max().item(), 5)}
    return {"val_loss": nll / n, "n_predictions": n, "n_windows": windows, "mtp_top1_acc": macc / mn,
            "mtp_val_loss": mnll / mn, "mtp_predictions": mn, "expert_load": load}


def byte_decoder(tokenizer_json):
    tj = json.load(open(tokenizer_json))
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    table = {}
    for s, i in tj["model"]["vocab"].items():
        table[i] = bytes(dec[ch] for ch in s) if all(ch in dec for ch in s) else s.encode()
    for a in tj["added_tokens"]:
        table[a["id"]] = a["content"].encode()
    return lambda ids: b"".join(table[i] for i in ids).decode("utf-8", errors="replace")


@torch.no_grad()
def sample(model, prompt, n, temperature, top_k, gen):
    ids = list(prompt)
    for _ in range(n):
        ctx = torch.tensor([ids[-VAL_WINDOW:]])
        logits = model(ctx)[0, -1] / temperature
        v, ix = logits.topk(top_k)
        p = torch.softmax(v, -1)
        ids.append(ix[torch.multinomial(p, 1, generator=gen)].item())
    return ids


def plot(log_csv, png):
    import csv
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(csv.DictReader(open(log_csv)))
    st = [int(r["step"]) for r in rows]
    tr = [float(r["train_loss"]) for r in rows]
    tm = [float(r["train_mtp_loss"]) for r in rows]
    vs = [(int(r["step"]), float(r["val_loss"]), float(r["val_mtp_loss"])) for r in rows if r["val_loss"]]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(st, tr, label="train (main, next token)", lw=1)
    ax.plot(st, tm, label="train (MTP head, token after next)", lw=1, alpha=0.7)
    ax.plot([v[0] for v in vs], [v[1] for v in vs], "o-", label="validation (main)", ms=3)
    ax.plot([v[0] for v in vs], [v[2] for v in vs], "s--", label="validation (MTP)", ms=3)
    ax.set_xlabel("step (16 x 256 tokens)")
    ax.set_ylabel("cross-entropy, nats/token")
    ax.set_ylim(2.2, 7.2)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("cm384 shakespeare model: DeepSeek-V3 architecture, 8.6M trained parameters")
    fig.tight_layout()
    fig.savefig(png)


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=os.path.join(HERE, "out", "ckpt.pt"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default=os.path.join(HERE, "out", "log.csv"))
    args = ap.parse_args()
    OUT = args.out or OUT
    torch.set_num_threads(2)
    torch.manual_seed(0)
    ckpt = torch.load(args.ckpt)
    n_t, n_p = export_weights(ckpt)
    print(f"wrote {n_t} tensors, {n_p} values, "
          f"{os.path.getsize(os.path.join(OUT, 'model.safetensors'))} bytes", flush=True)

    # everything below runs on the weights read back from the exported bf16 files
    model = dsv3.load_model(OUT)
    cfg = model.cfg
    ids = torch.from_numpy(np.fromfile(os.path.join(HERE, "data", "valtxt.bin"), dtype="<u2").astype(np.int64))
    starts = para_starts(ids.numpy(), os.path.join(OUT, "tokenizer.json"))
    decode = byte_decoder(os.path.join(OUT, "tokenizer.json"))
    b = Bin()
    ref = {
        "description": "Golden outputs of models/train/dsv3.py (the official DeepSeek-V3 inference maths, "
                       "checked against the tiny-dsv3 fixture by models/train/check_reference.py) in float32, "
                       "run on the weights read back from model.safetensors (bf16, exactly upcast). "
                       "Arrays live in the .bin file (little-endian float32, row-major) at the given byte "
                       "offset/shape. Token ids come from val.txt (the validation split), tokenized as one "
                       "text with add_special_tokens=false; BOS = 0 where shown.",
        "bin": {"file": "reference.bin", "dtype": "float32", "byte_order": "little",
                "layout": "row-major array at byte 'offset' with 'shape'"},
        "model_args": {"yarn": False, "softmax_scale": dsv3.softmax_scale(cfg),
                       "rms_norm_eps_used": dsv3.EPS, "attn": "naive (equal to absorb)"},
    }
    s1 = int(starts[3])
    s2 = int(starts[10])
    seq_defs = [
        ("seq0_bos_len16", [0] + ids[:15].tolist()),
        ("seq1_len64", ids[s1:s1 + 64].tolist()),
        ("seq2_bos_len128", [0] + ids[s2:s2 + 127].tolist()),
        ("seq3_window0_len256", ids[:VAL_WINDOW].tolist()),
    ]
    seqs = []
    with torch.no_grad():
        for name, toks in seq_defs:
            lg = model(torch.tensor([toks]))[0]
            mg, mmin = margins(lg)
            seqs.append({"name": name, "tokens": toks, "text": decode([t for t in toks if t != 0]),
                         "logits": b.add(lg), "top1": lg.argmax(-1).tolist(),
                         "min_top1_margin": mmin, "top1_margin": mg})
        ref["sequences"] = seqs

        # MTP for seq2: positions 0..T-2 (needs t_{i+1})
        entries = []
        for sname in ["seq2_bos_len128"]:
            toks = torch.tensor([dict(seq_defs)[sname]])
            _, ml = model(toks[:, :-1], mtp_tokens=toks[:, 1:])
            ml = ml[0]
            e = {"sequence": sname, "logits": b.add(ml), "top1": ml.argmax(-1).tolist(),
                 "min_top1_margin": margins(ml)[1],
                 "top1_acc_vs_t_i+2": (ml[:-1].argmax(-1) == toks[0, 2:]).float().mean().item()}
            if sname == "seq2_bos_len128":
                idx, sc = model.mtp_layer().mlp.last
                w = sc[0].gather(1, idx[0])
                w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
                e["routing"] = {"layer": cfg.num_hidden_layers, "expert_ids": idx[0].tolist(), "weights": w.tolist()}
            entries.append(e)
        ref["mtp"] = {
            "layer_index": cfg.num_hidden_layers,
            "definition": "For i = 0..T-2: h'_i = eh_proj(concat([enorm(Emb(t_{i+1})), hnorm(h_i)])) (embedding "
                          "half first); h_i = output of the main model's final RMSNorm (model.norm) at position i; "
                          "the MTP block (layer index num_hidden_layers, MoE) runs causal attention over the T-1 "
                          "MTP positions with RoPE positions 0..T-2; logits_i = shared_head.head(shared_head.norm("
                          "block_out_i)) predicts t_{i+2}. No position-0 embedding masking. Emb / shared_head.head "
                          "are the MTP layer's own copies (equal to model.embed_tokens / lm_head).",
            "entries": entries,
        }

        # routing + hidden states for seq2
        toks = torch.tensor([dict(seq_defs)["seq2_bos_len128"]])
        _, hidden = model(toks, return_hidden=True)
        layers = []
        for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
            idx, sc = model.model.layers[i].mlp.last
            w = sc[0].gather(1, idx[0])
            w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
            layers.append({"layer": i, "expert_ids": idx[0].tolist(), "weights": w.tolist()})
        ref["routing"] = {"sequence": "seq2_bos_len128",
                          "note": "expert_ids: per token, routed experts in torch.topk order (descending score + "
                                  "e_score_correction_bias); compare as sets. weights: after normalisation and "
                                  "* routed_scaling_factor.", "layers": layers}
        dh = {"sequence": "seq2_bos_len128",
              "note": "residual stream [T, hidden] after the embedding and after each decoder block, and the final "
                      "RMSNorm output (input of lm_head)"}
        names = ["embed_out"] + [f"layer{i}_out" for i in range(cfg.num_hidden_layers)] + ["final_norm_out"]
        for nme, h in zip(names, hidden):
            dh[nme] = b.add(h[0])
        ref["debug_hidden"] = dh

        # greedy (argmax of a full forward each step == KV-cache decoding, fp32)
        greedy = []
        for prompt in [[0] + ids[:8].tolist(), ids[s1:s1 + 32].tolist()]:
            cur = list(prompt)
            step_logits = []
            for _ in range(32):
                lg = model(torch.tensor([cur]))[0, -1]
                step_logits.append(lg)
                cur.append(int(lg.argmax()))
            sl = torch.stack(step_logits)
            greedy.append({"prompt": prompt, "max_new_tokens": 32, "eos_id": None, "generated": cur[len(prompt):],
                           "text": decode([t for t in cur if t != 0]), "step_logits": b.add(sl),
                           "min_top1_margin": margins(sl)[1],
                           "note": "argmax decoding, EOS disabled; row j of step_logits chose generated[j]"})
        ref["greedy"] = greedy

        vm = val_metrics(model, ids, VAL_WINDOW)
    ref["val_file"] = "val.txt"
    ref["val_tokens"] = int(len(ids))
    ref["val_window"] = VAL_WINDOW
    ref["val_protocol"] = (
        "val.txt (this folder) is tokenized as ONE text with add_special_tokens=false (no BOS, no EOS): "
        f"{len(ids)} ids. They are cut into non-overlapping windows of L={VAL_WINDOW} ids, ids[k*L:(k+1)*L] for "
        f"k = 0,1,...; the last window is partial ({len(ids) % VAL_WINDOW} ids) and is included. Each window is "
        "run on its own from position 0 (fresh context, nothing prepended, RoPE positions 0..n-1). Every position "
        "j = 0..n-2 of a window of n ids is scored with -log softmax(logits_j)[window[j+1]] (natural log). "
        "val_loss = sum of these over all windows / number of scored positions "
        f"({vm['n_predictions']} = {len(ids)} - {vm['n_windows']} windows). Perplexity = exp(val_loss). "
        "mtp_top1_acc: in the same windows, the MTP module at position j = 0..n-3 (fed window[j+1], h_j) is "
        "correct when argmax of its logits == window[j+2]; accuracy = correct / "
        f"{vm['mtp_predictions']} positions. mtp_val_loss: mean cross-entropy of that prediction.")
    ref["val_loss"] = vm["val_loss"]
    ref["val_perplexity"] = float(np.exp(vm["val_loss"]))
    ref["val_predictions"] = vm["n_predictions"]
    ref["val_windows"] = vm["n_windows"]
    ref["mtp_top1_acc"] = vm["mtp_top1_acc"]
    ref["mtp_val_loss"] = vm["mtp_val_loss"]
    ref["mtp_predictions"] = vm["mtp_predictions"]
    ref["expert_load_on_val"] = {
        "note": "routed (token, expert) assignments per expert over the val_loss windows; main layers from the "
                "main forward, the MTP layer from the MTP forward. max_over_mean = max token share * n_experts.",
        "layers": vm["expert_load"]}
    allm = [s["min_top1_margin"] for s in seqs]
    ref["stats"] = {"logit_min": min(float(np.frombuffer(c, "<f4").min()) for c in b.chunks[:4]),
                    "logit_max": max(float(np.frombuffer(c, "<f4").max()) for c in b.chunks[:4]),
                    "min_top1_margin": min(allm)}
    with open(os.path.join(OUT, "reference.bin"), "wb") as f:
        for c in b.chunks:
            f.write(c)
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(json.dumps({k: ref[k] for k in ["val_loss", "val_perplexity", "val_predictions", "val_windows",
                                          "mtp_top1_acc", "mtp_val_loss"]}, indent=1))
    for k, v in vm["expert_load"].items():
        print(f"layer {k}: max/mean {v['max_over_mean']} min/mean {v['min_over_mean']} {v['tokens_per_expert']}")

    # samples (temperature 0.8, top-k 40, fixed seed), from BOS and from a prompt
    gen = torch.Generator().manual_seed(42)
    out = []
    for prompt_text, prompt in [("<BOS>", [0]), ("<BOS>ROMEO:\n", None)]:
        if prompt is None:
            prompt = [0] + tokenize_small("ROMEO:\n")
        s = sample(model, prompt, 300, 0.8, 40, gen)
        out.append(f"=== prompt {prompt_text!r}, temperature 0.8, top-k 40, seed 42 ===\n" + decode([t for t in s if t != 0]))
    with open(os.path.join(OUT, "samples.txt"), "w") as f:
        f.write("\n\n".join(out) + "\n")
    print("\n\n".join(out))

    log = args.log
    if os.path.exists(log):
        shutil.copyfile(log, os.path.join(OUT, "train_log.csv"))
        plot(log, os.path.join(OUT, "loss.png"))


def tokenize_small(text):
    import subprocess
    import tempfile
    from prepare_data import node_path
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "p.txt")
        open(p, "w").write(text)
        subprocess.run(["node", os.path.join(HERE, "tokenize.js"), os.path.join(OUT, "tokenizer.json"), p,
                        os.path.join(d, "p.bin")], check=True, env=dict(os.environ, NODE_PATH=node_path()),
                       stdout=subprocess.DEVNULL)
        return np.fromfile(os.path.join(d, "p.bin"), dtype="<u2").astype(int).tolist()


if __name__ == "__main__":
    main()
