"""int8 quantization plans and the eager int8 references that parity checks the int8 artifacts against.

Static int8 (the ONNX Loop artifact):
  - weights of the shared block's linears: int8, symmetric, one scale per output channel;
  - their inputs: int8, asymmetric, one scale and zero point per tensor, either per iteration step
    ([T] vectors indexed by the loop counter inside the Loop body) or one shared across all steps.
    int8 values (the artifact stores them + 128 as uint8 with zero points + 128: the same integer sums, and
    uint8 x uint8 is the MatMulInteger form onnxruntime runs exactly and fast on x86 without VNNI, where
    uint8 x int8 saturates its int16 pair sums and int8 x int8 has no fast kernel; export_onnx);
  - the tied embedding table: int8 with one scale per row and per column (table_qparams), stored once and
    read by both the embedding gather and the head; the head's input is quantized per position at run time
    (symmetric int8, dynamic) and multiplied with the int8 table in integers (StaticInt8Head);
  - the gates (a few percent of the weights) and attention's activation x activation products stay fp32,
    and so do the block linears named in the preset's quant.static_fp32_linears (the default model keeps
    ffn.w_down in fp32: the SwiGLU product it reads is heavy-tailed, and its per-tensor 8-bit input alone
    cost 3% top-1 agreement, more than all other linears together).

The eager reference applies exactly these roundings to the eager model (fake quantization with the
same scales), so "artifact vs its int8 reference" measures the runtime and "artifact vs fp32 eager"
measures what quantization costs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from hrm_edge.errors import UserError
from hrm_edge.export.calibrate import BLOCK_LINEARS
from hrm_edge.model.lm import TracedForm

INT8_MIN, INT8_MAX = -128, 127


def activation_qparams(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 asymmetric (scale, zero point) covering [lo, hi] and 0 (so that 0 is exact)."""
    lo = np.minimum(np.asarray(lo, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, dtype=np.float64), 0.0)
    scale = np.maximum((hi - lo) / (INT8_MAX - INT8_MIN), 1e-8).astype(np.float32)
    zero_point = np.clip(np.round(INT8_MIN - lo / scale), INT8_MIN, INT8_MAX).astype(np.int8)
    return scale, zero_point


def weight_qparams(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (int8 [N, K], scale [N]): symmetric, one scale per output channel (row)."""
    amax = np.abs(w).max(axis=1)
    scale = np.maximum(amax / INT8_MAX, 1e-12).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def table_qparams(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tied table w [V, D] -> (int8 [V, D], row scale [V], column scale [D]), w ~ q * row[:, None] * col.

    Columns are equalized first (divided by the square root of their max |w|) so that a few large
    columns do not set every row's scale: on the default model this cut the table's squared rounding
    error 3.5x and raised the static artifact's top-1 agreement with fp32 by ~0.3 points."""
    col = np.sqrt(np.maximum(np.abs(w).max(axis=0), 1e-12)).astype(np.float32)
    q, row = weight_qparams(w / col)
    return q, row, col


@dataclass
class StaticInt8Plan:
    per_step: bool
    fp32_linears: tuple  # block linears left in fp32 (sensitive ones), the others are int8
    act_scale: dict  # linear name -> float32 [T]
    act_zero_point: dict  # linear name -> int8 [T]
    weight_q: dict  # linear name -> int8 [N, K]
    weight_scale: dict  # linear name -> float32 [N]
    embed_q: np.ndarray  # int8 [V, D]
    embed_scale: np.ndarray  # float32 [V], per row
    embed_col_scale: np.ndarray  # float32 [D], per column (table_qparams)

    def embed_dequantized(self) -> np.ndarray:
        return self.embed_q.astype(np.float32) * self.embed_scale[:, None] * self.embed_col_scale[None, :]

    @property
    def int8_linears(self) -> tuple:
        return tuple(n for n in BLOCK_LINEARS if n not in self.fp32_linears)


def parse_linear_names(text: str) -> tuple:
    """'ffn.w_down, attn.wo' -> ('ffn.w_down', 'attn.wo'); unknown names are a user error."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BLOCK_LINEARS]
    if unknown:
        raise UserError(f"quant.static_fp32_linears: unknown block linear(s) {', '.join(unknown)}; "
                        f"known: {', '.join(BLOCK_LINEARS)}")
    return names


def static_plan(model, ranges: dict, per_step: bool, fp32_linears: tuple = ()) -> StaticInt8Plan:
    T = model.cfg.n_steps
    act_scale, act_zp, wq, ws = {}, {}, {}, {}
    for name in BLOCK_LINEARS:
        if name in fp32_linears:
            continue
        lo, hi = np.array(ranges["linears"][name]["min"]), np.array(ranges["linears"][name]["max"])
        if not per_step:  # one range over every step
            lo, hi = np.full(T, lo.min()), np.full(T, hi.max())
        act_scale[name], act_zp[name] = activation_qparams(lo, hi)
        wq[name], ws[name] = weight_qparams(model.block.get_submodule(name).weight.detach().numpy())
    eq, es, ec = table_qparams(model.embed.weight.detach().numpy())
    return StaticInt8Plan(per_step, tuple(fp32_linears), act_scale, act_zp, wq, ws, eq, es, ec)


def fake_quant_activation(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    # what QuantizeLinear then DequantizeLinear compute: round half to even, saturate to int8
    q = torch.clamp(torch.round(x / scale) + zero_point, INT8_MIN, INT8_MAX)
    return (q - zero_point) * scale


def static_int8_reference(model, plan: StaticInt8Plan):
    """A copy of `model` computing what the static int8 artifact computes (Python-loop form)."""
    ref = copy.deepcopy(model).eval()
    T = ref.cfg.n_steps
    with torch.no_grad():
        for name in plan.int8_linears:
            lin = ref.block.get_submodule(name)
            lin.weight.copy_(torch.from_numpy(plan.weight_q[name].astype(np.float32) * plan.weight_scale[name][:, None]))
        ref.embed.weight.copy_(torch.from_numpy(plan.embed_dequantized()))
    calls = {name: 0 for name in plan.int8_linears}

    def reset(module, args, kwargs):
        for name in calls:
            calls[name] = 0

    def act_hook(name):
        def hook(module, inputs):
            t = calls[name] % T
            calls[name] += 1
            return (fake_quant_activation(inputs[0], float(plan.act_scale[name][t]), int(plan.act_zero_point[name][t])),)
        return hook

    ref.register_forward_pre_hook(reset, with_kwargs=True)
    for name in plan.int8_linears:
        ref.block.get_submodule(name).register_forward_pre_hook(act_hook(name))
    ref.head = StaticInt8Head(plan)
    return ref


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (int8 values as float [N, D], scale [N, 1]): symmetric, one scale per row, round half to even
    (what the graph's Div -> Round -> Clip computes)."""
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True) / INT8_MAX, min=1e-12)
    return torch.clamp(torch.round(x / scale), -INT8_MAX, INT8_MAX), scale


class StaticInt8Head(torch.nn.Module):
    """The static int8 graph's tied head: its input, times the table's column scales, quantized to int8 per
    position (dynamic, symmetric), an integer matmul with the int8 table, then the row and input scales.
    No fp32 copy of the table is made at run time (dequantizing V x D weights per call cost more than the
    rest of a decode step)."""

    def __init__(self, plan: StaticInt8Plan):
        super().__init__()
        self.register_buffer("table_int8", torch.from_numpy(plan.embed_q.astype(np.float32)))  # [V, D] integer values
        self.register_buffer("row_scale", torch.from_numpy(plan.embed_scale))  # [V]
        self.register_buffer("col_scale", torch.from_numpy(plan.embed_col_scale))  # [D]

    def forward(self, x):
        lead = x.shape[:-1]
        q, scale = quantize_per_row((x * self.col_scale).reshape(-1, x.shape[-1]))  # [N, D], [N, 1]
        logits = (q @ self.table_int8.T) * scale * self.row_scale  # exact integer sums in fp32 (|sum| < 2^24)
        return logits.reshape(*lead, -1)


class Int8TiedEmbedding(torch.nn.Module):
    """The tied embedding table stored once as int8 with one scale per row.

    The gather reads int8 rows and scales them; the head (HRMLM.readout: F.linear(x, embed.weight))
    reads `weight`, the table dequantized at run time. In a .pte the int8 table is one constant used by
    both, where a quantized head inside the XNNPACK delegate would carry a second copy of the table."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, s = weight_qparams(weight.detach().numpy())
        self.register_buffer("weight_int8", torch.from_numpy(q))  # [V, D]
        self.register_buffer("row_scale", torch.from_numpy(s))  # [V]

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_int8.to(torch.float32) * self.row_scale[:, None]  # [V, D]

    def forward(self, tokens):
        return self.weight_int8[tokens].to(torch.float32) * self.row_scale[tokens][..., None]  # [B, S, D]


def dynamic_int8_model(model):
    """A copy of `model` with int8 dynamic activations and int8 per-channel weights on every nn.Linear
    (torchao Int8DynamicActivationIntxWeightConfig, which XNNPACK runs as int8 GEMMs; an untied head
    (export_executorch.untie_head) is one of them) and the embedding gather as Int8TiedEmbedding. It is both
    what the .pte is exported from and its eager reference (torchao's eager kernels compute what XNNPACK's
    do, up to rounding)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, quantize_

    q = copy.deepcopy(model).eval()
    quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)))
    q.embed = Int8TiedEmbedding(model.embed.weight)
    return q


INT4_GROUP = 32  # 4-bit weights share one scale per 32 (ExecuTorch's Llama 8da4w default)


def dynamic_int4_model(model):
    """8da4w, as ExecuTorch's Llama: int8 dynamic activations x 4-bit weights with one scale per group of
    INT4_GROUP inputs on every block nn.Linear whose input width is a multiple of the group (the others stay int8 per
    channel: the gates' up projections, of input width gate_rank, where gate_rank is not a multiple of it; on the
    shipped model, gate_rank 32, they are 4-bit), and the embedding gather as
    Int8TiedEmbedding. The untied head stays int8 per channel: on the shipped model a 4-bit head costs top-1
    0.862 -> 0.832 and perplexity 1.078x -> 1.114x against fp32 (eager, parity windows), for 0.5 MB."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup, quantize_

    def grouped(module, fqn):
        return isinstance(module, torch.nn.Linear) and module.in_features % INT4_GROUP == 0 and fqn != "head"

    q = copy.deepcopy(model).eval()
    quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(INT4_GROUP)),
              filter_fn=grouped)
    quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear) and not grouped(module, fqn))
    q.embed = Int8TiedEmbedding(model.embed.weight)
    return q


def static_int8_pt2e_model(model, calib_windows: np.ndarray):
    """PT2E static int8 for ExecuTorch: XNNPACKQuantizer (int8 symmetric per-channel weights, int8
    per-tensor activations) on every nn.Linear of the unrolled graph, calibrated on the calibration set.

    The graph is unrolled, so each step's linear is its own node with its own observer: the activation
    scales are per iteration step by construction. The tied embedding is Int8TiedEmbedding (not a
    PT2E-quantized head, which would fold a second int8 copy of the table). Returns the converted
    module: the export source and the eager int8 reference at once."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (XNNPACKQuantizer,
                                                                        get_symmetric_quantization_config)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    q = copy.deepcopy(model).eval()
    q.embed = Int8TiedEmbedding(model.embed.weight)
    example = torch.from_numpy(np.ascontiguousarray(calib_windows[:1, :16]))
    seq = torch.export.Dim("seq", min=1, max=model.cfg.max_seq_len)
    graph = torch.export.export(TracedForm(q, "loop"), (example,), dynamic_shapes=({1: seq},), strict=False).module()
    quantizer = XNNPACKQuantizer().set_module_type(
        torch.nn.Linear, get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False))
    graph = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for window in calib_windows:  # batch 1, as the program runs
            graph(torch.from_numpy(np.ascontiguousarray(window[None, :])))
    return convert_pt2e(graph)


def int8_weight_bytes(model, int8_names) -> int:
    """Bytes of a model's weights once `int8_names` parameters are int8 with one fp32 scale per row."""
    return weight_bytes(model, {name: "int8" for name in int8_names})


def weight_bytes(model, formats: dict) -> int:
    """Bytes of a model's weights stored as `formats` says per parameter name: "int8" (one fp32 scale per row),
    "int4" (two weights a byte, one fp32 scale per group of INT4_GROUP); fp32 where not named."""
    total = 0
    for name, p in model.named_parameters():
        fmt = formats.get(name, "fp32")
        if fmt == "int8":
            total += p.numel() + 4 * p.shape[0]
        elif fmt == "int4":
            total += p.numel() // 2 + 4 * (p.numel() // INT4_GROUP)
        else:
            total += 4 * p.numel()
    return total


def pte_weight_bytes(model, precision: str) -> int:
    """The weight bytes a .pte program of `model` stores at `precision` ("fp32", "int8" = dynamic_int8_model,
    "int4" = dynamic_int4_model): every parameter once, and the tied table a second time, as the head's
    weight inside the XNNPACK delegate (export_executorch.untie_head)."""
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if precision == "fp32":
        return weight_bytes(model, {}) + 4 * model.embed.weight.numel()
    bits = {n: "int8" if precision == "int8" or m.in_features % INT4_GROUP else "int4" for n, m in linears.items()}
    table = model.embed.weight
    head = table.numel() + 4 * table.shape[0]  # int8 per channel in both (dynamic_int4_model keeps the head int8)
    return weight_bytes(model, bits | {"embed.weight": "int8"}) + head


def static_int8_names(plan: StaticInt8Plan) -> set:
    return {f"block.{n}.weight" for n in plan.int8_linears} | {"embed.weight"}


def all_linear_int8_names(model) -> set:
    """Every nn.Linear (block and gates) plus the tied table: what the ExecuTorch int8 programs quantize."""
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return {f"{n}.weight" for n in names} | {"embed.weight"}


# ---- each int8 mode as the manifest describes it (an artifact's "quantization" record), one place per mode ----
EVERY_LINEAR_PER_CHANNEL = "int8 symmetric per output channel (every linear: block, gates and the head)"
ROW_SCALED_TABLE = "int8 per row; two copies: the gather's, and the head's as an int8 linear in XNNPACK"
SHARED_ROW_SCALED_TABLE = "int8 per row, one table shared by gather and head (weight-only head)"


def static_onnx_quantization(plan: StaticInt8Plan, calibration_sha256: str) -> dict:
    """The static int8 ONNX Loop graphs (export_onnx.quantize_static_int8 of `plan`)."""
    return {"mode": "static", "activation_scales": "per_step" if plan.per_step else "shared",
            "activations": "int8 asymmetric per tensor, calibrated",
            "weights": f"int8 symmetric per output channel ({', '.join(plan.int8_linears)})",
            "embedding": "int8 with per-row and per-column scales, one table shared by gather and head; the head's input "
                         "int8 per position (dynamic, symmetric), integer matmul",
            "fp32": ", ".join(("gates", "attention scores") + plan.fp32_linears),
            "calibration_sha256": calibration_sha256}


def dynamic_quantization() -> dict:
    """The dynamic int8 ExecuTorch programs (dynamic_int8_model): no calibration."""
    return {"mode": "dynamic", "activation_scales": "dynamic per token",
            "activations": "int8 dynamic asymmetric per token", "weights": EVERY_LINEAR_PER_CHANNEL,
            "embedding": ROW_SCALED_TABLE, "calibration_sha256": None}


def dynamic_int4_quantization() -> dict:
    """The opt-in 8da4w ExecuTorch program (dynamic_int4_model): no calibration."""
    return {"mode": "8da4w", "activation_scales": "dynamic per token",
            "activations": "int8 dynamic asymmetric per token",
            "weights": f"int4 symmetric, one scale per {INT4_GROUP} inputs (int8 per channel where the input width "
                       f"is not a multiple of {INT4_GROUP}: the gates' up projections when gate_rank is not); the head "
                       "int8 per channel",
            "embedding": "int8 per row for the gather; the head's copy of the table int8 per channel (two copies)",
            "calibration_sha256": None}


def pt2e_quantization(calibration_sha256: str) -> dict:
    """The static PT2E ExecuTorch program (static_int8_pt2e_model)."""
    return {"mode": "static", "activation_scales": "per_step (one observer per unrolled node)",
            "activations": "int8 per tensor, calibrated (PT2E XNNPACKQuantizer)",
            "weights": "int8 symmetric per output channel (every linear: block and gates)",
            "embedding": SHARED_ROW_SCALED_TABLE, "calibration_sha256": calibration_sha256}


# ---- weight-only MatMulNBits (the ONNX "int8-nbits" and "int4-nbits" graphs) ----
# inputs per weight (and run-time input) scale, by weight bits: on the shipped model, blocks of 64 cost 8-bit
# weights top-1 0.98 -> 0.97 against fp32 (the kernel's int8 inputs are coarser too), and blocks of 32 cost 4-bit
# ones 0.87 -> 0.83, below the int4 gate; 32 decodes faster than 16 at 8 bits (docs/quantization.md)
NBITS_BLOCK = {8: 32, 4: 16}


def nbits_reference(model, weights: dict, block: int):
    """A copy of `model` computing what a MatMulNBits graph computes (hrm_edge.export.onnx.quantize_nbits):
    the parameters named in `weights` ({name: float array [out, in]}) are the values the quantized ones stand
    for, and the inputs of the block linears and the head are rounded as onnxruntime's int8-compute kernel
    (accuracy_level 4) rounds them, to int8 per block of `block` inputs (symmetric, max |x| / 127)."""
    ref = copy.deepcopy(model).eval()
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(w)))
    for name in BLOCK_LINEARS:
        ref.block.get_submodule(name).register_forward_pre_hook(lambda module, inputs: (int8_per_block(inputs[0], block),))
    ref.head = NbitsHead(ref.embed, block)
    return ref


def int8_per_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] rounded to int8 per block of `block` along K (symmetric, round half to even), as floats."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    scale = torch.clamp(blocks.abs().amax(dim=-1, keepdim=True) / INT8_MAX, min=1e-12)
    return (torch.clamp(torch.round(blocks * (1 / scale)), -INT8_MAX, INT8_MAX) * scale).reshape(x.shape)


class NbitsHead(torch.nn.Module):
    """The tied head of a MatMulNBits graph: its input rounded per block (int8_per_block), times the table."""

    def __init__(self, embed: torch.nn.Embedding, block: int):
        super().__init__()
        self.embed, self.block = embed, block

    def forward(self, x):
        return torch.nn.functional.linear(int8_per_block(x, self.block), self.embed.weight)  # [B, S, V]


def nbits_weight_bytes(model, weights: dict, bits: int, block: int, table_bits: int) -> int:
    """Bytes of a model's weights once `weights` (parameter names) are stored at `bits` (the tied table at
    `table_bits`) with one fp32 scale per `block` inputs; fp32 elsewhere."""
    params = dict(model.named_parameters())
    total = weight_bytes(model, {}) - sum(4 * params[name].numel() for name in weights)
    for name in weights:
        b = table_bits if name == "embed.weight" else bits
        total += params[name].numel() * b // 8 + 4 * params[name].numel() // block
    return total


def nbits_quantization(bits: int, block: int, table_bits: int) -> dict:
    """The weight-only MatMulNBits ONNX graphs (export_onnx.quantize_nbits): no calibration."""
    return {"mode": "nbits", "activation_scales": "dynamic per block (onnxruntime, accuracy_level 4)",
            "activations": f"int8 per block of {block} inputs, quantized by the MatMulNBits kernel at run time",
            "weights": f"int{bits} symmetric, one scale per {block} inputs (every block linear)",
            "embedding": f"int{table_bits} symmetric per {block} columns, one table shared by gather and head",
            "fp32": "gates, attention scores, RoPE", "calibration_sha256": None}
