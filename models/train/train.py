#!/usr/bin/python3
"""Train a small DeepSeek-V3 (MLA + DeepSeekMoE + MTP) on tinyshakespeare.

    /usr/bin/python3 models/train/prepare_data.py        # once: split + tokenize
    /usr/bin/python3 models/train/train.py               # 20-40 min on 2 cores
    /usr/bin/python3 models/train/export.py              # HF dir + golden data

The architecture is dsv3.py (the official DeepSeek-V3 inference maths, checked
against golden logits by check_reference.py). This file adds training:

* data: random windows of the train split ids (seeded generator). A window is
  T+2 tokens: the main model reads x[0:T] and predicts x[1:T+1]; the MTP
  module reads x[1:T+1] (t_{i+1}) and predicts x[2:T+2] (t_{i+2}).
  A fraction --bos-frac of rows instead start with BOS (id 0) followed by text
  starting at the beginning of a speech (just after a blank line), so that the
  model also works when a runtime prepends BOS (tokenizer_config.json has
  add_bos_token true). All other rows have no BOS.
* loss: CE(main) + lambda * CE(MTP) (DeepSeek-V3's MTP loss; lambda 0.3 for
  the first 70% of steps, then 0.1) + alpha * sequence-wise balance loss
  (DeepSeek-V3 eq. 17-20, alpha 1e-4) summed over MoE layers.
* load balance: DeepSeek-V3's auxiliary-loss-free strategy: after each step,
  e_score_correction_bias_e += gamma * sign(mean_load - load_e) per MoE layer
  (the bias is a buffer: no gradient).
* AdamW (0.9, 0.95), weight decay 0.1 on matrices, linear warmup then cosine
  to 10% of peak, gradient clipping 1.0, fp32, 2 threads, seeded.
"""
import argparse
import csv
import json
import math
import os
import sys
import time

# Debian's torch calls the system BLAS (OpenBLAS, its own 2 pthreads = the 2 cores)
# for matmuls; torch's own OpenMP pool is kept at 1 thread (--threads) so the two
# do not fight over the cores. glibc malloc is told to keep large blocks instead
# of mmap/munmap-ing them every step (page faults made elementwise ops 3-10x
# slower). These must be set before the process starts: re-exec once.
_ENV = {"OPENBLAS_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": "33554432",
        "MALLOC_TRIM_THRESHOLD_": "4294967296", "MALLOC_TOP_PAD_": "268435456"}
if __name__ == "__main__" and any(k not in os.environ for k in _ENV):
    os.execve(sys.executable, [sys.executable] + sys.argv, {**_ENV, **os.environ})
import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsv3  # noqa: E402

# the model: see README.md for the reasoning behind the sizes
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.0001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "kv_lora_rank": 64,
    "max_position_embeddings": 1024,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 128,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 1024,
}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--mtp-lambda", type=float, nargs=2, default=[0.3, 0.1])
    p.add_argument("--mtp-switch", type=float, default=0.7, help="fraction of steps with the first lambda")
    p.add_argument("--aux-alpha", type=float, default=1e-4)
    p.add_argument("--bias-gamma", type=float, default=1e-2)
    p.add_argument("--bos-frac", type=float, default=0.125)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (BLAS has its own 2)")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--bench", type=int, default=0, help="only time this many steps")
    return p.parse_args()


def init_weights(model, cfg):
    std = cfg.d["initializer_range"]
    resid_std = std / math.sqrt(2 * (cfg.num_hidden_layers + 1))
    for name, p in model.named_parameters():
        if p.dim() == 1:
            continue  # RMSNorm weights stay 1
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            torch.nn.init.normal_(p, 0.0, resid_std)
        else:
            torch.nn.init.normal_(p, 0.0, std)


def para_starts(ids, tokenizer_json):
    """Token positions that begin right after a blank line ("\n\n")."""
    tj = json.load(open(tokenizer_json))
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    tok_bytes = {}
    for s, i in tj["model"]["vocab"].items():
        try:
            tok_bytes[i] = bytes(dec[ch] for ch in s)
        except KeyError:
            tok_bytes[i] = b""
    out = []
    tail = b""
    for pos, i in enumerate(ids.tolist()):
        if tail.endswith(b"\n\n"):
            out.append(pos)
        tail = (tail + tok_bytes[i])[-2:]
    return np.array(out, dtype=np.int64)


class Batcher:
    def __init__(self, ids, starts, args, seed):
        self.ids = torch.from_numpy(ids.astype(np.int64))
        self.starts = torch.from_numpy(starts)
        self.T = args.ctx
        self.B = args.batch
        self.n_bos = int(round(args.bos_frac * args.batch))
        self.g = torch.Generator().manual_seed(seed)

    def next(self):
        T, B = self.T, self.B
        rows = []
        nb = self.n_bos
        s = torch.randint(0, len(self.ids) - (T + 2), (B - nb,), generator=self.g)
        for j in s.tolist():
            rows.append(self.ids[j:j + T + 2])
        if nb:
            k = torch.randint(0, len(self.starts), (nb,), generator=self.g)
            for j in self.starts[k].tolist():
                j = min(j, len(self.ids) - (T + 1))
                rows.append(torch.cat([torch.zeros(1, dtype=torch.long), self.ids[j:j + T + 1]]))
        return torch.stack(rows)


def balance_loss(model, cfg):
    """DeepSeek-V3 complementary sequence-wise balance loss (without alpha)."""
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    total = 0.0
    for moe in model.moe_layers():
        idx, scores = moe.last  # [B,T,K], [B,T,E]
        T = idx.shape[1]
        counts = torch.zeros(idx.shape[0], E).scatter_add_(1, idx.reshape(idx.shape[0], -1),
                                                           torch.ones(idx.shape[0], T * K))
        f = counts * (E / (K * T))
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        total = total + (f * p).sum(-1).mean()
    return total


@torch.no_grad()
def update_bias(model, cfg, gamma):
    loads = []
    for moe in model.moe_layers():
        idx = moe.last[0]
        load = torch.bincount(idx.reshape(-1), minlength=cfg.n_routed_experts).float()
        moe.gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
        loads.append((load.max() / load.mean()).item())
    return loads


@torch.no_grad()
def evaluate(model, ids, L):
    """Mean next-token CE (nats) and MTP CE / top-1 accuracy over non-overlapping
    windows of L tokens (last partial window included), no BOS."""
    model.eval()
    ids = torch.from_numpy(ids.astype(np.int64))
    nll, n, mnll, mn, macc = 0.0, 0, 0.0, 0, 0
    for a in range(0, len(ids) - 1, L):
        w = ids[a:a + L][None]
        if w.shape[1] < 2:
            break
        if w.shape[1] >= 3:
            logits, mlog = model(w[:, :-1], mtp_tokens=w[:, 1:-1])
        else:
            logits, mlog = model(w[:, :-1]), None
        nll += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
        n += w.shape[1] - 1
        if mlog is not None:
            mnll += F.cross_entropy(mlog[0], w[0, 2:], reduction="sum").item()
            macc += (mlog[0].argmax(-1) == w[0, 2:]).sum().item()
            mn += w.shape[1] - 2
    model.train()
    return nll / n, mnll / mn, macc / mn


def main():
    args = parse()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    cfg = dsv3.Config(CONFIG)
    model = dsv3.DeepseekV3(cfg, tie_mtp=True)
    init_weights(model, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters (unique, MTP embedding/head tied): {n_params/1e6:.2f} M", flush=True)

    d = os.path.join(HERE, "data")
    train_ids = np.fromfile(os.path.join(d, "train.bin"), dtype="<u2")
    val_ids = np.fromfile(os.path.join(d, "val.bin"), dtype="<u2")
    tok_json = "/work/shared/fixtures/tiny-tokenizer/tokenizer.json"
    local = os.path.join(os.path.dirname(HERE), "shakespeare", "tokenizer.json")
    starts = para_starts(train_ids, local if os.path.exists(local) else tok_json)
    print(f"train {len(train_ids)} ids ({len(starts)} speech starts), val {len(val_ids)} ids", flush=True)
    batcher = Batcher(train_ids, starts, args, args.seed + 1)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        lo = args.lr * args.min_lr_frac
        return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * min(1.0, t)))

    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "log.csv")
    logf = open(log_path, "w", newline="") if not args.bench else None
    logw = csv.writer(logf) if logf else None
    if logw:
        logw.writerow(["step", "tokens", "lr", "train_loss", "train_mtp_loss", "val_loss", "val_mtp_loss",
                       "val_mtp_top1", "max_over_mean_load", "elapsed_s"])
    T = args.ctx
    steps = args.bench or args.steps
    t0 = time.time()
    acc = {"loss": 0.0, "mtp": 0.0, "n": 0}
    model.train()
    for step in range(steps):
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        lam = args.mtp_lambda[0] if step < args.mtp_switch * args.steps else args.mtp_lambda[1]
        x = batcher.next()
        logits, mlog = model(x[:, :T], mtp_tokens=x[:, 1:T + 1])
        V = cfg.vocab_size
        loss_main = F.cross_entropy(logits.reshape(-1, V), x[:, 1:T + 1].reshape(-1))
        loss_mtp = F.cross_entropy(mlog.reshape(-1, V), x[:, 2:T + 2].reshape(-1))
        loss = loss_main + lam * loss_mtp
        if args.aux_alpha > 0:
            loss = loss + args.aux_alpha * balance_loss(model, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loads = update_bias(model, cfg, args.bias_gamma)
        acc["loss"] += loss_main.item()
        acc["mtp"] += loss_mtp.item()
        acc["n"] += 1
        last = step == steps - 1
        if (step + 1) % args.log_every == 0 or last:
            el = time.time() - t0
            print(f"step {step+1:5d} lr {lr:.2e} loss {acc['loss']/acc['n']:.4f} mtp {acc['mtp']/acc['n']:.4f} "
                  f"maxload/mean {max(loads):.2f} {el:.0f}s ({el/(step+1):.2f}s/step)", flush=True)
            vl = vm = va = ""
            if not args.bench and ((step + 1) % args.eval_every == 0 or last):
                vl, vm, va = evaluate(model, val_ids, T)
                print(f"      val loss {vl:.4f} val mtp {vm:.4f} mtp top1 {va:.3f}", flush=True)
            if logw:
                logw.writerow([step + 1, (step + 1) * args.batch * T, f"{lr:.6g}",
                               f"{acc['loss']/acc['n']:.5f}", f"{acc['mtp']/acc['n']:.5f}",
                               f"{vl:.5f}" if vl != "" else "", f"{vm:.5f}" if vm != "" else "",
                               f"{va:.4f}" if va != "" else "", f"{max(loads):.3f}", f"{el:.1f}"])
                logf.flush()
            acc = {"loss": 0.0, "mtp": 0.0, "n": 0}
    wall = time.time() - t0
    print(f"done: {steps} steps in {wall:.0f}s", flush=True)
    if args.bench:
        return
    torch.save({"config": CONFIG, "state_dict": model.state_dict(), "args": vars(args), "wall_s": wall},
               os.path.join(args.out, "ckpt.pt"))
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump({"args": vars(args), "wall_s": wall, "steps": steps, "params": n_params}, f, indent=1)


if __name__ == "__main__":
    main()
