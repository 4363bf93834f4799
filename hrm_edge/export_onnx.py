"""ONNX export: the HRM iteration becomes ONE ONNX `Loop` node; the shared block's weights are main-graph
initializers that the Loop body reads from the outer scope, so they are stored once.

torch.onnx.export(dynamo=True) turns torch._higher_order_ops.while_loop into `Loop` (a Python for loop
would be unrolled). Batch and sequence axes are dynamic.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import onnx
import torch

from hrm_edge.io import atomic_write_bytes
from hrm_edge.model import HRMLM, TracedForm


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


def export_onnx(model: HRMLM, path: Path, n_cycles: int | None = None) -> Path:
    """Write `path` (one self-contained file). HRM: iteration as an ONNX Loop; transformer: unrolled."""
    cfg = model.cfg
    form = "while_loop" if cfg.arch == "hrm" else "loop"
    example = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    dynamic = ({0: torch.export.Dim("batch", max=1024), 1: torch.export.Dim("seq", max=cfg.max_seq_len)},)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" notices
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # the exporter prints its progress
        warnings.simplefilter("ignore")
        program = torch.onnx.export(TracedForm(model.eval(), form, n_cycles), (example,), dynamo=True,
                                    external_data=False, dynamic_shapes=dynamic, input_names=["tokens"],
                                    output_names=["logits"], verbose=False)
    proto = program.model_proto
    strip_debug_metadata(proto.graph)
    if cfg.arch == "hrm" and "Loop" not in main_graph_ops(proto):
        raise RuntimeError("ONNX export lost the iteration Loop (main graph has no Loop node)")
    onnx.checker.check_model(proto, full_check=True)
    atomic_write_bytes(path, proto.SerializeToString())
    return path
