"""ExecuTorch export: the iteration unrolled (ExecuTorch 1.4 rejects while_loop, and scan bodies are never
delegated) and lowered to XNNPACK. The unrolled graph references one set of parameters, and XNNPACK's
named data store dedupes constants by hash, so the shared block is stored once.

Two source transformations before tracing, as ExecuTorch's own Llama export does:
- the KV caches become ExecuTorchKVCache: buffers written in place by llama::update_cache and read by
  llama::custom_sdpa (ExecuTorch's LLM custom ops), instead of index_copy_ + a written-out attention;
- the tied head becomes an nn.Linear sharing the embedding table (untie_head), so XNNPACK runs it (and the
  int8 programs quantize it): 15 us per decoded token instead of 1,358 us on the portable kernels
  (measured, d 128, vocab 4096). The price: the embedding gather (portable kernels) and the head (XNNPACK)
  each store the table, so these programs carry it twice; the manifest records it (tied_table_copies) and
  the size rule counts it.

The self-speculative program (export_pte_speculative) is one program with four methods over one set of cache
buffers: exported together, with MemoryPlanningPass(share_mutable_buffers=True), every method places a buffer
of a given name at the same offset of one shared arena (memory id 2; exir/passes/memory_planning_pass.py,
run_multimethod). Sharing at run time is the runtime's part: the Python Runtime API gives all methods of a
loaded program the same planned arenas; a C++ runner needs Module(..., share_memory_arenas=true), as
ExecuTorch's own multi-method LLM runners do.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from pathlib import Path

import torch

from hrm_edge.io import atomic_write_bytes
from hrm_edge.export.quantize import dynamic_int4_model, dynamic_int8_model
from hrm_edge.model.lm import (HRMLM, CachedDraftForm, CachedSkipForm, CachedVerifyForm, DecodeForm, TracedForm,
                               cache_steps)

class ExecuTorchKVCache(torch.nn.Module):
    """The KV cache on ExecuTorch's LLM custom ops: one pair of buffers [B, L, H, hd] per block application
    (the ops' layout: sequence at dim 1), written in place by llama::update_cache; attention is
    llama::custom_sdpa over the cache, causal from the call's start position (no mask tensor)."""

    def __init__(self, cfg, n_steps: int, batch_size: int = 1):
        super().__init__()
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  registers torch.ops.llama

        self.max_seq_len = cfg.max_seq_len
        shape = (batch_size, cfg.max_seq_len, cfg.n_heads, cfg.head_dim)  # [B, L, H, hd]
        for t in range(n_steps):
            self.register_buffer(f"k_{t}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_{t}", torch.zeros(shape), persistent=False)

    def positions(self, S: int, input_pos=None, device=None):
        return input_pos + torch.arange(S, device=input_pos.device)  # [S]

    def mask(self, positions):
        return None

    def start_pos(self, positions) -> int:
        start = positions[0].item()
        torch._check(start >= 0)  # (torch 2.13 deprecates _check_is_size for this)
        torch._check(start < self.max_seq_len)
        return start

    def update(self, t: int, positions, k, v, start: int | None = None):
        """k, v [B, S, H, hd] written at the call's positions of application t's cache; returns the caches."""
        start = self.start_pos(positions) if start is None else start
        k_cache, v_cache = getattr(self, f"k_{t}"), getattr(self, f"v_{t}")
        torch.ops.llama.update_cache(k, k_cache, start)
        torch.ops.llama.update_cache(v, v_cache, start)
        return k_cache, v_cache

    def copy_first_cycle(self, input_pos, steps: range, per_cycle: int):
        """KVCache.copy_first_cycle on these buffers, one position: application t's keys/values at input_pos [1]
        become those of application t mod per_cycle (a row of that cache, written by llama::update_cache)."""
        start = self.start_pos(input_pos)
        for t in steps:
            for name in ("k", "v"):
                row = getattr(self, f"{name}_{t % per_cycle}").narrow(1, start, 1)  # [B, 1, H, hd]
                torch.ops.llama.update_cache(row, getattr(self, f"{name}_{t}"), start)

    def attend(self, t: int, positions, q, k, v, mask):
        start = self.start_pos(positions)
        k_cache, v_cache = self.update(t, positions, k, v, start)
        return torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, None, 0.0, True)  # [B, S, H, hd]


def untie_head(model: HRMLM) -> HRMLM:
    """A copy of `model` whose head is an nn.Linear sharing the embedding table (same Parameter): XNNPACK
    delegates it and torchao quantizes it like any linear. Untie before quantizing (the quantized model's
    embedding is no longer an nn.Embedding with a Parameter to share)."""
    if not isinstance(model.embed, torch.nn.Embedding):
        raise ValueError("untie_head needs the fp32 model; quantize the untied model instead")
    model = copy.deepcopy(model)
    model.head = torch.nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False)
    model.head.weight = model.embed.weight
    return model


def quantized_for_pte(model: HRMLM, precision: str) -> torch.nn.Module:
    """The model a quantized .pte is lowered from (and its eager reference): the head untied first, so that
    it is quantized and delegated like every other linear. precision: "int8" (8-bit dynamic activations x
    int8 weights) or "int4" (8-bit dynamic activations x 4-bit grouped weights)."""
    return (dynamic_int8_model if precision == "int8" else dynamic_int4_model)(untie_head(model))


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
    [written] = _lower_methods({"forward": (module, example, dynamic)}, cfg, path, bos_id, eos_id, use_kv_cache)
    return written


def _lower_methods(methods: dict, cfg, path: Path, bos_id: int, eos_id: int, use_kv_cache: bool,
                   shared_state: bool = False, forward_only: Path | None = None) -> list[Path]:
    """methods: name -> (module, example inputs, dynamic shapes), one program method each. shared_state: the
    methods' mutable buffers of the same name are one tensor (ExecuTorch's MemoryPlanningPass
    share_mutable_buffers: every method places it at the same offset of one shared arena, memory id 2).
    forward_only: also write the program of the lowered "forward" method alone there (a program of its own, planned
    as one; lowering is the slow part, so this costs seconds). Returns the files written: path (, forward_only)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import (EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig,
                                 to_edge_transform_and_lower)
    from executorch.exir.passes import MemoryPlanningPass

    # torchao logs "Failed to load" for its CUDA-only kernels on import: harmless on a CPU
    for name in ("executorch", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():  # in-place cache writes must not be recorded for autograd
            programs = {name: torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
                        for name, (module, example, dynamic) in methods.items()}
        # No edge-dialect IR check after every pass (as ExecuTorch's own LLM export): it re-validated each op's
        # dtypes, a quarter of a dynamic int8 lowering's time (tiny KV program: 116-118 s -> 86-89 s), and the
        # program it checked is the same bytes; the parity gate runs every program either way.
        constants = metadata_methods(cfg, bos_id, eos_id, use_kv_cache)
        compile_config = EdgeCompileConfig(_check_ir_validity=False)
        edge = to_edge_transform_and_lower(programs if len(programs) > 1 else programs["forward"],
                                           partitioner=[XnnpackPartitioner()], constant_methods=constants,
                                           compile_config=compile_config)
        if forward_only is not None:  # a copy, so that emitting it leaves the full program's method as lowered
            alone = EdgeProgramManager({"forward": copy.deepcopy(edge.exported_program("forward"))}, constants,
                                       compile_config)
            atomic_write_bytes(forward_only, alone.to_executorch().buffer)
        config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                                         emit_mutable_buffer_names=True) if shared_state else None
        program = edge.to_executorch(config)
    atomic_write_bytes(path, program.buffer)
    return [path] if forward_only is None else [path, forward_only]


def export_pte(model: HRMLM, path: Path, bos_id: int, eos_id: int, n_cycles: int | None = None,
               traced: torch.nn.Module | None = None) -> Path:
    """Write an XNNPACK-lowered .pte: forward(tokens [1, S] int64) -> logits [1, S, V], 1 <= S <= max_seq_len.

    `model` may be an int8 model from hrm_edge.export.quantize (dynamic_int8_model): its quantized linears are
    delegated as XNNPACK int8 GEMMs and its Int8TiedEmbedding stays one int8 constant. `traced`, if
    given, is the tokens -> logits module to export instead (a PT2E-converted graph of `model`)."""
    cfg = model.cfg
    example = torch.randint(0, cfg.vocab_size, (1, min(16, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    if traced is None:
        model = untie_head(model) if model.head is None else model
        traced = TracedForm(model.eval(), "loop", n_cycles)  # a Python loop: torch.export unrolls it
    return _lower(traced, (example,), ({1: seq},), cfg, path, bos_id, eos_id, use_kv_cache=False)


def export_pte_decode(model: HRMLM, path: Path, bos_id: int, eos_id: int, n_cycles: int | None = None) -> Path:
    """Write the KV-cache program of ExecuTorch's text-LLM runner contract:
    forward(tokens [1, S] int64, input_pos [1] int64) -> logits [1, S, V], 1 <= S < max_seq_len, the T
    per-application K/V caches as mutable buffers updated in place, metadata as constant methods.
    `model` may be an int8 model from hrm_edge.export.quantize (quantized after untie_head, so its head is an int8
    linear). n_cycles: outer cycles (depth dial; None = all)."""
    cfg = model.cfg
    model = untie_head(model) if model.head is None else model
    cache = ExecuTorchKVCache(cfg, cache_steps(cfg, n_cycles))
    example = (torch.zeros(1, 4, dtype=torch.int64), torch.tensor([0], dtype=torch.int64))
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len - 1)
    return _lower(DecodeForm(model.eval(), n_cycles=n_cycles, cache=cache), example, ({1: seq}, None), cfg, path, bos_id, eos_id, use_kv_cache=True)


def export_pte_speculative(model: HRMLM, path: Path, bos_id: int, eos_id: int,
                           kv_path: Path | None = None) -> list[Path]:
    """Write export_pte_decode's program plus self-speculative decoding's two methods (hrm_edge.runtime.speculative)
    and adaptive depth's skip, all four over the same T cache buffers (one tensor each, shared across methods):
        forward(tokens [1, S], input_pos [1]) -> logits [1, S, V]        every application (prefill, decode)
        draft(tokens [1, S], input_pos [1]) -> (logits [1, S, V], state [2, 1, S, D])
                                               the first outer cycle (applications 0..L, their slots)
        verify(tokens [1, S], state [2, 1, S, D], input_pos [1]) -> logits [1, S, V]
                                               applications L + 1 .. T - 1 (their slots) from the drafts' states
        skip(input_pos [1]) -> input_pos [1]   adaptive depth (hrm_edge.runtime.adaptive): the drafted position exits
                                               after the first cycle; applications L + 1 .. T - 1's slots there take
                                               the first cycle's keys/values, slot t <- slot t mod (L + 1)
    `model` may be an int8 model (quantized_for_pte), as for export_pte_decode. kv_path: also write
    export_pte_decode's program there, from the same lowering (its forward method alone, planned as a program of its
    own; on the tiny model the int8 one was byte for byte export_pte_decode's), at a few seconds instead of a third of
    this lowering. Returns the files written."""
    cfg = model.cfg
    if cfg.arch != "hrm":
        raise ValueError("self-speculative decoding drafts with the first outer cycle: an hrm model only")
    model = (untie_head(model) if model.head is None else model).eval()
    cache = ExecuTorchKVCache(cfg, cfg.n_steps)
    tokens, pos = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([0], dtype=torch.int64)
    state = torch.zeros(2, 1, 4, cfg.d_model)
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len - 1)
    methods = {
        "forward": (DecodeForm(model, cache=cache), (tokens, pos), ({1: seq}, None)),
        "draft": (CachedDraftForm(model, cache), (tokens, pos), ({1: seq}, None)),
        "verify": (CachedVerifyForm(model, cache), (tokens, state, pos), ({1: seq}, {2: seq}, None)),
        "skip": (CachedSkipForm(model, cache), (pos,), None),
    }
    return _lower_methods(methods, cfg, path, bos_id, eos_id, use_kv_cache=True, shared_state=True,
                          forward_only=kv_path)
