"""HRM-LM: one shared Transformer block iterated in a static nested loop, with a two-level recurrent state.

    tokens [B, S] -> x = embed(tokens) [B, S, D]
    z_fast, z_slow [B, S, D] start from learned init vectors
    for h in range(H):                      # outer (slow) cycles
        for l in range(L):                  # inner (fast) steps
            z_fast <- gate_fast(z_fast, block(z_fast + z_slow + x + step_emb[t]));  t += 1
        z_slow <- gate_slow(z_slow, block(z_slow + z_fast + step_emb[t]));          t += 1
    logits = head(norm(z_slow))             # head is tied to the embedding

Ablations (ModelConfig): hierarchy=False makes every step a fast step and reads out z_fast (a plain looped
block with input injection); gating=False replaces each gate by z <- block output.

T = H * (L + 1) block applications share ONE block's parameters. Everything except causal attention is
per position, so the memory never leaks later tokens into earlier positions.

forward() picks the positions and the attention mask from the cache, then runs one of three short loops:
    run_layers      arch "transformer": the unshared baseline, n_layers independent blocks
    run_loop        a Python for loop: training and the eager reference; torch.export unrolls it (ExecuTorch)
    run_while_loop  torch._higher_order_ops.while_loop: torch.onnx.export turns it into ONE ONNX `Loop`
                    whose body holds the block once, its weights stored once as body initializers.
With run_loop the step index is a Python int and the fast/slow choice is static (hrm_step). Under while_loop
it is a tensor, so the step embedding is read with index_select (t[i] fails export with a data-dependent-
integer error), the two levels travel as one state [2, B, S, D] and both gates run as one batched gate whose
level mask (1, 0) or (0, 1) updates only the step's level, exactly (stacked_step).

Caches share one interface, update(t, positions, k, v) -> the keys/values block application t attends over:
    NoCache         full sequence (training, the parity reference)
    KVCache         T pairs of in-place buffers [B, H, L, hd]: eager decoding
    StackedKVCache  the ONNX decode graph's past [T, B, H, P, hd] in, present [T, B, H, P + S, hd] out
and hrm_edge.export.executorch adds the ExecuTorch program's cache on its runtime's LLM custom ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops import while_loop

from hrm_edge.config import ModelConfig


class RMSNorm(nn.Module):
    # RMSNorm (not LayerNorm): XNNPACK delegates it, LayerNorm stays on the portable CPU kernels.
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # mean over the last dim as a linear with a constant 1/D row: XNNPACK's mean only takes 4-D inputs
        # reduced over dims (-2, -1), so x.pow(2).mean(-1) on [B, S, D] splits the delegate at every norm.
        self.register_buffer("mean_row", torch.full((1, dim), 1.0 / dim), persistent=False)

    # The ONNX exporter sets this (ONNX opset 23 has RMSNormalization: one node instead of seven)
    as_one_op = False

    def forward(self, x):
        if self.as_one_op:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(F.linear(x * x, self.mean_row) + self.eps) * self.weight


def rope_tables(positions, head_dim: int, theta: float):
    """positions [S] int64 -> cos, sin [S, 1, head_dim] (broadcast over the heads of [B, S, H, hd]),
    computed in the graph (no constant table); each frequency appears twice, once for each half of the
    head (rotate-half RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, hd/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [S, 1, hd]
    return torch.cos(angles), torch.sin(angles)


def rotate_half_matrix(head_dim: int):
    """R [hd, hd] with F.linear(x, R) = cat(-x2, x1): rotate-half as a linear, which XNNPACK delegates
    (with a dynamic sequence length the two slices of the usual form are not delegated)."""
    half = head_dim // 2
    r = torch.zeros(head_dim, head_dim)
    r[torch.arange(half), torch.arange(half) + half] = -1.0  # out[:half] = -x2
    r[torch.arange(half) + half, torch.arange(half)] = 1.0  # out[half:] = x1
    return r


def attention_mask(positions, n_keys: int):
    """Additive float mask [S, n_keys]: 0 where key position <= query position, -inf elsewhere.

    Built once per forward and shared by all T block applications (SDPA's is_causal would rebuild a
    boolean mask in every one, and a boolean mask with an index_copy cache was seen to fail at runtime
    under XNNPACK). Without a cache n_keys = S and this is the causal mask."""
    keys = torch.arange(n_keys, device=positions.device)
    allowed = keys[None, :] <= positions[:, None]  # [S, n_keys]
    return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, float("-inf"))


def apply_rope(x, cos, sin, rot):
    # x [B, S, H, hd]; rotate-half form (no complex numbers, which neither exporter handles):
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) = F.linear(x, rot)
    return x * cos + F.linear(x, rot) * sin


def sdpa(q, k, v, mask):
    """Causal attention: q [B, H, S, hd], k, v [B, H, L, hd], additive mask [S, L] -> [B, H, S, hd].

    Written out rather than F.scaled_dot_product_attention: its decomposition adds a "safe softmax"
    (any/where/logical_not per call) that XNNPACK does not take, breaking the delegate 8 times. 3-D bmm:
    a 4-D matmul decomposes into expand + bmm, and the expands split the XNNPACK delegate."""
    B, H, S, hd = q.shape
    L = k.shape[2]
    q3, k3, v3 = q.reshape(B * H, S, hd), k.reshape(B * H, L, hd), v.reshape(B * H, L, hd)
    scores = torch.bmm(q3, k3.transpose(1, 2)) * (1.0 / math.sqrt(hd)) + mask  # [B*H, S, L]
    return torch.bmm(torch.softmax(scores, dim=-1), v3).view(B, H, S, hd)


def sdpa_parts(q, keys, values, mask):
    """sdpa over keys in parts, the last one this call's new keys (e.g. past [1, B, H, P, hd] and new [1, B, H, S,
    hd]; a part may broadcast over the batch), and values alike, without concatenating them: the scores [1, B, H, S,
    sum of lengths] are concatenated and split instead (S rows, not P). q [B, H, S, hd] -> [1, B, H, S, hd]. Batched
    4-D/5-D matmuls, no reshapes to 3-D: only the ONNX Loop body runs this, where every reshape is one more node per
    iteration (XNNPACK, which wants 3-D bmm, never sees it)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.cat([torch.matmul(q, k.transpose(-1, -2)) for k in keys], dim=-1) * scale + mask
    sizes = [k.shape[-2] for k in keys[:-1]] + [q.shape[2]]  # the last part: this call's S new keys
    probs = torch.split(torch.softmax(scores, dim=-1), sizes, dim=-1)  # [1, B, H, S, L_i] each
    out = torch.matmul(probs[0], values[0])
    for p, v in zip(probs[1:], values[1:]):
        out = out + torch.matmul(p, v)
    return out


# ---- caches: one interface, update(t, positions, k, v) -> (keys, values) of block application t ----
# Every cache also says where this call's tokens sit (positions) and which keys each may see (mask);
# attend() = update + attention. The forward pass is the same for all of them.
class NoCache:
    """Full-sequence forward: the keys are this call's tokens, causally masked."""

    def positions(self, S: int, input_pos=None, device=None):
        return torch.arange(S, device=device)  # [S]

    def mask(self, positions):
        return attention_mask(positions, positions.shape[0])  # [S, S]

    def update(self, t, positions, k, v):
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, hd]

    def attend(self, t, positions, q, k, v, mask):
        """q, k, v [B, S, H, hd] (this call's) -> attention output [B, S, H, hd]."""
        keys, values = self.update(t, positions, k, v)
        return sdpa(q.transpose(1, 2), keys, values, mask).transpose(1, 2)


class KVCache(nn.Module, NoCache):
    """Static caches as buffers, one pair [B, H, L, hd] per block application (each of the T applications
    sees different inputs), written in place: eager decoding. input_pos [1] is the position of the call's
    first token; every key up to L is attended, later ones masked."""

    def __init__(self, cfg: ModelConfig, batch_size: int = 1, n_steps: int | None = None):
        super().__init__()
        shape = (batch_size, cfg.n_heads, cfg.max_seq_len, cfg.head_dim)  # [B, H, L, hd]
        for t in range(n_steps or cfg.n_steps):  # fewer outer cycles (depth dial) need fewer caches
            self.register_buffer(f"k_{t}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_{t}", torch.zeros(shape), persistent=False)

    def positions(self, S: int, input_pos=None, device=None):
        return input_pos + torch.arange(S, device=input_pos.device)  # [S]

    def mask(self, positions):
        return attention_mask(positions, self.k_0.shape[2])  # [S, L]

    def update(self, t: int, positions, k, v):
        k_cache, v_cache = getattr(self, f"k_{t}"), getattr(self, f"v_{t}")
        k_cache.index_copy_(2, positions, k.transpose(1, 2))
        v_cache.index_copy_(2, positions, v.transpose(1, 2))
        return k_cache, v_cache

    def reset(self):
        for b in self.buffers():
            b.zero_()

    def copy_first_cycle(self, positions, steps: range, per_cycle: int):
        """Adaptive depth: a token that exits after the first outer cycle skips applications `steps`; their keys and
        values at positions [S] become those of the same role's first-cycle application t mod per_cycle (what later
        tokens attend to there), copied, not recomputed."""
        for t in steps:
            for name in ("k", "v"):
                first = getattr(self, f"{name}_{t % per_cycle}")
                getattr(self, f"{name}_{t}").index_copy_(2, positions, first.index_select(2, positions))


class StackedKVCache(NoCache):
    """Functional caches of the ONNX decode graph. past_k, past_v [T, B, H, P, hd] are graph inputs, read
    only; each block application t attends over its past plus the new keys, and the new keys/values of
    all T applications are collected in new_k, new_v [T, B, H, S, hd] (carried through the ONNX Loop: S
    rows, not the whole cache; the export turns them into the Loop's scan outputs, slots_as_scan_outputs) and
    appended once after the loop (present). Nothing rewrites the past: rewriting a stacked cache inside every Loop
    iteration was what made decode slow."""

    def __init__(self, past_k, past_v, new_k=None, new_v=None, new_len: int | None = None, first_step: int = 0):
        T, B, H, _, hd = past_k.shape
        self.past_k, self.past_v = past_k, past_v
        self.first_step = first_step  # the block application that slot 0 holds (a verify graph's: L + 1)
        self.new_k = past_k.new_zeros((T, B, H, new_len, hd)) if new_k is None else new_k
        self.new_v = past_v.new_zeros((T, B, H, new_len, hd)) if new_v is None else new_v

    def positions(self, S: int, input_pos=None, device=None):
        return self.past_k.shape[3] + torch.arange(S, device=self.past_k.device)  # [S]: after the past

    def mask(self, positions):
        return attention_mask(positions, self.past_k.shape[3] + positions.shape[0])  # [S, P + S]

    def record(self, t, k, v):
        """Collect block application t's new keys/values k, v [B, S, H, hd]; returns (t1 [1], k, v [1, B, H, S, hd]).
        t: a Python int, or the ONNX Loop counter as an int64 tensor [1] (stacked_step)."""
        # by index_select / index_copy: t is the ONNX Loop counter (t[i] fails export with a
        # data-dependent-integer error)
        t1 = t if torch.is_tensor(t) else torch.tensor([t], device=k.device)
        t1 = t1 - self.first_step if self.first_step else t1  # application -> slot
        k, v = k.transpose(1, 2).unsqueeze(0), v.transpose(1, 2).unsqueeze(0)  # [1, B, H, S, hd]
        self.new_k = self.new_k.index_copy(0, t1, k)
        self.new_v = self.new_v.index_copy(0, t1, v)
        return t1, k, v

    def past(self, t1):
        """Block application t1's past keys and values, [1, B, H, P, hd] each (kept 5-D: a squeeze would be one more
        node per Loop iteration)."""
        return self.past_k.index_select(0, t1), self.past_v.index_select(0, t1)

    def update(self, t, positions, k, v):
        t1, k, v = self.record(t, k, v)
        past_k, past_v = self.past(t1)
        return torch.cat([past_k[0], k[0]], dim=2), torch.cat([past_v[0], v[0]], dim=2)  # [B, H, P + S, hd]

    def attend(self, t, positions, q, k, v, mask):
        """As update + sdpa, without concatenating the past and the new keys: those two [B, H, P, hd] copies per
        block application were 13% of the ONNX int8 decode step at P = 255 (1.94 -> 1.69 ms, measured).
        Returns [1, B, S, H, hd] (Attention.forward reshapes it to [B, S, D])."""
        t1, k, v = self.record(t, k, v)
        past_k, past_v = self.past(t1)
        return sdpa_parts(q.transpose(1, 2), (past_k, k), (past_v, v), mask).transpose(2, 3)

    def carried(self) -> tuple:
        return self.new_k, self.new_v

    def with_carried(self, carried) -> "StackedKVCache":
        return StackedKVCache(self.past_k, self.past_v, *carried, first_step=self.first_step)

    def present(self):
        """(k, v) [T, B, H, P + S, hd]: the past with this call's keys/values appended."""
        return torch.cat([self.past_k, self.new_k], dim=3), torch.cat([self.past_v, self.new_v], dim=3)


class SharedContextCache(StackedKVCache):
    """The branch graph's caches: a context past context_k, context_v [T, 1, H, P, hd] that every batch row reads
    (one copy in, none out), then each row's own past_k, past_v [T, B, H, Q, hd] (the tokens a row has added since,
    a few) and this call's keys. Branches of one context (the suggestion bar's candidate words) so never tile the
    context's cache along the batch axis; the present is the rows' own part, [T, B, H, Q + S, hd]."""

    def __init__(self, context_k, context_v, past_k, past_v, new_k=None, new_v=None, new_len: int | None = None):
        super().__init__(past_k, past_v, new_k, new_v, new_len)
        self.context_k, self.context_v = context_k, context_v

    def positions(self, S: int, input_pos=None, device=None):
        return self.context_k.shape[3] + self.past_k.shape[3] + torch.arange(S, device=self.past_k.device)

    def mask(self, positions):
        return attention_mask(positions, self.context_k.shape[3] + self.past_k.shape[3] + positions.shape[0])

    def attend(self, t, positions, q, k, v, mask):
        """sdpa_parts over the context ([1, 1, H, P, hd], broadcast over the rows), the row's own past and the new
        keys. Returns [1, B, S, H, hd]."""
        t1, k, v = self.record(t, k, v)
        own_k, own_v = self.past(t1)
        keys = (self.context_k.index_select(0, t1), own_k, k)
        values = (self.context_v.index_select(0, t1), own_v, v)
        return sdpa_parts(q.transpose(1, 2), keys, values, mask).transpose(2, 3)

    def with_carried(self, carried) -> "SharedContextCache":
        return SharedContextCache(self.context_k, self.context_v, self.past_k, self.past_v, *carried)


class FirstCycleKeysCache(NoCache):
    """Full-sequence forward with adaptive depth (teacher forcing, all positions at once): keeps the first cycle's
    keys/values (applications 0..L); at a deeper application t the positions in `exited` [B, S] (bool) offer the
    keys/values of application t mod (L + 1) instead of their own, as KVCache.copy_first_cycle leaves them in
    decoding. The first cycle reads no deeper keys, so its states do not depend on which positions exit."""

    def __init__(self, per_cycle: int):
        self.per_cycle = per_cycle
        self.first: dict[int, tuple] = {}
        self.exited = None  # [B, S] bool: set after the first cycle

    def update(self, t, positions, k, v):
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, hd]
        if t < self.per_cycle:
            self.first[t] = (k, v)
            return k, v
        k1, v1 = self.first[t % self.per_cycle]
        exited = self.exited[:, None, :, None]  # [B, 1, S, 1]
        return torch.where(exited, k1, k), torch.where(exited, v1, v)


@dataclass
class StepInputs:
    """What every block application of one forward pass reads: the token embeddings x [B, S, D], RoPE
    tables [S, 1, hd], the attention mask, the positions [S] and the cache."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor
    cache: NoCache


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.register_buffer("rot", rotate_half_matrix(cfg.head_dim), persistent=False)

    def forward(self, x, inp: StepInputs, t):
        B, S, D = x.shape
        # RoPE once on queries and keys side by side: half the rotation ops per block application
        qk = torch.cat([self.wq(x), self.wk(x)], dim=-1).view(B, S, 2 * self.n_heads, self.head_dim)  # [B, S, 2H, hd]
        q, k = apply_rope(qk, inp.cos, inp.sin, self.rot).split(self.n_heads, dim=2)  # [B, S, H, hd] each
        v = self.wv(x).view(B, S, self.n_heads, self.head_dim)
        y = inp.cache.attend(t, inp.positions, q, k, v, inp.mask)  # [B, S, H, hd] (StackedKVCache: [1, B, S, H, hd])
        return self.wo(y.reshape(B, S, D))


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

    def forward(self, x, inp: StepInputs, t):
        h = x + self.attn(self.attn_norm(x), inp, t)
        return h + self.ffn(self.ffn_norm(h))


class Gate(nn.Module):
    """z <- (1 - g) * z + g * update, g = sigmoid(up(silu(down([z, update]))) + bias), per position.

    Low rank (gate_rank) keeps each gate a few percent of the block; the bias sets how eagerly a level
    updates at the start of training (slow level about -2: conservative). dropout (training only) is on
    the gate's input, a regulariser of the seed design."""

    def __init__(self, cfg: ModelConfig, bias_init: float):
        super().__init__()
        self.down = nn.Linear(2 * cfg.d_model, cfg.gate_rank, bias=False)
        self.up = nn.Linear(cfg.gate_rank, cfg.d_model, bias=False)
        self.bias = nn.Parameter(torch.full((cfg.d_model,), float(bias_init)))
        self.dropout = cfg.gate_dropout

    def amount(self, z, update):
        """g [B, S, D]: how much of `update` replaces z."""
        zu = torch.cat([z, update], dim=-1)  # [B, S, 2D]
        if self.training and self.dropout > 0:  # (F.dropout in eval mode still exports as a copy per call)
            zu = F.dropout(zu, self.dropout)
        return torch.sigmoid(self.up(F.silu(self.down(zu))) + self.bias)

    def forward(self, z, update):
        return z + self.amount(z, update) * (update - z)


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
            if cfg.gating:
                self.gate_fast = Gate(cfg, cfg.fast_gate_bias)
                self.gate_slow = Gate(cfg, cfg.slow_gate_bias)
            # [T, 2]: (1, 0) where step t updates the fast level, (0, 1) where the slow one (the last step of
            # each group of L + 1)
            is_slow = [float(self.is_slow_step(t)) for t in range(cfg.n_steps)]
            self.register_buffer("level_mask", torch.tensor([[1.0 - s, s] for s in is_slow]), persistent=False)
        else:
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.norm_eps)
        # None: the head is the embedding table (tied). An exporter may set an nn.Linear sharing that table
        # (untie_head) so that a backend sees the head as a linear layer it can run and quantize.
        self.head: nn.Module | None = None
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
    def is_slow_step(self, t: int) -> bool:
        # the last step of each outer cycle updates the slow level; without hierarchy every step is fast
        return self.cfg.hierarchy and (t + 1) % (self.cfg.L_cycles + 1) == 0

    def update_fast(self, z, update):
        return self.gate_fast(z, update) if self.cfg.gating else update

    def update_slow(self, z, update):
        return self.gate_slow(z, update) if self.cfg.gating else update

    def final_state(self, z_fast, z_slow):
        # the slow level is the model's output; a plain looped block (no hierarchy) has only the fast one
        return z_slow if self.cfg.hierarchy else z_fast

    def readout(self, z):
        # F.linear with the embedding (not z @ W.T): XNNPACK delegates linear, not a transposed matmul.
        z = self.norm(z)
        return F.linear(z, self.embed.weight) if self.head is None else self.head(z)  # [B, S, V]

    def hrm_step(self, t: int, z_fast, z_slow, inp: StepInputs):
        """Block application t (a Python int: the fast/slow choice is static, no graph guard)."""
        step = self.step_emb[t : t + 1]  # [1, D] (a slice, which XNNPACK takes; a select it does not)
        if self.is_slow_step(t):
            return z_fast, self.update_slow(z_slow, self.block(z_slow + z_fast + step, inp, t))
        return self.update_fast(z_fast, self.block(z_fast + z_slow + inp.x + step, inp, t)), z_slow

    def stacked_step(self, t, z, inp: StepInputs):
        """Block application t (0-d int64 tensor: the ONNX Loop counter) on the stacked state z [2, B, S, D]
        (fast, slow). Computes what hrm_step computes, with both levels' gates as one batched gate whose
        level mask on [2], (1, 0) on fast steps and (0, 1) on slow ones, leaves the level that is not updated
        exactly as it was (z + 0 * ...): one set of gate ops per iteration instead of two, no per-level branch.
        (No gate dropout: this form is exported, never trained.) inp.x: [T, B, S, D], what application t adds to
        the summed state (run_while_loop)."""
        t1 = t.reshape(1)  # [1]: what index_select, and the cache's index_copy, take
        on = self.level_mask.index_select(0, t1).reshape(2, 1, 1, 1)  # [2, 1, 1, 1]: which level step t updates
        out = self.block(z.sum(0) + inp.x.index_select(0, t1).squeeze(0), inp, t1)  # [B, S, D]
        if not self.cfg.gating:
            return z + on * (out - z)
        return z + (on * self.stacked_gate_amount(z, out)) * (out - z)

    def stacked_gate_amount(self, z, update):
        """g [2, B, S, D] of the fast and slow gates at once: Gate.amount batched over the two levels."""
        zu = torch.cat([z, update.expand_as(z)], dim=-1)  # [2, B, S, 2D]
        gates = (self.gate_fast, self.gate_slow)
        down = torch.stack([g.down.weight.t() for g in gates])[:, None]  # [2, 1, 2D, r]
        up = torch.stack([g.up.weight.t() for g in gates])[:, None]  # [2, 1, r, D]
        bias = torch.stack([g.bias for g in gates])[:, None, None]  # [2, 1, 1, D]
        return torch.sigmoid(torch.matmul(F.silu(torch.matmul(zu, down)), up) + bias)

    def forward(self, tokens, form: str = "loop", n_cycles: int | None = None, aux: bool = False,
                cache: NoCache | None = None, input_pos=None):
        """tokens [B, S] int64 -> logits [B, S, V] (aux=True: a list, one per outer cycle).

        cache: None (full sequence), a KVCache (in place; input_pos [1] is the position of tokens[:, 0]) or
        a StackedKVCache (functional; read its present() after the call). The recurrent states are per
        position, so a cached call computes only the new tokens' states."""
        inp = self.step_inputs(tokens, NoCache() if cache is None else cache, input_pos)
        if self.cfg.arch == "transformer":
            states = [self.run_layers(inp)]
        else:
            H = self.cfg.H_cycles if n_cycles is None else n_cycles
            if not 1 <= H <= self.cfg.H_cycles:
                raise ValueError(f"n_cycles must be in 1..{self.cfg.H_cycles}, got {H}")
            if form == "loop":
                states = self.run_loop(inp, H, aux)
            elif form == "while_loop":
                z = self.run_while_loop(inp, range(H * (self.cfg.L_cycles + 1)), torch.stack(self.initial_states(inp)))
                states = [self.final_state(z[0], z[1])]
            else:
                raise ValueError(f"unknown iteration form {form!r}")
        logits = [self.readout(z) for z in states]
        return logits if aux else logits[-1]

    def run_layers(self, inp: StepInputs):
        """The unshared baseline: n_layers independent blocks, each with its own cache slot t."""
        x = inp.x
        for t, block in enumerate(self.blocks):
            x = block(x, inp, t)
        return x

    def initial_states(self, inp: StepInputs):
        B, S, _ = inp.x.shape
        return self.z_fast_init.expand(B, S, -1), self.z_slow_init.expand(B, S, -1)  # [B, S, D] each

    def step_inputs(self, tokens, cache: NoCache, input_pos=None) -> StepInputs:
        """What every block application of a call on tokens [B, S] reads (the cache decides the positions)."""
        positions = cache.positions(tokens.shape[1], input_pos, tokens.device)  # [S]
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)  # [S, 1, hd]
        return StepInputs(self.embed(tokens), cos, sin, cache.mask(positions), positions, cache)

    def run_loop(self, inp: StepInputs, H: int, aux: bool) -> list:
        """H outer cycles as a Python loop (training, the eager reference; torch.export unrolls it).
        Returns the output state after every outer cycle (aux) or after the last one."""
        z_fast, z_slow = self.initial_states(inp)
        per_cycle = self.cfg.L_cycles + 1
        states = []
        for h in range(H):
            z_fast, z_slow = self.run_steps(inp, (z_fast, z_slow), range(h * per_cycle, (h + 1) * per_cycle))
            if aux:
                states.append(self.final_state(z_fast, z_slow))
        return states if aux else [self.final_state(z_fast, z_slow)]

    def run_steps(self, inp: StepInputs, states: tuple, steps: range) -> tuple:
        """Block applications `steps` (Python ints) from states (z_fast, z_slow) [B, S, D] each: a slice of the
        static loop. Self-speculative decoding runs the first outer cycle as the draft and the rest as the
        verification, continuing from the draft's own cycle-1 states."""
        z_fast, z_slow = states
        for t in steps:
            z_fast, z_slow = self.hrm_step(t, z_fast, z_slow, inp)
        return z_fast, z_slow

    def run_while_loop(self, inp: StepInputs, steps: range, z):
        """Block applications `steps` from the stacked state z [2, B, S, D] (fast, slow) as torch's while_loop:
        torch.onnx.export makes it ONE ONNX Loop whose body holds the block once (stacked_step); a functional
        cache's collected keys/values ride along as loop-carried values. Returns the final stacked state."""
        carried = inp.cache.carried() if isinstance(inp.cache, StackedKVCache) else ()
        # what each application adds to the summed state, [T, B, S, D]: x on fast steps, plus the step embedding
        # (computed once per call, not in every Loop iteration)
        inp = replace(inp, x=self.level_mask[:, 0, None, None, None] * inp.x + self.step_emb[:, None, None, :])

        def body(t, z, *carried):
            cache = inp.cache.with_carried(carried) if carried else inp.cache
            z = self.stacked_step(t, z, replace(inp, cache=cache))
            return (t + 1, z, *(cache.carried() if carried else ()))

        t0 = torch.full((), steps.start, dtype=torch.int64, device=inp.x.device)
        # carries must not alias the tensors they start from (parameters, graph inputs): clone them
        start = (t0, z.clone(), *(c.clone() for c in carried))
        out = while_loop(lambda t, *_: t < steps.stop, body, start)
        if carried:
            inp.cache.new_k, inp.cache.new_v = out[2], out[3]
        return out[1]  # [2, B, S, D]

    def loss(self, tokens, targets, n_cycles: int | None = None):
        """Mean next-token cross entropy of the final readout, plus aux_loss_weight x the earlier ones.
        n_cycles: run only this many outer cycles (a curriculum over iterations trains shallow first)."""
        H = self.cfg.H_cycles if n_cycles is None else n_cycles
        aux = self.cfg.arch == "hrm" and self.cfg.aux_loss_weight > 0 and H > 1
        if not aux:
            logits = self(tokens, n_cycles=n_cycles)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits
        readouts = self(tokens, aux=True, n_cycles=n_cycles)
        losses = [F.cross_entropy(r.flatten(0, 1), targets.flatten()) for r in readouts]
        total = losses[-1] + self.cfg.aux_loss_weight * sum(losses[:-1]) / (len(losses) - 1)
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


def cache_steps(cfg: ModelConfig, n_cycles: int | None) -> int:
    """Block applications (= cache slots) of a forward pass with n_cycles outer cycles (None: all)."""
    if n_cycles is None or cfg.arch != "hrm":
        return cfg.n_steps
    return n_cycles * (cfg.L_cycles + 1)


def empty_cache(cfg: ModelConfig, batch_size: int = 1, n_cycles: int | None = None):
    """The ONNX decode graph's past before the first call: k, v [T, B, H, 0, hd] (no tokens yet)."""
    shape = (cache_steps(cfg, n_cycles), batch_size, cfg.n_heads, 0, cfg.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


class DecodeForm(nn.Module):
    """(tokens [1, S], input_pos [1]) -> logits [1, S, V] with the KV cache as in-place buffers: the
    ExecuTorch program of the LLM runner, and the eager KV-cache model (prefill S > 1, decode S = 1).
    n_cycles: outer cycles to run (depth dial; None = all). cache: the cache module (default KVCache; the
    ExecuTorch exporter passes one on its runtime's cache ops)."""

    def __init__(self, model: HRMLM, batch_size: int = 1, n_cycles: int | None = None, cache: nn.Module | None = None):
        super().__init__()
        self.model, self.n_cycles = model, n_cycles
        self.cache = cache if cache is not None else KVCache(model.cfg, batch_size, cache_steps(model.cfg, n_cycles))

    def forward(self, tokens, input_pos):
        return self.model(tokens, form="loop", n_cycles=self.n_cycles, input_pos=input_pos, cache=self.cache)


class FunctionalDecodeForm(nn.Module):
    """(tokens [B, S], past_k, past_v [T, B, H, P, hd]) -> (logits [B, S, V], present_k, present_v
    [T, B, H, P + S, hd]): the ONNX decode graph (the position of tokens[:, 0] is P); HRM iteration as an
    ONNX Loop. Prefill is a call with P = 0."""

    def __init__(self, model: HRMLM, n_cycles: int | None = None):
        super().__init__()
        self.model, self.n_cycles = model, n_cycles
        self.form = "while_loop" if model.cfg.arch == "hrm" else "loop"

    def forward(self, tokens, past_k, past_v):
        cache = StackedKVCache(past_k, past_v, new_len=tokens.shape[1])
        logits = self.model(tokens, form=self.form, n_cycles=self.n_cycles, cache=cache)
        return (logits, *cache.present())


class DraftForm(nn.Module):
    """(tokens [B, S], past_k, past_v [L + 1, B, H, P, hd]) -> (logits [B, S, V] of the first outer cycle's readout,
    state [2, B, S, D] after it (fast, slow), present_k, present_v [L + 1, B, H, P + S, hd]): the draft of
    self-speculative decoding (hrm_edge.runtime.speculative); its caches are the full model's first L + 1."""

    def __init__(self, model: HRMLM):
        super().__init__()
        self.model, self.steps = model, range(model.cfg.L_cycles + 1)

    def forward(self, tokens, past_k, past_v):
        m = self.model
        cache = StackedKVCache(past_k, past_v, new_len=tokens.shape[1])
        inp = m.step_inputs(tokens, cache)
        z = m.run_while_loop(inp, self.steps, torch.stack(m.initial_states(inp)))
        return (m.readout(m.final_state(z[0], z[1])), z, *cache.present())


class BranchForm(nn.Module):
    """(tokens [B, S], context_k, context_v [L + 1, 1, H, P, hd], past_k, past_v [L + 1, B, H, Q, hd]) -> (logits
    [B, S, V] of the first outer cycle's readout, present_k, present_v [L + 1, B, H, Q + S, hd]): DraftForm for B
    branches of one context (SharedContextCache), each row with its own past since the context. The suggestion
    bar's chains (hrm_edge.runtime.suggest) extend with it; the logits are DraftForm's on the context's past tiled
    B times and concatenated with each row's own."""

    def __init__(self, model: HRMLM):
        super().__init__()
        self.model, self.steps = model, range(model.cfg.L_cycles + 1)

    def forward(self, tokens, context_k, context_v, past_k, past_v):
        m = self.model
        cache = SharedContextCache(context_k, context_v, past_k, past_v, new_len=tokens.shape[1])
        inp = m.step_inputs(tokens, cache)
        z = m.run_while_loop(inp, self.steps, torch.stack(m.initial_states(inp)))
        return (m.readout(m.final_state(z[0], z[1])), *cache.present())


class VerifyForm(nn.Module):
    """(tokens [B, S], state [2, B, S, D] from DraftForm, past_k, past_v [T - L - 1, B, H, P, hd]) -> (logits
    [B, S, V] of the full depth, present_k, present_v [T - L - 1, B, H, P + S, hd]): block applications
    L + 1 .. T - 1 continuing from the drafts' cycle-1 states, all drafted positions in one call."""

    def __init__(self, model: HRMLM):
        super().__init__()
        self.model, self.steps = model, range(model.cfg.L_cycles + 1, model.cfg.n_steps)

    def forward(self, tokens, state, past_k, past_v):
        m = self.model
        cache = StackedKVCache(past_k, past_v, new_len=tokens.shape[1], first_step=self.steps.start)
        z = m.run_while_loop(m.step_inputs(tokens, cache), self.steps, state)
        return (m.readout(m.final_state(z[0], z[1])), *cache.present())


class CachedDraftForm(nn.Module):
    """(tokens [1, S], input_pos [1]) -> (logits [1, S, V] of the first outer cycle's readout, state [2, 1, S, D]
    after it (fast, slow)): DraftForm over an in-place cache (KVCache, or the ExecuTorch program's), writing
    block applications 0..L's slots at input_pos. The ExecuTorch program's "draft" method."""

    def __init__(self, model: HRMLM, cache: nn.Module):
        super().__init__()
        self.model, self.cache, self.steps = model, cache, range(model.cfg.L_cycles + 1)

    def forward(self, tokens, input_pos):
        m = self.model
        inp = m.step_inputs(tokens, self.cache, input_pos)
        z_fast, z_slow = m.run_steps(inp, m.initial_states(inp), self.steps)
        return m.readout(m.final_state(z_fast, z_slow)), torch.stack([z_fast, z_slow])


class CachedVerifyForm(nn.Module):
    """(tokens [1, S], state [2, 1, S, D] from CachedDraftForm, input_pos [1]) -> full-depth logits [1, S, V]:
    VerifyForm over an in-place cache, writing block applications L + 1 .. T - 1's slots at input_pos. The
    ExecuTorch program's "verify" method."""

    def __init__(self, model: HRMLM, cache: nn.Module):
        super().__init__()
        self.model, self.cache = model, cache
        self.steps = range(model.cfg.L_cycles + 1, model.cfg.n_steps)

    def forward(self, tokens, state, input_pos):
        m = self.model
        inp = m.step_inputs(tokens, self.cache, input_pos)
        return m.readout(m.final_state(*m.run_steps(inp, (state[0], state[1]), self.steps)))


class CachedSkipForm(nn.Module):
    """input_pos [1] -> input_pos [1]: the position input_pos exits after the first outer cycle (adaptive depth), so
    its slots of block applications L + 1 .. T - 1 take the same role's first-cycle keys/values
    (cache.copy_first_cycle). The ExecuTorch program's "skip" method (a method must return a tensor)."""

    def __init__(self, model: HRMLM, cache: nn.Module):
        super().__init__()
        self.cache, self.per_cycle = cache, model.cfg.L_cycles + 1
        self.steps = range(self.per_cycle, model.cfg.n_steps)

    def forward(self, input_pos):
        self.cache.copy_first_cycle(input_pos, self.steps, self.per_cycle)
        return input_pos + 0  # a fresh tensor: returning an input as is, ExecuTorch's emitter sees no output


# ---- adaptive depth: a token may exit after the first outer cycle ----
class HaltingHead(nn.Module):
    """Exit logit [B, S] of a position after the first outer cycle: a linear layer on its normalised state norm(z)
    [B, S, D] plus two confidences of that cycle's readout (top log-probability, entropy), which a linear function of
    the state cannot express. Trained on a frozen model (hrm_edge.train.halting); stored apart from the model's
    weights (HALTING_WEIGHTS in the checkpoint folder), so the model and its exports do not change."""

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model + 2, 1)

    @staticmethod
    def features(z_normed, logits):
        """z_normed [B, S, D], logits [B, S, V] -> [B, S, D + 2]."""
        logp = F.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
        return torch.cat([z_normed, logp.amax(-1, keepdim=True), entropy], dim=-1)

    def forward(self, z_normed, logits):
        return self.proj(self.features(z_normed, logits)).squeeze(-1)  # [B, S]


@dataclass
class HaltingRule:
    """A token exits after the first outer cycle when its score >= threshold: the top probability of the first
    cycle's readout (head None) or the halting head's sigmoid. A threshold above 1 exits nothing."""

    threshold: float
    head: HaltingHead | None = None

    @property
    def name(self) -> str:
        return "top_prob" if self.head is None else "halting_head"

    def scores(self, model: HRMLM, z, logits):
        """z [B, S, D] (the first cycle's output state), logits [B, S, V] (its readout) -> [B, S] in [0, 1]."""
        if self.head is None:
            return F.softmax(logits.float(), dim=-1).amax(-1)
        return torch.sigmoid(self.head(model.norm(z), logits))

    def exits(self, model: HRMLM, z, logits):
        return self.scores(model, z, logits) >= self.threshold  # [B, S] bool


@dataclass
class FirstCycle:
    """All positions' first outer cycle (teacher forcing): what every exit decision needs, computed once."""

    inp: StepInputs  # its cache: a FirstCycleKeysCache holding the first cycle's keys/values
    states: tuple  # (z_fast, z_slow) [B, S, D] each
    logits: torch.Tensor  # [B, S, V]: the first cycle's readout

    def output_state(self, model: HRMLM):
        return model.final_state(*self.states)  # [B, S, D]


def check_adaptive(cfg: ModelConfig) -> None:
    if cfg.arch != "hrm" or cfg.H_cycles < 2:
        raise ValueError("adaptive depth needs an HRM with H_cycles >= 2")


def run_first_cycle(model: HRMLM, tokens) -> FirstCycle:
    """tokens [B, S] -> the first outer cycle of every position, its keys/values kept for adaptive_logits."""
    check_adaptive(model.cfg)
    per_cycle = model.cfg.L_cycles + 1
    inp = model.step_inputs(tokens, FirstCycleKeysCache(per_cycle))
    states = model.run_steps(inp, model.initial_states(inp), range(per_cycle))
    return FirstCycle(inp, states, model.readout(model.final_state(*states)))


def adaptive_logits(model: HRMLM, first: FirstCycle, exited):
    """Logits [B, S, V] when the positions in exited [B, S] (bool) stop after the first cycle (their readout) and the
    rest run every cycle, attending to the exited positions' first-cycle keys/values at the applications those
    skipped: exactly what token-by-token adaptive decoding computes, for all positions in one pass."""
    first.inp.cache.exited = exited
    steps = range(model.cfg.L_cycles + 1, model.cfg.n_steps)
    deep = model.readout(model.final_state(*model.run_steps(first.inp, first.states, steps)))
    return torch.where(exited[..., None], first.logits, deep)


def adaptive_forward(model: HRMLM, tokens, rule: HaltingRule, prefix: int = 0):
    """tokens [B, S] -> (logits [B, S, V], depth [B, S] in outer cycles) of adaptive depth under `rule`; the first
    `prefix` positions run every cycle (a prefill)."""
    first = run_first_cycle(model, tokens)
    exited = rule.exits(model, first.output_state(model), first.logits)
    exited[:, :prefix] = False
    depth = torch.where(exited, 1, model.cfg.H_cycles)
    return adaptive_logits(model, first, exited), depth


class TracedForm(nn.Module):
    """tokens -> logits in one iteration form: the thing an exporter traces."""

    def __init__(self, model: HRMLM, form: str, n_cycles: int | None = None):
        super().__init__()
        self.model, self.form, self.n_cycles = model, form, n_cycles

    def forward(self, tokens):
        return self.model(tokens, form=self.form, n_cycles=self.n_cycles)
