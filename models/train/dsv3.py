"""DeepSeek-V3 in plain PyTorch, computing exactly what DeepSeek's official
inference code (deepseek-ai/DeepSeek-V3, inference/model.py) computes, with
Hugging Face tensor names so that a state_dict is a checkpoint.

Used by train.py (training), check_reference.py (verification against the
tiny-dsv3 golden logits) and export.py (export + golden data).

Semantics (see /work/shared/fixtures/tiny-dsv3/README.md, "Official-code
semantics to match"):
  * MLA with low-rank q (q_a_proj -> q_a_layernorm -> q_b_proj) and kv
    (kv_a_proj_with_mqa -> [kv_a_layernorm(c_kv), k_pe] -> kv_b_proj), o_proj.
  * decoupled RoPE on ADJACENT pairs (2k, 2k+1) of the rope sub-vectors; k_pe
    (last qk_rope dims of kv_a_proj_with_mqa output, not normed) shared by all
    heads. YaRN frequencies + mscale only when max_seq_len > original_seq_len,
    as the official code does.
  * softmax scale (qk_nope + qk_rope)^-0.5 (times mscale^2 with YaRN).
  * RMSNorm eps hard-coded 1e-6, x * rsqrt(mean(x^2) + eps) * weight.
  * gate: sigmoid scores; + e_score_correction_bias for selection only; group
    score = sum of top-2 biased scores; non-selected groups masked with -inf;
    top-k on biased scores; weights = unbiased scores / their sum * scale.
  * MoE output = sum_k w_k expert_k(x) + shared_experts(x) (unweighted).
  * experts/MLP: down(silu(gate(x)) * up(x)).
  * MTP: h'_i = eh_proj(cat[enorm(emb(t_{i+1})), hnorm(h_i)]), h_i the main
    model's final-normed hidden state; a full MoE decoder layer; then
    shared_head.norm and shared_head.head, predicting t_{i+2}.
"""
import json
import math
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6  # the official code ignores rms_norm_eps and uses 1e-6


# ----------------------------------------------------------------------------
# config

class Config:
    def __init__(self, d):
        self.d = dict(d)
        self.vocab_size = d["vocab_size"]
        self.hidden_size = d["hidden_size"]
        self.intermediate_size = d["intermediate_size"]
        self.moe_intermediate_size = d["moe_intermediate_size"]
        self.num_hidden_layers = d["num_hidden_layers"]
        self.first_k_dense_replace = d["first_k_dense_replace"]
        self.num_attention_heads = d["num_attention_heads"]
        self.q_lora_rank = d["q_lora_rank"]
        self.kv_lora_rank = d["kv_lora_rank"]
        self.qk_nope_head_dim = d["qk_nope_head_dim"]
        self.qk_rope_head_dim = d["qk_rope_head_dim"]
        self.v_head_dim = d["v_head_dim"]
        self.n_routed_experts = d["n_routed_experts"]
        self.n_shared_experts = d["n_shared_experts"]
        self.num_experts_per_tok = d["num_experts_per_tok"]
        self.n_group = d["n_group"]
        self.topk_group = d["topk_group"]
        self.routed_scaling_factor = d["routed_scaling_factor"]
        self.rope_theta = float(d["rope_theta"])
        self.max_position_embeddings = d["max_position_embeddings"]
        self.num_nextn_predict_layers = d.get("num_nextn_predict_layers", 0)
        assert d.get("scoring_func", "sigmoid") == "sigmoid"
        assert d.get("topk_method", "noaux_tc") == "noaux_tc"
        rs = d.get("rope_scaling")
        # official ModelArgs mapping (fixture README, "ModelArgs from config.json")
        self.max_seq_len = self.max_position_embeddings
        if rs:
            self.original_seq_len = rs["original_max_position_embeddings"]
            self.rope_factor = float(rs["factor"])
            self.beta_fast = rs.get("beta_fast", 32)
            self.beta_slow = rs.get("beta_slow", 1)
            self.mscale = float(rs.get("mscale_all_dim", rs.get("mscale", 1.0)))
        else:
            self.original_seq_len = self.max_seq_len  # => YaRN off
            self.rope_factor = 1.0
            self.beta_fast, self.beta_slow, self.mscale = 32, 1, 1.0

    @staticmethod
    def load(path):
        with open(path) as f:
            return Config(json.load(f))


# ----------------------------------------------------------------------------
# rope (official precompute_freqs_cis, kept as real cos/sin tables)

def rope_tables(cfg, seqlen=None):
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    max_seq_len = cfg.max_seq_len

    def find_correction_dim(num_rotations):
        return dim * math.log(cfg.original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot):
        low = math.floor(find_correction_dim(low_rot))
        high = math.ceil(find_correction_dim(high_rot))
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(lo, hi, n):
        if lo == hi:
            hi += 0.001
        return torch.clamp((torch.arange(n, dtype=torch.float32) - lo) / (hi - lo), 0, 1)

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if max_seq_len > cfg.original_seq_len:
        low, high = find_correction_range(cfg.beta_fast, cfg.beta_slow)
        smooth = 1 - linear_ramp_factor(low, high, dim // 2)
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    n = max_seq_len if seqlen is None else max(seqlen, max_seq_len)
    t = torch.arange(n)
    ang = torch.outer(t, freqs)
    # torch.polar(1, ang) -> (cos, sin), exactly what the official code multiplies by
    fc = torch.polar(torch.ones_like(ang), ang)
    return fc.real.contiguous(), fc.imag.contiguous()


def apply_rope(x, cos, sin):
    """x [..., T, H, d] (or [..., T, d] with cos [T, d/2]) rotated on adjacent pairs."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xs[..., 0], xs[..., 1]
    o0 = x0 * cos - x1 * sin
    o1 = x0 * sin + x1 * cos
    return torch.stack((o0, o1), dim=-1).flatten(-2).to(x.dtype)


def softmax_scale(cfg):
    s = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.max_seq_len > cfg.original_seq_len:
        m = 0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1.0
        s *= m * m
    return s


# ----------------------------------------------------------------------------
# modules (attribute names = HF tensor names)

class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def lin(i, o):
    return nn.Linear(i, o, bias=False)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H = cfg.num_attention_heads
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.q_a_proj = lin(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = lin(cfg.q_lora_rank, H * self.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = lin(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = lin(H * cfg.v_head_dim, cfg.hidden_size)
        self.scale = softmax_scale(cfg)

    def forward(self, x, cos, sin):
        c = self.cfg
        B, T, _ = x.shape
        H = c.num_attention_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:T, None, :], sin[:T, None, :])
        kv = self.kv_a_proj_with_mqa(x)
        kv, k_pe = torch.split(kv, [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe, cos[:T], sin[:T])  # [B, T, r]
        kv = self.kv_b_proj(self.kv_a_layernorm(kv)).view(B, T, H, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = torch.split(kv, [c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        qh = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B,H,T,d]
        kh = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, T, H, c.qk_rope_head_dim)], dim=-1).transpose(1, 2)
        vh = v.transpose(1, 2)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * self.scale
        if T > 1:
            mask = torch.full((T, T), float("-inf"), device=x.device).triu_(1)
            scores = scores + mask
        p = scores.softmax(dim=-1, dtype=torch.float32)
        o = torch.matmul(p, vh).transpose(1, 2).reshape(B, T, H * c.v_head_dim)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, dim, inter):
        super().__init__()
        self.gate_proj = lin(dim, inter)
        self.up_proj = lin(dim, inter)
        self.down_proj = lin(inter, dim)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # not trained by gradient: updated by the aux-loss-free balancing rule
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x):
        """x [N, D] -> (weights [N,k], indices [N,k], scores [N,E] unbiased sigmoid)."""
        c = self.cfg
        N = x.shape[0]
        scores = F.linear(x, self.weight).sigmoid()
        original = scores
        s = scores.detach() + self.e_score_correction_bias
        if c.n_group > 1:
            s = s.view(N, c.n_group, -1)
            group_scores = s.topk(2, dim=-1)[0].sum(dim=-1)
            gidx = group_scores.topk(c.topk_group, dim=-1)[1]
            gmask = torch.ones(N, c.n_group, dtype=torch.bool, device=x.device).scatter_(1, gidx, False)
            s = s.masked_fill(gmask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = s.topk(c.num_experts_per_tok, dim=-1)[1]
        weights = original.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * c.routed_scaling_factor, indices, original


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList([MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                      for _ in range(cfg.n_routed_experts)])
        self.shared_experts = MLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size)
        self.last = None  # (indices, scores) of the last forward, for balancing/stats

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx, scores = self.gate(x)
        self.last = (idx.view(*shape[:-1], -1), scores.view(*shape[:-1], -1))
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts).tolist()
        xs = x.index_select(0, tok)
        # torch.split (not slicing): its backward is one cat, not E full-size adds
        outs = [self.experts[e](xe) for e, xe in enumerate(torch.split(xs, counts)) if counts[e]]
        ys = torch.cat(outs, 0)
        # same product as ys * w[:, None]; the 3-d form avoids a slow broadcast path in torch 1.13
        ys = (ys.unsqueeze(1) * w.reshape(-1).index_select(0, order).view(-1, 1, 1)).squeeze(1)
        y = torch.zeros_like(x).index_add_(0, tok, ys)
        return (y + self.shared_experts(x)).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if layer_id < cfg.first_k_dense_replace else MoE(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size)
        self.head = lin(cfg.hidden_size, cfg.vocab_size)


class MTPLayer(DecoderLayer):
    """model.layers.{num_hidden_layers}: a MoE decoder layer plus the MTP parts.
    embed_tokens / shared_head.head are tied to the main model while training
    and exported as copies (as in the real release)."""

    def __init__(self, cfg):
        super().__init__(cfg, cfg.num_hidden_layers)
        self.enorm = RMSNorm(cfg.hidden_size)
        self.hnorm = RMSNorm(cfg.hidden_size)
        self.eh_proj = lin(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        if cfg.num_nextn_predict_layers:
            assert cfg.num_nextn_predict_layers == 1
            layers.append(MTPLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size)


class DeepseekV3(nn.Module):
    def __init__(self, cfg, tie_mtp=True):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = lin(cfg.hidden_size, cfg.vocab_size)
        self.tie_mtp = tie_mtp
        if cfg.num_nextn_predict_layers and tie_mtp:
            # share embedding and output head with the MTP module (DeepSeek-V3 does)
            mtp = self.mtp_layer()
            mtp.embed_tokens = self.model.embed_tokens
            mtp.shared_head.head = self.lm_head
        elif cfg.num_nextn_predict_layers:
            self.mtp_layer().embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def mtp_layer(self):
        return self.model.layers[self.cfg.num_hidden_layers]

    def moe_layers(self):
        return [l.mlp for l in self.model.layers if isinstance(l.mlp, MoE)]

    def forward(self, tokens, mtp_tokens=None, return_hidden=False):
        """tokens [B,T] -> logits [B,T,V] (row t predicts t+1).
        mtp_tokens [B,T'] (T' <= T): the tokens t_{i+1} fed to the MTP module at
        positions i = 0..T'-1; returns also MTP logits [B,T',V] predicting t_{i+2}."""
        cfg = self.cfg
        T = tokens.shape[1]
        cos, sin = self.rope_cos, self.rope_sin
        if T > cos.shape[0]:
            cos, sin = rope_tables(cfg, T)
        h = self.model.embed_tokens(tokens)
        hidden = [h]
        for i in range(cfg.num_hidden_layers):
            h = self.model.layers[i](h, cos, sin)
            hidden.append(h)
        hn = self.model.norm(h)
        hidden.append(hn)
        logits = self.lm_head(hn)
        out = [logits]
        if mtp_tokens is not None:
            m = self.mtp_layer()
            Tm = mtp_tokens.shape[1]
            e = m.enorm(m.embed_tokens(mtp_tokens))
            x = m.eh_proj(torch.cat([e, m.hnorm(hn[:, :Tm])], dim=-1))
            x = DecoderLayer.forward(m, x, cos, sin)
            out.append(m.shared_head.head(m.shared_head.norm(x)))
        if return_hidden:
            out.append(hidden)
        return out[0] if len(out) == 1 else tuple(out)


# ----------------------------------------------------------------------------
# safetensors (no package needed)

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
DNAMES = {v: k for k, v in DTYPES.items()}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = DTYPES[info["dtype"]]
        buf = bytearray(data[base + a:base + b])
        t = torch.frombuffer(buf, dtype=dt) if len(buf) else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def read_model_dir(d):
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    sd = {}
    for f in files:
        sd.update(read_safetensors(os.path.join(d, f)))
    return sd


def write_safetensors(path, tensors):
    """tensors: ordered dict name -> tensor (already in the wanted dtype)."""
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, t in tensors.items():
        t = t.contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": DNAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_model(d, tie_mtp=False):
    """Build a DeepseekV3 from an HF directory (config.json + *.safetensors), fp32."""
    cfg = Config.load(os.path.join(d, "config.json"))
    model = DeepseekV3(cfg, tie_mtp=tie_mtp)
    sd = {k: v.float() for k, v in read_model_dir(d).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"missing {missing} unexpected {unexpected}")
    model.eval()
    return model
