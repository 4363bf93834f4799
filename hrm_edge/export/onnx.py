"""ONNX export: the HRM iteration becomes ONE ONNX `Loop` node; the shared block's weights are initializers
of the Loop body (onnx_passes.weights_into_body), so they are stored once; the tied embedding table, which the
embedding gather and the head read outside the Loop, is a main-graph initializer.

torch.onnx.export(dynamo=True) turns torch._higher_order_ops.while_loop into `Loop` (a Python for loop
would be unrolled). Batch and sequence axes are dynamic.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from onnxruntime.tools.mobile_helpers import usability_checker

from hrm_edge.export.calibrate import BLOCK_LINEARS
from hrm_edge.export.names import ort_name
from hrm_edge.export.onnx_passes import (NbitsFormat, blockwise_quantize, hoist_loop_invariants, loop_and_body,
                                         matmuls_to_nbits, merge_split_concat, names_read, nbits_node,
                                         slots_as_scan_outputs, weights_into_body)
from hrm_edge.io import atomic_write_bytes, atomic_write_text
from hrm_edge.model.lm import HRMLM, BranchForm, DraftForm, FunctionalDecodeForm, RMSNorm, TracedForm, VerifyForm, cache_steps


def strip_debug_metadata(graph: onnx.GraphProto) -> None:
    """Drop the exporter's per-node metadata (stack traces, FX node text): ~2x the weights' size on a
    small model, and of no use to a runtime."""
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                strip_debug_metadata(attr.g)
            for g in attr.graphs:
                strip_debug_metadata(g)
    for value in list(graph.value_info) + list(graph.input) + list(graph.output) + list(graph.initializer):
        del value.metadata_props[:]


def main_graph_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


TIED_TABLE = "model.embed.weight"
OPSET = 23  # RMSNormalization is an ONNX op from opset 23 (one node instead of seven)


def head_as_gemm(graph: onnx.GraphProto) -> None:
    """Rewrite the tied head MatMul(x, Transpose(table)) as Gemm(x [N, D], table, transB=1) between two
    Reshapes. onnxruntime constant-folds Transpose(initializer) into a second, transposed copy of the
    table when it saves an .ort file; Gemm reads the one table as it is."""
    transposed = {n.output[0]: n for n in graph.node if n.op_type == "Transpose" and n.input[0] == TIED_TABLE}
    table = next(i for i in graph.initializer if i.name == TIED_TABLE)
    d_model = table.dims[1]
    nodes = []
    for node in graph.node:
        if node.op_type == "Transpose" and node.output[0] in transposed:
            continue
        if node.op_type == "MatMul" and node.input[1] in transposed:
            x, y = node.input[0], node.output[0]
            shape_2d = f"{y}.shape_2d"
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, d_model], dtype=np.int64), shape_2d))
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), f"{y}.zero"))
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{y}.minus1"))
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([2], dtype=np.int64), f"{y}.two"))
            nodes += [
                helper.make_node("Reshape", [x, shape_2d], [f"{y}.x2"], name=f"{y}.reshape_in"),
                helper.make_node("Gemm", [f"{y}.x2", TIED_TABLE], [f"{y}.y2"], transB=1, name=f"{y}.gemm"),
                helper.make_node("Shape", [x], [f"{y}.x_shape"], name=f"{y}.shape"),
                helper.make_node("Slice", [f"{y}.x_shape", f"{y}.zero", f"{y}.minus1"], [f"{y}.lead"], name=f"{y}.lead"),
                helper.make_node("Shape", [f"{y}.y2"], [f"{y}.y2_shape"], name=f"{y}.shape_out"),
                helper.make_node("Slice", [f"{y}.y2_shape", f"{y}.minus1", f"{y}.two"], [f"{y}.vocab"], name=f"{y}.vocab"),
                helper.make_node("Concat", [f"{y}.lead", f"{y}.vocab"], [f"{y}.out_shape"], axis=0, name=f"{y}.concat"),
                helper.make_node("Reshape", [f"{y}.y2", f"{y}.out_shape"], [y], name=f"{y}.reshape_out"),
            ]
            continue
        nodes.append(node)
    if len(nodes) == len(graph.node):
        raise RuntimeError("did not find the tied head (MatMul with the transposed embedding table)")
    del graph.node[:]
    graph.node.extend(nodes)


def _export(module, example: tuple, dynamic: tuple, input_names, output_names, path: Path, needs_loop: bool) -> Path:
    """torch.onnx.export (dynamo) -> strip debug metadata -> check the Loop and the model -> atomic write.
    The model's metadata_props say max_seq_len and vocab_size (what a decoding loop needs to know)."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" notices
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # the exporter prints its progress
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, example, dynamo=True, external_data=False, dynamic_shapes=dynamic, opset_version=OPSET,
                                    input_names=input_names, output_names=output_names, verbose=False)
    proto = program.model_proto
    strip_debug_metadata(proto.graph)
    head_as_gemm(proto.graph)
    if needs_loop:
        hoist_loop_invariants(proto.graph)
        weights_into_body(proto.graph)
        slots_as_scan_outputs(proto.graph)
    cfg = module.model.cfg
    onnx.helper.set_model_props(proto, {"max_seq_len": str(cfg.max_seq_len), "vocab_size": str(cfg.vocab_size)})
    # torch writes IR version 10 with opset 23, which came with IR 11 (ONNX 1.18): say the version the opset needs
    needed = onnx.helper.find_min_ir_version_for(proto.opset_import, ignore_unknown=True)
    proto.ir_version = max(proto.ir_version, needed)
    if needs_loop and "Loop" not in main_graph_ops(proto):
        raise RuntimeError(f"ONNX export of {path.name} lost the iteration Loop (main graph has no Loop node)")
    onnx.checker.check_model(proto, full_check=True)
    atomic_write_bytes(path, proto.SerializeToString())
    return path


def for_onnx(model: HRMLM) -> HRMLM:
    """The source transformation before ONNX export: a copy whose RMSNorms are the one ONNX op."""
    model = copy.deepcopy(model).eval()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.as_one_op = True
    return model


def export_onnx(model: HRMLM, path: Path, n_cycles: int | None = None) -> Path:
    """Write `path` (one self-contained file): tokens [B, S] -> logits [B, S, V], batch and sequence
    dynamic. HRM: iteration as an ONNX Loop; transformer: unrolled."""
    cfg = model.cfg
    form = "while_loop" if cfg.arch == "hrm" else "loop"
    example = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    dynamic = ({0: torch.export.Dim("batch", max=1024), 1: torch.export.Dim("seq", max=cfg.max_seq_len)},)
    return _export(TracedForm(for_onnx(model), form, n_cycles), (example,), dynamic, ["tokens"], ["logits"], path,
                   needs_loop=cfg.arch == "hrm")


def export_onnx_decode(model: HRMLM, path: Path, n_cycles: int | None = None) -> Path:
    """Write the KV-cache graph: (tokens [B, S], past_k, past_v [T, B, H, P, hd]) -> (logits [B, S, V],
    present_k, present_v [T, B, H, P + S, hd]), the convention of Hugging Face's past/present key values.
    Prefill is a call with P = 0, decode one with S = 1; the position of tokens[:, 0] is P. The HRM
    iteration is an ONNX Loop whose body reads its own step's past and collects the new keys/values,
    which are appended to the past once, after the Loop."""
    cfg = model.cfg
    T = cache_steps(cfg, n_cycles)
    past = torch.zeros(T, 2, cfg.n_heads, 3, cfg.head_dim)  # P = 3 while tracing; any 0 <= P < L at run time
    example = (torch.zeros(2, 4, dtype=torch.int64), past, past.clone())
    batch = torch.export.Dim("batch", max=1024)
    seq, past_len = torch.export.Dim("seq", max=cfg.max_seq_len), torch.export.Dim("past", max=cfg.max_seq_len - 1)
    dynamic = ({0: batch, 1: seq}, {1: batch, 3: past_len}, {1: batch, 3: past_len})
    return _export(FunctionalDecodeForm(for_onnx(model), n_cycles), example, dynamic, ["tokens", "past_k", "past_v"],
                   ["logits", "present_k", "present_v"], path, needs_loop=cfg.arch == "hrm")


def _decode_example(cfg, n_slots: int) -> tuple:
    """Tracing inputs of a KV graph and its dynamic dims: tokens [2, 4], past [n_slots, 2, H, 3, hd] (P = 3 while
    tracing; any 0 <= P < L at run time)."""
    past = torch.zeros(n_slots, 2, cfg.n_heads, 3, cfg.head_dim)
    batch = torch.export.Dim("batch", max=1024)
    seq, past_len = torch.export.Dim("seq", max=cfg.max_seq_len), torch.export.Dim("past", max=cfg.max_seq_len - 1)
    return (torch.zeros(2, 4, dtype=torch.int64), past, past.clone()), (batch, seq, past_len)


def export_onnx_draft(model: HRMLM, path: Path) -> Path:
    """Self-speculative decoding's draft graph (DraftForm): the KV graph's contract over the first outer cycle's
    L + 1 cache slots, plus the cycle-1 state [2, B, S, D] that the verify graph continues from."""
    cfg = model.cfg
    example, (batch, seq, past_len) = _decode_example(cfg, cfg.L_cycles + 1)
    dynamic = ({0: batch, 1: seq}, {1: batch, 3: past_len}, {1: batch, 3: past_len})
    return _export(DraftForm(for_onnx(model)), example, dynamic, ["tokens", "past_k", "past_v"],
                   ["logits", "state", "present_k", "present_v"], path, needs_loop=True)


def export_onnx_branch(model: HRMLM, path: Path) -> Path:
    """The suggestion bar's branch graph (BranchForm): the draft graph's first outer cycle for B rows that share
    one context past (context_k, context_v [L + 1, 1, H, P, hd]), each with its own past_k, past_v."""
    cfg = model.cfg
    (tokens, past, _), (batch, seq, own_len) = _decode_example(cfg, cfg.L_cycles + 1)
    context = torch.zeros(cfg.L_cycles + 1, 1, cfg.n_heads, 5, cfg.head_dim)  # P = 5 != Q = 3 while tracing
    context_len = torch.export.Dim("context", max=cfg.max_seq_len - 1)
    dynamic = ({0: batch, 1: seq}, {3: context_len}, {3: context_len}, {1: batch, 3: own_len}, {1: batch, 3: own_len})
    return _export(BranchForm(for_onnx(model)), (tokens, context, context.clone(), past, past.clone()), dynamic,
                   ["tokens", "context_k", "context_v", "past_k", "past_v"], ["logits", "present_k", "present_v"],
                   path, needs_loop=True)


def export_onnx_verify(model: HRMLM, path: Path) -> Path:
    """Self-speculative decoding's verify graph (VerifyForm): (tokens, state, past_k, past_v) over the last
    T - L - 1 cache slots -> the full depth's logits at every drafted position and the presents."""
    cfg = model.cfg
    (tokens, past, _), (batch, seq, past_len) = _decode_example(cfg, cfg.n_steps - cfg.L_cycles - 1)
    state = torch.zeros(2, 2, 4, cfg.d_model)  # [2, B, S, D]
    dynamic = ({0: batch, 1: seq}, {1: batch, 2: seq}, {1: batch, 3: past_len}, {1: batch, 3: past_len})
    return _export(VerifyForm(for_onnx(model)), (tokens, state, past, past.clone()), dynamic,
                   ["tokens", "state", "past_k", "past_v"], ["logits", "present_k", "present_v"], path, needs_loop=True)


# ---- static int8 with the Loop kept ----
# onnxruntime's static quantizer does not look inside Loop bodies, and inside a body ORT does not fuse
# QDQ patterns (measured: slower than fp32, or a session error). So the body gets explicit integer ops:
#   x_q = QuantizeLinear(x, s[t], zp[t])          s, zp: [T] vectors gathered by the loop counter t
#   y_i = MatMulInteger(x_q, W_q, zp[t], 128)     weights a body initializer, stored once
#   y   = Cast(y_i, float) * (s[t] * w_scale)      (onnxruntime fuses these three into MatMulIntegerToFloat)
# which is what QDQ means, computed in int32. The plan's int8 values are stored shifted by 128 as uint8 (zero
# points shifted too): the integer sums are identical, and uint8 x uint8 is the one form onnxruntime runs both
# exactly and fast on x86 without VNNI (a 1x256 @ 256x704 MatMulInteger on this AVX2 CPU: u8u8 14 us, s8s8
# 146 us: no s8 x s8 kernel there; u8s8 13 us but its int16 pair sums saturate, wrong results).
# The tied embedding table is one uint8 initializer [D, V] (transposed: it is the head's right operand) with
# per-row and per-column scales: the gather reads its columns, the head multiplies it with its input quantized
# per position at run time (_int8_head_nodes).
U8_SHIFT = 128  # int8 value v is stored as uint8 v + 128


def _as_uint8(q: np.ndarray) -> np.ndarray:
    return (np.asarray(q).astype(np.int16) + U8_SHIFT).astype(np.uint8)


def _initializers(graph: onnx.GraphProto) -> dict:
    """Initializers of the graph and of the Loop body, by name."""
    _, body = loop_and_body(graph)
    return {i.name: onnx.numpy_helper.to_array(i) for i in list(graph.initializer) + list(body.initializer)}


def _find_initializer(arrays: dict, target) -> str:
    for name, arr in arrays.items():
        if arr.shape == target.shape and np.array_equal(arr, target):
            return name
    raise RuntimeError(f"no initializer holds a weight of shape {target.shape}")


def _int8_head_nodes(x: str, y: str, table_t: str, row_scale: str, col_scale: str, inits) -> list:
    """The tied head on the int8 table, as quantize.StaticInt8Head computes it: x [N, D] times the column
    scales, quantized to int8 per row (symmetric, scale max|x| / 127, stored + 128 as uint8),
    MatMulInteger(x_q [N, D], table_t [D, V]), then the row and input scales. Dequantizing the V x D table on
    every call instead cost more than the rest of a decode step."""
    p = "q8.head"
    axis1 = inits.add(f"{p}.axis1", np.array([1], dtype=np.int64))
    qmax = inits.add(f"{p}.qmax", np.array(127.0, dtype=np.float32))
    qmin = inits.add(f"{p}.qmin", np.array(-127.0, dtype=np.float32))
    tiny = inits.add(f"{p}.tiny", np.array(1e-12, dtype=np.float32))
    shift = inits.add(f"{p}.shift", np.array(float(U8_SHIFT), dtype=np.float32))
    zp = inits.add(f"{p}.zero_point", np.array(U8_SHIFT, dtype=np.uint8))
    return [
        helper.make_node("Mul", [x, col_scale], [f"{p}.xc"], name=f"{p}.col_scale"),
        helper.make_node("Abs", [f"{p}.xc"], [f"{p}.abs"], name=f"{p}.abs"),
        helper.make_node("ReduceMax", [f"{p}.abs", axis1], [f"{p}.amax"], keepdims=1, name=f"{p}.amax"),
        helper.make_node("Div", [f"{p}.amax", qmax], [f"{p}.s0"], name=f"{p}.scale"),
        helper.make_node("Max", [f"{p}.s0", tiny], [f"{p}.s"], name=f"{p}.scale_floor"),  # [N, 1]
        helper.make_node("Div", [f"{p}.xc", f"{p}.s"], [f"{p}.xs"], name=f"{p}.divide"),
        helper.make_node("Round", [f"{p}.xs"], [f"{p}.xr"], name=f"{p}.round"),  # half to even
        helper.make_node("Clip", [f"{p}.xr", qmin, qmax], [f"{p}.xcl"], name=f"{p}.clip"),
        helper.make_node("Add", [f"{p}.xcl", shift], [f"{p}.xu"], name=f"{p}.shift"),  # [1, 255]
        helper.make_node("Cast", [f"{p}.xu"], [f"{p}.xq"], to=TensorProto.UINT8, name=f"{p}.to_uint8"),
        helper.make_node("MatMulInteger", [f"{p}.xq", table_t, zp, zp], [f"{p}.yi"], name=f"{p}.matmul"),  # int32 [N, V]
        helper.make_node("Cast", [f"{p}.yi"], [f"{p}.yf"], to=TensorProto.FLOAT, name=f"{p}.to_float"),
        helper.make_node("Mul", [f"{p}.yf", f"{p}.s"], [f"{p}.ys"], name=f"{p}.input_scale"),
        helper.make_node("Mul", [f"{p}.ys", row_scale], [y], name=f"{p}.row_scale"),
    ]


class NewInitializers(list):
    """Initializers a rewrite adds: add(name, array) records one and returns its name."""

    def add(self, name: str, arr) -> str:
        self.append(onnx.numpy_helper.from_array(np.asarray(arr), name))
        return name


def quantize_static_int8(fp32_path: Path, path: Path, model: HRMLM, plan, first_step: int = 0) -> Path:
    """Rewrite the fp32 Loop graph at `fp32_path` into a static int8 graph at `path` (see comment above).
    first_step: the block application of the Loop's first iteration (a verify graph's: L + 1); the per-step
    scales are gathered by the Loop's iteration number, so they start there."""
    if first_step:
        plan = dataclasses.replace(plan, act_scale={n: s[first_step:] for n, s in plan.act_scale.items()},
                                   act_zero_point={n: z[first_step:] for n, z in plan.act_zero_point.items()})
    proto = onnx.load(str(fp32_path))
    main = proto.graph
    _, body = loop_and_body(main)
    inits = NewInitializers()
    _quantize_block_linears(body, _initializers(main), model, plan, inits)
    _quantize_tied_table(main, plan, inits)  # (rebuilds main's node list: `body` above is now a stale copy)
    main.initializer.extend(inits)
    _, body = loop_and_body(main)
    merge_split_concat(body, main)  # wq+wk(+wv) as one matmul: its Split and the model's Concat for RoPE cancel
    _drop_unused_initializers(main)
    _drop_unused_initializers(body)  # the fp32 weights of the int8 linears
    weights_into_body(main)  # the int8 weights and their scales were added to the main graph
    del main.value_info[:]  # shapes/types of rewritten values changed; runtimes re-infer them
    del body.value_info[:]
    onnx.checker.check_model(proto, full_check=True)
    atomic_write_bytes(path, proto.SerializeToString())
    return path


def _quantize_block_linears(body: onnx.GraphProto, arrays: dict, model: HRMLM, plan, inits: NewInitializers) -> None:
    """The body MatMuls that read int8 block linears' weights become Quantize -> MatMulInteger -> Cast -> Mul
    with the step's activation scale gathered by the Loop counter (onnxruntime fuses the last three into one
    MatMulIntegerToFloat). Linears that read the same input with the same scales (wq and wk; w_up and w_gate)
    share one quantization and one MatMulInteger over their weights side by side, split after."""
    # which body MatMul reads which block weight: the exporter stores W^T under a generated name
    weight_of = {_find_initializer(arrays, model.block.get_submodule(n).weight.detach().numpy().T): n
                 for n in plan.int8_linears}
    groups: dict = {}  # (input, scales) -> [(linear name, MatMul output)]
    for node in body.node:
        name = weight_of.get(node.input[1]) if node.op_type == "MatMul" else None
        if name is not None:
            key = (node.input[0], plan.act_scale[name].tobytes(), plan.act_zero_point[name].tobytes())
            groups.setdefault(key, []).append((name, node.output[0]))
    if sum(len(g) for g in groups.values()) != len(plan.int8_linears):
        raise RuntimeError("static int8: did not find every block linear in the Loop body")
    first_of = {members[0][1]: (x, members) for (x, _, _), members in groups.items()}
    replaced = {out for members in groups.values() for _, out in members}
    nodes = []
    for node in body.node:
        if node.op_type == "MatMul" and node.output[0] in first_of:
            x, members = first_of[node.output[0]]
            nodes += _int8_linear_group(body.input[0].name, x, members, plan, inits)
        elif not (node.op_type == "MatMul" and node.output[0] in replaced):
            nodes.append(node)
    del body.node[:]
    body.node.extend(nodes)


def _int8_linear_group(t_name: str, x: str, members: list, plan, inits: NewInitializers) -> list:
    """Nodes computing the linears `members` [(name, output)] of input x in int8 (see the comment above)."""
    names = [name for name, _ in members]
    p = "q8." + "+".join(names)
    first = names[0]
    s_all = inits.add(f"{p}.x_scale", plan.act_scale[first])  # float32 [T]
    zp_all = inits.add(f"{p}.x_zero_point", _as_uint8(plan.act_zero_point[first]))  # uint8 [T]
    wq = inits.add(f"{p}.w_uint8", _as_uint8(np.concatenate([plan.weight_q[n] for n in names]).T))  # [K, sum N]
    wzp = inits.add(f"{p}.w_zero_point", np.array(U8_SHIFT, dtype=np.uint8))
    ws = inits.add(f"{p}.w_scale", np.concatenate([plan.weight_scale[n] for n in names]))  # [sum N]
    y = members[0][1] if len(members) == 1 else f"{p}.y"
    nodes = [
        helper.make_node("Gather", [s_all, t_name], [f"{p}.s_t"], name=f"{p}.gather_s"),
        helper.make_node("Gather", [zp_all, t_name], [f"{p}.zp_t"], name=f"{p}.gather_zp"),
        helper.make_node("QuantizeLinear", [x, f"{p}.s_t", f"{p}.zp_t"], [f"{p}.x_q"], name=f"{p}.quantize"),
        helper.make_node("MatMulInteger", [f"{p}.x_q", wq, f"{p}.zp_t", wzp], [f"{p}.y_i32"], name=f"{p}.matmul"),
        helper.make_node("Mul", [f"{p}.s_t", ws], [f"{p}.y_scale"], name=f"{p}.scale"),
        helper.make_node("Cast", [f"{p}.y_i32"], [f"{p}.y_f"], to=TensorProto.FLOAT, name=f"{p}.to_float"),
        helper.make_node("Mul", [f"{p}.y_f", f"{p}.y_scale"], [y], name=f"{p}.dequantize"),
    ]
    if len(members) > 1:
        sizes = inits.add(f"{p}.sizes", np.array([plan.weight_q[n].shape[0] for n in names], dtype=np.int64))
        nodes.append(helper.make_node("Split", [y, sizes], [out for _, out in members], axis=-1, name=f"{p}.split"))
    return nodes


def _quantize_tied_table(main: onnx.GraphProto, plan, inits: NewInitializers) -> None:
    """The embedding gather and the tied head read one uint8 table [D, V] with per-row and per-column scales."""
    emb = "model.embed.weight"
    eq = inits.add("q8.embed.w_uint8_t", _as_uint8(plan.embed_q.T))  # [D, V]
    es = inits.add("q8.embed.w_scale", plan.embed_scale)
    ec = inits.add("q8.embed.col_scale", plan.embed_col_scale)  # [D]: table = int8 x row scale x column scale
    minus_one = inits.add("q8.axes_last", np.array([-1], dtype=np.int64))
    shift = inits.add("q8.embed.shift", np.array(float(U8_SHIFT), dtype=np.float32))
    nodes = []
    head_found = False
    for node in main.node:
        if node.op_type == "Gather" and node.input[0] == emb:
            tokens, out = node.input[1], node.output[0]
            p = "q8.embed"
            nodes += [
                helper.make_node("Gather", [eq, tokens], [f"{p}.cols_u8"], axis=1, name=f"{p}.gather"),  # [D, B, S]
                helper.make_node("Transpose", [f"{p}.cols_u8"], [f"{p}.rows_u8"], perm=[1, 2, 0], name=f"{p}.transpose"),
                helper.make_node("Cast", [f"{p}.rows_u8"], [f"{p}.rows_f"], to=TensorProto.FLOAT, name=f"{p}.cast"),
                helper.make_node("Sub", [f"{p}.rows_f", shift], [f"{p}.rows_i"], name=f"{p}.unshift"),  # int8 values
                helper.make_node("Gather", [es, tokens], [f"{p}.row_scale"], name=f"{p}.gather_scale"),
                helper.make_node("Unsqueeze", [f"{p}.row_scale", minus_one], [f"{p}.row_scale_u"], name=f"{p}.unsq"),
                helper.make_node("Mul", [f"{p}.rows_i", f"{p}.row_scale_u"], [f"{p}.rows_r"], name=f"{p}.dequantize"),
                helper.make_node("Mul", [f"{p}.rows_r", ec], [out], name=f"{p}.col_scale"),
            ]
        elif node.op_type == "Gemm" and node.input[1] == emb:
            head_found = True
            nodes += _int8_head_nodes(node.input[0], node.output[0], eq, es, ec, inits)
        else:
            nodes.append(node)
    if not head_found:
        raise RuntimeError("static int8: did not find the tied head")
    del main.node[:]
    main.node.extend(nodes)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Drop the graph's initializers that neither it nor its nested graphs read."""
    used = names_read(graph)
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


# ---- weight-only MatMulNBits ----
# onnxruntime's fast weight-only path (com.microsoft MatMulNBits, accuracy_level 4: the input quantized to int8
# per block at run time, integer dot products) needs no calibration, and one node replaces the static rewrite's
# four (Quantize, MatMulInteger, Cast, Mul) per group of linears reading one input (wq+wk+wv, w_gate+w_up). The
# block linears get `bits`-bit weights; the tied table is 8-bit at either width (a 4-bit head costs more quality
# than it saves bytes: quantize.dynamic_int4_model) and stored once, as the head's MatMulNBits weight
# [V, D / block, block], whose rows the embedding gather reads.
NBITS_TABLE_BITS = 8


def quantize_nbits(fp32_path: Path, path: Path, model: HRMLM, bits: int, block: int) -> tuple[Path, dict]:
    """Rewrite the fp32 Loop graph at `fp32_path` into a weight-only graph at `path` (see the comment above).
    Returns the path and {parameter name: the float weight its quantized one stands for} (the eager reference's
    weights, hrm_edge.export.quantize.nbits_reference)."""
    proto = onnx.load(str(fp32_path))
    arrays = _initializers(proto.graph)
    weight_of = {_find_initializer(arrays, model.block.get_submodule(n).weight.detach().numpy().T): f"block.{n}.weight"
                 for n in BLOCK_LINEARS}
    done = matmuls_to_nbits(proto, set(weight_of), bits, block)
    if set(done) != set(weight_of):
        raise RuntimeError("MatMulNBits: did not find every block linear in the graph")
    weights = {weight_of[name]: w.T for name, w in done.items()}  # [out, in], as nn.Linear stores it
    merge_split_concat(loop_and_body(proto.graph)[1], proto.graph)  # wq+wk+wv as one: RoPE's Concat of q, k goes
    inits = NewInitializers()
    weights["embed.weight"] = _nbits_tied_table(proto.graph, block, inits)
    proto.graph.initializer.extend(inits)
    _, body = loop_and_body(proto.graph)  # (the table's rewrite rebuilt the main graph's node list)
    _drop_unused_initializers(proto.graph)
    _drop_unused_initializers(body)  # what merge_split_concat replaced (onnxruntime warned of it at every load)
    weights_into_body(proto.graph)  # the merged constants were added to the main graph
    del proto.graph.value_info[:]  # the rewritten values' types changed; runtimes re-infer them
    del body.value_info[:]
    onnx.checker.check_model(proto, full_check=True)
    atomic_write_bytes(path, proto.SerializeToString())
    return path, weights


def _nbits_tied_table(main: onnx.GraphProto, block: int, inits: NewInitializers) -> np.ndarray:
    """The tied head Gemm(x, table, transB=1) -> MatMulNBits over the 8-bit table, and the embedding gather ->
    the gathered rows of that table, dequantized. Returns the table [V, D] the 8-bit one stands for."""
    table = next(onnx.numpy_helper.to_array(i) for i in main.initializer if i.name == TIED_TABLE)  # [V, D]
    vocab, d_model = table.shape
    stored, scales, dequantized = blockwise_quantize(table.T, NBITS_TABLE_BITS, block)  # [V, D/block, block]
    p = "nbits.embed"
    q, s = inits.add(f"{p}.q8", stored), inits.add(f"{p}.scales", scales)
    shift = inits.add(f"{p}.zero_point", np.array(2.0 ** (NBITS_TABLE_BITS - 1), dtype=np.float32))
    last = inits.add(f"{p}.last_axis", np.array([-1], dtype=np.int64))
    rows = inits.add(f"{p}.rows_shape", np.array([0, 0, d_model], dtype=np.int64))  # [B, S, D]: 0 keeps a dim
    nodes, head_found = [], False
    for node in main.node:
        if node.op_type == "Gather" and node.input[0] == TIED_TABLE:
            tokens, out = node.input[1], node.output[0]
            nodes += [
                helper.make_node("Gather", [q, tokens], [f"{p}.rows_u8"], axis=0, name=f"{p}.gather"),  # [B, S, D/bk, bk]
                helper.make_node("Cast", [f"{p}.rows_u8"], [f"{p}.rows_f"], to=TensorProto.FLOAT, name=f"{p}.cast"),
                helper.make_node("Sub", [f"{p}.rows_f", shift], [f"{p}.rows_q"], name=f"{p}.unshift"),
                helper.make_node("Gather", [s, tokens], [f"{p}.row_scales"], axis=0, name=f"{p}.gather_scales"),
                helper.make_node("Unsqueeze", [f"{p}.row_scales", last], [f"{p}.row_scales_u"], name=f"{p}.unsqueeze"),
                helper.make_node("Mul", [f"{p}.rows_q", f"{p}.row_scales_u"], [f"{p}.rows"], name=f"{p}.dequantize"),
                helper.make_node("Reshape", [f"{p}.rows", rows], [out], name=f"{p}.reshape"),
            ]
        elif node.op_type == "Gemm" and node.input[1] == TIED_TABLE:
            head_found = True
            nodes.append(nbits_node(node.input[0], node.output[0], q, s, d_model, vocab,
                                    NbitsFormat(NBITS_TABLE_BITS, block)))
        else:
            nodes.append(node)
    if not head_found:
        raise RuntimeError("MatMulNBits: did not find the tied head")
    del main.node[:]
    main.node.extend(nodes)
    return dequantized.T


# ---- ONNX Runtime mobile format ----
def export_ort(onnx_paths: list[Path], out_dir: Path) -> tuple[list[Path], Path]:
    """Convert ONNX files to ORT format (onnxruntime.tools.convert_onnx_models_to_ort) next to them, and
    keep the tool's required_operators.config (the operator list for a reduced onnxruntime build)."""
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".ort-build.") as tmp:
        src, dst = Path(tmp) / "onnx", Path(tmp) / "ort"
        src.mkdir()
        for p in onnx_paths:
            shutil.copyfile(p, src / p.name)
        proc = subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(src),
                               "--output_dir", str(dst), "--optimization_style", "Fixed"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ORT conversion failed: {proc.stderr[-1500:]}")
        written = []
        for p in onnx_paths:
            ort_file = dst / ort_name(p)
            if not ort_file.is_file():
                raise RuntimeError(f"ORT conversion wrote no {ort_file.name}")
            os.replace(ort_file, out_dir / ort_file.name)  # same file system: appears complete or not at all
            written.append(out_dir / ort_file.name)
        config = next(dst.glob("*.config"))
        # the tool lists the files it read by their temporary paths: keep only the names (reproducible bytes)
        text = config.read_text().replace(f"{dst}{os.sep}", "")
        atomic_write_text(out_dir / "required_operators.config", text)
    return written, out_dir / "required_operators.config"


class UsabilityReport:
    """Stands in for the logger onnxruntime's usability checker writes to: its lines, as its command line prints
    them ("INFO:  ..."), kept in a list. Not a logging.Logger, so the exporter's process-wide silencing of
    third-party log records (hrm_edge.quiet) does not empty the report."""

    def __init__(self):
        self.lines: list[str] = []

    def getEffectiveLevel(self) -> int:  # the checker writes its partition analysis at INFO and below
        return logging.INFO

    def _keep(self, level: str, msg, *args) -> None:
        self.lines += f"{level}:  {msg % args if args else msg}".splitlines()

    def debug(self, msg, *args) -> None:
        pass

    def info(self, msg, *args) -> None:
        self._keep("INFO", msg, *args)

    def warning(self, msg, *args) -> None:
        self._keep("WARNING", msg, *args)

    def summary(self) -> list[str]:
        """The last 12 lines that say something: no continuation of a multi-line message, separator or blank line."""
        said = [line.rstrip() for line in self.lines if line.startswith(("INFO", "WARNING"))]
        return [line for line in said if line.partition(":")[2].strip().strip("=-")][-12:]


def mobile_usability(onnx_path: Path) -> dict:
    """onnxruntime's mobile usability check (check_onnx_model_mobile_usability's analysis, run in this process: a
    subprocess per graph spent ~4 s importing torch and onnx, a minute of a default export), recorded in the manifest:
    whether NNAPI or CoreML may beat the CPU EP, and the last lines of its report."""
    report = UsabilityReport()
    try:
        try_eps = usability_checker.analyze_model(Path(onnx_path), skip_optimize=False, logger=report)
    except Exception as e:  # a verdict, not a reason to fail the export (the parity gate decides that)
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0], "summary": report.summary()}
    return {"nnapi_or_coreml_may_help": bool(try_eps), "summary": report.summary()}
