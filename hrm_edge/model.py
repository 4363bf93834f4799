"""HRM-LM: one shared Transformer block iterated in a static nested loop, with a two-level recurrent state.

    tokens [B, S] -> x = embed(tokens) [B, S, D]
    z_fast, z_slow [B, S, D] start from learned init vectors
    for h in range(H):                      # outer (slow) cycles
        for l in range(L):                  # inner (fast) steps
            z_fast <- gate_fast(z_fast, block(z_fast + z_slow + x + step_emb[t]));  t += 1
        z_slow <- gate_slow(z_slow, block(z_slow + z_fast + step_emb[t]));          t += 1
    logits = head(norm(z_slow))             # head is tied to the embedding

T = H * (L + 1) block applications share ONE block's parameters. Everything except causal attention is
per position, so the memory never leaks later tokens into earlier positions.

The iteration form is picked at trace time, the parameters are the same:
    "loop"        a Python for loop: training and the eager reference; torch.export unrolls it (ExecuTorch)
    "while_loop"  torch._higher_order_ops.while_loop: torch.onnx.export turns it into ONE ONNX `Loop`
                  whose body holds the block once and reads the weights from the outer graph.
With "loop" the step index is a Python int and the fast/slow choice is static. Under while_loop it is a
tensor, so the step embedding is read with index_select (t[i] fails export with a data-dependent-integer
error) and the fast/slow choice is a 0/1 blend, which is exact for s in {0, 1}.

arch == "transformer" is the unshared baseline: n_layers independent blocks of the same class.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hrm_edge.config import ModelConfig


class RMSNorm(nn.Module):
    # RMSNorm (not LayerNorm): XNNPACK delegates it, LayerNorm stays on the portable CPU kernels.
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None):
    """cos, sin [S, head_dim/2], computed from positions (no constant table in the artifacts)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = pos[:, None] * inv_freq[None, :]  # [S, hd/2]
    return torch.cos(angles), torch.sin(angles)


def causal_mask(seq_len: int, device=None):
    """Additive float mask [S, S]: 0 on and below the diagonal, -inf above. Built once per forward and
    shared by all T block applications (SDPA's is_causal would rebuild a boolean mask in every one, and
    a boolean mask was seen to fail at runtime under XNNPACK with a KV cache)."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return torch.zeros(seq_len, seq_len, device=device).masked_fill(~allowed, float("-inf"))


def apply_rope(x, cos, sin):
    # x [B, H, S, hd]; rotate-half form: no complex numbers, which neither exporter handles.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [B, H, S, hd/2] each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, mask):
        B, S, D = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, S, hd]
        k = self.wk(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Written out rather than F.scaled_dot_product_attention: its decomposition adds a "safe softmax"
        # (any/where/logical_not per call) that XNNPACK does not take, breaking the delegate 8 times.
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim)) + mask  # [B, H, S, S]
        y = torch.softmax(scores, dim=-1) @ v  # [B, H, S, hd]
        return self.wo(y.transpose(1, 2).reshape(B, S, D))


class FeedForward(nn.Module):
    # SwiGLU, no biases.
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, mask):
        h = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return h + self.ffn(self.ffn_norm(h))


class Gate(nn.Module):
    """z <- (1 - g) * z + g * update, g = sigmoid(up(silu(down([z, update]))) + bias), per position.

    Low rank (gate_rank) keeps each gate a few percent of the block; the bias sets how eagerly a level
    updates at the start of training (slow level about -2: conservative)."""

    def __init__(self, cfg: ModelConfig, bias_init: float):
        super().__init__()
        self.down = nn.Linear(2 * cfg.d_model, cfg.gate_rank, bias=False)
        self.up = nn.Linear(cfg.gate_rank, cfg.d_model, bias=False)
        self.bias = nn.Parameter(torch.full((cfg.d_model,), float(bias_init)))

    def forward(self, z, update):
        g = torch.sigmoid(self.up(F.silu(self.down(torch.cat([z, update], dim=-1)))) + self.bias)
        return z + g * (update - z)


class HRMLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, D)
        if cfg.arch == "hrm":
            self.block = Block(cfg)  # the ONE shared block
            self.z_fast_init = nn.Parameter(torch.zeros(D))
            self.z_slow_init = nn.Parameter(torch.zeros(D))
            self.step_emb = nn.Parameter(torch.zeros(cfg.n_steps, D))  # [T, D]
            self.gate_fast = Gate(cfg, cfg.fast_gate_bias)
            self.gate_slow = Gate(cfg, cfg.slow_gate_bias)
            # 1.0 where step t is a slow step (the last of each group of L + 1), [T]
            is_slow = [float((t + 1) % (cfg.L_cycles + 1) == 0) for t in range(cfg.n_steps)]
            self.register_buffer("slow_step_mask", torch.tensor(is_slow), persistent=False)
        else:
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.norm_eps)
        self.reset_parameters()

    def reset_parameters(self):
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith(("wo.weight", "w_down.weight")):  # residual projections, GPT-2 style
                    std = 0.02 / math.sqrt(2 * self.cfg.n_steps)
                nn.init.normal_(p, mean=0.0, std=std)
        if self.cfg.arch == "hrm":
            nn.init.normal_(self.z_fast_init, std=0.02)
            nn.init.normal_(self.z_slow_init, std=0.02)
            nn.init.normal_(self.step_emb, std=0.02)
            if not self.cfg.use_step_embedding:
                self.step_emb.data.zero_()
                self.step_emb.requires_grad_(False)

    # ---- pieces shared by every iteration form ----
    def readout(self, z):
        # F.linear with the embedding (not z @ W.T): XNNPACK delegates linear, not a transposed matmul.
        return F.linear(self.norm(z), self.embed.weight)  # [B, S, V]

    def hrm_step(self, t, x, z_fast, z_slow, cos, sin, mask):
        """One block application. t: Python int (static fast/slow choice) or 0-d int64 tensor (blend)."""
        if isinstance(t, int):
            step = self.step_emb[t]  # [D]
            if (t + 1) % (self.cfg.L_cycles + 1) == 0:  # slow step (a Python test: no graph guard)
                return z_fast, self.gate_slow(z_slow, self.block(z_slow + z_fast + step, cos, sin, mask))
            return self.gate_fast(z_fast, self.block(z_fast + z_slow + x + step, cos, sin, mask)), z_slow
        t1 = t.reshape(1)
        step = self.step_emb.index_select(0, t1)  # [1, D]
        s = self.slow_step_mask.index_select(0, t1)  # [1]: 1.0 on slow steps
        out = self.block(z_fast + z_slow + (1.0 - s) * x + step, cos, sin, mask)
        z_fast_next = z_fast + (1.0 - s) * (self.gate_fast(z_fast, out) - z_fast)
        z_slow_next = z_slow + s * (self.gate_slow(z_slow, out) - z_slow)
        return z_fast_next, z_slow_next

    def forward(self, tokens, form: str = "loop", n_cycles: int | None = None, aux: bool = False):
        """tokens [B, S] int64 -> logits [B, S, V] (with aux=True: a list, one per outer cycle)."""
        B, S = tokens.shape
        cfg = self.cfg
        x = self.embed(tokens)  # [B, S, D]
        cos, sin = rope_tables(S, cfg.head_dim, cfg.rope_theta, x.device)  # [S, hd/2] each
        mask = causal_mask(S, x.device)  # [S, S]
        if cfg.arch == "transformer":
            for block in self.blocks:
                x = block(x, cos, sin, mask)
            logits = self.readout(x)
            return [logits] if aux else logits

        H = cfg.H_cycles if n_cycles is None else n_cycles
        if not 1 <= H <= cfg.H_cycles:
            raise ValueError(f"n_cycles must be in 1..{cfg.H_cycles}, got {H}")
        z_fast = self.z_fast_init.expand(B, S, -1)
        z_slow = self.z_slow_init.expand(B, S, -1)
        per_cycle = cfg.L_cycles + 1

        if form == "loop":
            readouts = []
            for t in range(H * per_cycle):
                z_fast, z_slow = self.hrm_step(t, x, z_fast, z_slow, cos, sin, mask)
                if aux and (t + 1) % per_cycle == 0:
                    readouts.append(self.readout(z_slow))
            return readouts if aux else self.readout(z_slow)

        if form == "while_loop":
            from torch._higher_order_ops import while_loop

            n_steps = H * per_cycle

            def cond_fn(t, z_fast, z_slow):
                return t < n_steps

            def body_fn(t, z_fast, z_slow):
                z_fast, z_slow = self.hrm_step(t, x, z_fast, z_slow, cos, sin, mask)
                return t + 1, z_fast, z_slow

            t0 = torch.zeros((), dtype=torch.int64, device=x.device)
            # carries must not alias the parameters they start from: clone the expanded init states
            _, z_fast, z_slow = while_loop(cond_fn, body_fn, (t0, z_fast.clone(), z_slow.clone()))
            return self.readout(z_slow)

        raise ValueError(f"unknown iteration form {form!r}")

    def loss(self, tokens, targets):
        """Mean next-token cross entropy of the final readout, plus aux_loss_weight x the earlier ones."""
        aux = self.cfg.arch == "hrm" and self.cfg.aux_loss_weight > 0 and self.cfg.H_cycles > 1
        if not aux:
            logits = self(tokens)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits
        readouts = self(tokens, aux=True)
        losses = [F.cross_entropy(r.flatten(0, 1), targets.flatten()) for r in readouts]
        main = losses[-1]
        total = main + self.cfg.aux_loss_weight * sum(losses[:-1]) / (len(losses) - 1)
        return total, readouts[-1]


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(total, unique): total counts a parameter once per block application, unique once."""
    unique = sum(p.numel() for p in model.parameters())
    total = unique
    if model.cfg.arch == "hrm":
        total += (model.cfg.n_steps - 1) * sum(p.numel() for p in model.block.parameters())
    return total, unique


def unique_weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class TracedForm(nn.Module):
    """tokens -> logits in one iteration form: the thing an exporter traces."""

    def __init__(self, model: HRMLM, form: str, n_cycles: int | None = None):
        super().__init__()
        self.model, self.form, self.n_cycles = model, form, n_cycles

    def forward(self, tokens):
        return self.model(tokens, form=self.form, n_cycles=self.n_cycles)
