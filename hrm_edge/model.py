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
        # mean over the last dim as a linear with a constant 1/D row: XNNPACK's mean only takes 4-D inputs
        # reduced over dims (-2, -1), so x.pow(2).mean(-1) on [B, S, D] splits the delegate at every norm.
        self.register_buffer("mean_row", torch.full((1, dim), 1.0 / dim), persistent=False)

    def forward(self, x):
        return x * torch.rsqrt(F.linear(x * x, self.mean_row) + self.eps) * self.weight


def rope_tables(positions, head_dim: int, theta: float):
    """positions [S] int64 -> cos, sin [S, head_dim], computed in the graph (no constant table); each
    frequency appears twice, once for each half of the head (rotate-half RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, hd]
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
    # x [B, H, S, hd]; rotate-half form (no complex numbers, which neither exporter handles):
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) = F.linear(x, rot)
    return x * cos + F.linear(x, rot) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.register_buffer("rot", rotate_half_matrix(cfg.head_dim), persistent=False)

    def forward(self, x, cos, sin, mask, kv=None):
        """kv: None (keys = this call's tokens) or a function (k, v) -> (k_all, v_all) that writes this
        call's keys/values into this block application's cache and returns the cache [B, H, L, hd]."""
        B, S, D = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, S, hd]
        k = self.wk(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.rot), apply_rope(k, cos, sin, self.rot)
        if kv is not None:
            k, v = kv(k, v)  # [B, H, L, hd]
        # Written out rather than F.scaled_dot_product_attention: its decomposition adds a "safe softmax"
        # (any/where/logical_not per call) that XNNPACK does not take, breaking the delegate 8 times.
        # 3-D bmm: a 4-D matmul decomposes into expand + bmm, and the expands split the XNNPACK delegate
        L = k.shape[2]
        q3, k3, v3 = q.reshape(B * self.n_heads, S, self.head_dim), k.reshape(B * self.n_heads, L, self.head_dim), \
            v.reshape(B * self.n_heads, L, self.head_dim)
        scores = torch.bmm(q3, k3.transpose(1, 2)) * (1.0 / math.sqrt(self.head_dim)) + mask  # [B*H, S, L]
        y = torch.bmm(torch.softmax(scores, dim=-1), v3).view(B, self.n_heads, S, self.head_dim)  # [B, H, S, hd]
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

    def forward(self, x, cos, sin, mask, kv=None):
        h = x + self.attn(self.attn_norm(x), cos, sin, mask, kv)
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
            if cfg.gating:
                self.gate_fast = Gate(cfg, cfg.fast_gate_bias)
                self.gate_slow = Gate(cfg, cfg.slow_gate_bias)
            # 1.0 where step t is a slow step (the last of each group of L + 1), [T]
            is_slow = [float(self.is_slow_step(t)) for t in range(cfg.n_steps)]
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
        return F.linear(self.norm(z), self.embed.weight)  # [B, S, V]

    def hrm_step(self, t, x, z_fast, z_slow, cos, sin, mask, kv=None):
        """One block application. t: Python int (static fast/slow choice) or 0-d int64 tensor (blend)."""
        if isinstance(t, int):
            step = self.step_emb[t : t + 1]  # [1, D] (a slice, which XNNPACK takes; a select it does not)
            if self.is_slow_step(t):  # a Python test: no graph guard
                return z_fast, self.update_slow(z_slow, self.block(z_slow + z_fast + step, cos, sin, mask, kv))
            return self.update_fast(z_fast, self.block(z_fast + z_slow + x + step, cos, sin, mask, kv)), z_slow
        t1 = t.reshape(1)
        step = self.step_emb.index_select(0, t1)  # [1, D]
        s = self.slow_step_mask.index_select(0, t1)  # [1]: 1.0 on slow steps
        out = self.block(z_fast + z_slow + (1.0 - s) * x + step, cos, sin, mask, kv)
        z_fast_next = z_fast + (1.0 - s) * (self.update_fast(z_fast, out) - z_fast)
        z_slow_next = z_slow + s * (self.update_slow(z_slow, out) - z_slow)
        return z_fast_next, z_slow_next

    def forward(self, tokens, form: str = "loop", n_cycles: int | None = None, aux: bool = False,
                input_pos=None, cache=None):
        """tokens [B, S] int64 -> logits [B, S, V] (with aux=True: a list, one per outer cycle).

        Decoding with a KV cache (one cache per block application: each of the T applications sees
        different inputs): input_pos [1] int64 is the position of tokens[:, 0]; cache is a KVCache
        (updated in place; form "loop") or a tuple (k, v) of [T, B, H, L, hd] tensors (functional;
        then the updated tuple is returned after the logits). The recurrent states are per position,
        so only the new tokens' states are computed."""
        B, S = tokens.shape
        cfg = self.cfg
        x = self.embed(tokens)  # [B, S, D]
        if cache is None:
            positions = torch.arange(S, device=x.device)  # [S]
            n_keys = S
        else:
            positions = input_pos + torch.arange(S, device=x.device)  # [S]
            n_keys = cfg.max_seq_len
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)  # [S, hd] each
        mask = attention_mask(positions, n_keys)  # [S, n_keys]
        functional = isinstance(cache, tuple)
        caches = list(cache) if functional else None  # [k_stack, v_stack], replaced as steps write

        def kv_for(t, caches=caches):
            """The cache writer of block application t (Python int or 0-d tensor). A functional cache is
            the list `caches` = [k_stack, v_stack], whose entries the writer replaces."""
            if cache is None:
                return None
            if not functional:
                return lambda k, v: cache.update(t, positions, k, v)

            def write(k, v):
                # functional update of slice t: index_select / index_copy by the loop counter (t[i] fails
                # ONNX export inside while_loop with a data-dependent-integer error)
                t1 = t.reshape(1) if torch.is_tensor(t) else torch.tensor([t], device=k.device)
                out = []
                for i, new in enumerate((k, v)):
                    step_cache = caches[i].index_select(0, t1).squeeze(0).index_copy(2, positions, new)  # [B, H, L, hd]
                    caches[i] = caches[i].index_copy(0, t1, step_cache.unsqueeze(0))
                    out.append(step_cache)
                return out[0], out[1]
            return write

        if cfg.arch == "transformer":
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, mask, kv_for(i))
            logits = self.readout(x)
            if functional:
                return logits, caches[0], caches[1]
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
                z_fast, z_slow = self.hrm_step(t, x, z_fast, z_slow, cos, sin, mask, kv_for(t))
                if aux and (t + 1) % per_cycle == 0:
                    readouts.append(self.readout(self.final_state(z_fast, z_slow)))
            if aux:
                return readouts
            logits = self.readout(self.final_state(z_fast, z_slow))
            return (logits, caches[0], caches[1]) if functional else logits

        if form == "while_loop":
            from torch._higher_order_ops import while_loop

            n_steps = H * per_cycle
            t0 = torch.zeros((), dtype=torch.int64, device=x.device)
            # carries must not alias the parameters they start from: clone the expanded init states
            if not functional:
                if cache is not None:
                    raise ValueError("while_loop takes a functional (tuple) cache")

                def body_fn(t, z_fast, z_slow):
                    z_fast, z_slow = self.hrm_step(t, x, z_fast, z_slow, cos, sin, mask)
                    return t + 1, z_fast, z_slow

                _, z_fast, z_slow = while_loop(lambda t, *_: t < n_steps, body_fn, (t0, z_fast.clone(), z_slow.clone()))
                return self.readout(self.final_state(z_fast, z_slow))

            def body_fn(t, z_fast, z_slow, k_stack, v_stack):
                stacks = [k_stack, v_stack]  # local to the body: a while_loop body must not mutate outer state
                z_fast, z_slow = self.hrm_step(t, x, z_fast, z_slow, cos, sin, mask, kv_for(t, stacks))
                return t + 1, z_fast, z_slow, stacks[0], stacks[1]

            _, z_fast, z_slow, k_out, v_out = while_loop(
                lambda t, *_: t < n_steps, body_fn, (t0, z_fast.clone(), z_slow.clone(), caches[0].clone(), caches[1].clone()))
            return self.readout(self.final_state(z_fast, z_slow)), k_out, v_out

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


class KVCache(nn.Module):
    """Static K/V caches as buffers, one pair per block application, updated in place (ExecuTorch's
    LLM-runner contract: the caches are mutable buffers of the program, not inputs)."""

    def __init__(self, cfg: ModelConfig, batch_size: int = 1, n_steps: int | None = None):
        super().__init__()
        shape = (batch_size, cfg.n_heads, cfg.max_seq_len, cfg.head_dim)  # [B, H, L, hd]
        for t in range(n_steps or cfg.n_steps):  # fewer outer cycles (depth dial) need fewer caches
            self.register_buffer(f"k_{t}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_{t}", torch.zeros(shape), persistent=False)

    def update(self, t: int, positions, k, v):
        """Write k, v [B, H, S, hd] at `positions` [S] of application t's cache; return the caches."""
        k_cache, v_cache = getattr(self, f"k_{t}"), getattr(self, f"v_{t}")
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        return k_cache, v_cache

    def reset(self):
        for b in self.buffers():
            b.zero_()


def empty_cache(cfg: ModelConfig, batch_size: int = 1):
    """Functional caches (k, v), each [T, B, H, L, hd] of zeros: the ONNX decode graph's inputs."""
    shape = (cfg.n_steps, batch_size, cfg.n_heads, cfg.max_seq_len, cfg.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


class DecodeForm(nn.Module):
    """(tokens [1, S], input_pos [1]) -> logits [1, S, V] with the KV cache as in-place buffers: the
    ExecuTorch program of the LLM runner, and the eager KV-cache model (prefill S > 1, decode S = 1).
    n_cycles: outer cycles to run (depth dial; None = all)."""

    def __init__(self, model: HRMLM, batch_size: int = 1, n_cycles: int | None = None):
        super().__init__()
        cfg = model.cfg
        n_steps = None if n_cycles is None or cfg.arch != "hrm" else n_cycles * (cfg.L_cycles + 1)
        self.model, self.n_cycles, self.cache = model, n_cycles, KVCache(cfg, batch_size, n_steps)

    def forward(self, tokens, input_pos):
        return self.model(tokens, form="loop", n_cycles=self.n_cycles, input_pos=input_pos, cache=self.cache)


class FunctionalDecodeForm(nn.Module):
    """(tokens, input_pos, k_cache, v_cache) -> (logits, k_cache, v_cache): the ONNX decode graph, caches
    as explicit inputs/outputs stacked over the T applications; HRM iteration as an ONNX Loop."""

    def __init__(self, model: HRMLM):
        super().__init__()
        self.model = model
        self.form = "while_loop" if model.cfg.arch == "hrm" else "loop"

    def forward(self, tokens, input_pos, k_cache, v_cache):
        return self.model(tokens, form=self.form, input_pos=input_pos, cache=(k_cache, v_cache))


class TracedForm(nn.Module):
    """tokens -> logits in one iteration form: the thing an exporter traces."""

    def __init__(self, model: HRMLM, form: str, n_cycles: int | None = None):
        super().__init__()
        self.model, self.form, self.n_cycles = model, form, n_cycles

    def forward(self, tokens):
        return self.model(tokens, form=self.form, n_cycles=self.n_cycles)
