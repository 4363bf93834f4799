"""ExecuTorch export: the iteration unrolled (ExecuTorch 1.4 rejects while_loop, and scan bodies are never
delegated) and lowered to XNNPACK. The unrolled graph references one set of parameters, and XNNPACK's
named data store dedupes constants by hash, so the shared block is stored once.

The tied embedding is the exception: the embedding gather stays on the portable CPU kernels while a
delegated head would put a second copy of the same table into the XNNPACK payload. We keep the head
(the only op that reads the embedding table besides the gather) out of the delegate so the table is
stored once; the manifest's size rule checks it.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch

from hrm_edge.io import atomic_write_bytes
from hrm_edge.model import HRMLM, DecodeForm, TracedForm

TIED_WEIGHT = "model.embed.weight"


def _reads_parameter(node: torch.fx.Node, ep, param_name: str) -> bool:
    """True if `node` reads `param_name` directly or through permute/transpose views."""
    for arg in node.all_input_nodes:
        n = arg
        while n.op == "call_function" and ("permute" in str(n.target) or "transpose" in str(n.target) or
                                           str(n.target).endswith(".t.default")):
            n = n.all_input_nodes[0]
        if n.op == "placeholder" and ep.graph_signature.inputs_to_parameters.get(n.name) == param_name:
            return True
    return False


def xnnpack_partitioner_keeping_tied_weight_once(ep, tied_weight: str = TIED_WEIGHT):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    partitioner = XnnpackPartitioner()
    for config in partitioner.target_partitioner_configs.values():
        def check(node, ep_, original=config.check_constraints):
            return not _reads_parameter(node, ep_, tied_weight) and original(node, ep_)
        config.check_constraints = check
    return partitioner


def metadata_methods(cfg, bos_id: int, eos_id: int, use_kv_cache: bool) -> dict:
    """Constant methods ExecuTorch's LLM runner reads (extension/llm/runner/constants.h)."""
    return {
        "get_max_seq_len": cfg.max_seq_len,
        "get_max_context_len": cfg.max_seq_len,
        "get_vocab_size": cfg.vocab_size,
        "get_bos_id": bos_id,
        "get_eos_ids": [eos_id],
        "use_kv_cache": use_kv_cache,
        "enable_dynamic_shape": True,
    }


def _lower(module, example: tuple, dynamic: tuple, cfg, path: Path, bos_id: int, eos_id: int, use_kv_cache: bool) -> Path:
    """torch.export -> to_edge_transform_and_lower (XNNPACK, tied table kept once) -> atomic write."""
    from executorch.exir import to_edge_transform_and_lower

    # torchao logs "Failed to load" for its CUDA-only kernels on import: harmless on a CPU
    for name in ("executorch", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():  # in-place cache writes must not be recorded for autograd
            ep = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
        edge = to_edge_transform_and_lower(
            ep, partitioner=[xnnpack_partitioner_keeping_tied_weight_once(ep)],
            constant_methods=metadata_methods(cfg, bos_id, eos_id, use_kv_cache))
        program = edge.to_executorch()
    atomic_write_bytes(path, program.buffer)
    return path


def export_pte(model: HRMLM, path: Path, bos_id: int, eos_id: int, n_cycles: int | None = None,
               traced: torch.nn.Module | None = None) -> Path:
    """Write an XNNPACK-lowered .pte: forward(tokens [1, S] int64) -> logits [1, S, V], 1 <= S <= max_seq_len.

    `model` may be an int8 model from hrm_edge.quantize (dynamic_int8_model): its quantized linears are
    delegated as XNNPACK int8 GEMMs and its Int8TiedEmbedding stays one int8 constant. `traced`, if
    given, is the tokens -> logits module to export instead (a PT2E-converted graph of `model`)."""
    cfg = model.cfg
    example = torch.randint(0, cfg.vocab_size, (1, min(16, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    if traced is None:
        traced = TracedForm(model.eval(), "loop", n_cycles)  # a Python loop: torch.export unrolls it
    return _lower(traced, (example,), ({1: seq},), cfg, path, bos_id, eos_id, use_kv_cache=False)


def export_pte_decode(model: HRMLM, path: Path, bos_id: int, eos_id: int, n_cycles: int | None = None) -> Path:
    """Write the KV-cache program of ExecuTorch's text-LLM runner contract:
    forward(tokens [1, S] int64, input_pos [1] int64) -> logits [1, S, V], 1 <= S < max_seq_len, the T
    per-application K/V caches as mutable buffers updated in place, metadata as constant methods.
    `model` may be an int8 model from hrm_edge.quantize. n_cycles: outer cycles (depth dial; None = all)."""
    cfg = model.cfg
    example = (torch.zeros(1, 4, dtype=torch.int64), torch.tensor([0], dtype=torch.int64))
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len - 1)
    return _lower(DecodeForm(model.eval(), n_cycles=n_cycles), example, ({1: seq}, None), cfg, path, bos_id, eos_id, use_kv_cache=True)
