"""Artifact file names, made in one place: ARCH.PRECISION[.cK][.kv].EXT.

    hrm.fp32.onnx                      full-sequence fp32 ONNX graph
    hrm.int8-static-perstep.kv.onnx    KV-cache (prefill + decode) int8 graph, per-step activation scales
    hrm.int4-nbits.kv.onnx             KV-cache graph with 4-bit weights (onnxruntime's MatMulNBits; int8-nbits: 8-bit)
    hrm.int8-dynamic.c1.kv.pte         KV-cache int8 ExecuTorch program run with 1 of the H outer cycles
    hrm.fp32.kv.ort                    onnxruntime's ORT format of hrm.fp32.kv.onnx
    hrm.fp32.draft.onnx                self-speculative decoding's draft graph (hrm.fp32.verify.onnx: its verify graph)
    hrm.fp32.branch.onnx               the draft graph for rows that share one context's cache (the suggestion bar)
    hrm.int8-dynamic.spec.pte          self-speculative ExecuTorch program: forward, draft and verify methods in one
    transformer.int8-dynamic.kv.pte    the unshared baseline (arch "transformer") built the same way

ARCH is the model's arch ("hrm", "transformer") or a study entry's name. Every reader takes a file's format,
precision and program from its manifest record, never from its name.
"""
from __future__ import annotations

from pathlib import Path

EXTENSIONS = {"onnx": "onnx", "ort": "ort", "pte": "pte"}
PROGRAMS = {"full_sequence": [], "kv_cache": ["kv"], "draft": ["draft"], "branch": ["branch"],
            "verify": ["verify"],
            "speculative": ["spec"]}  # the name's word


def artifact_name(arch: str, precision: str, fmt: str, program: str = "full_sequence",
                  n_cycles: int | None = None) -> str:
    """precision: fp32, int8-static-perstep, int8-static-shared, int8-static, int8-dynamic, 8da4w, int8-nbits,
    int4-nbits."""
    if fmt not in EXTENSIONS or program not in PROGRAMS:
        raise ValueError(f"unknown format {fmt!r} or program {program!r}")
    parts = [arch, precision]
    parts += [f"c{n_cycles}"] if n_cycles else []
    parts += PROGRAMS[program]
    return ".".join(parts + [EXTENSIONS[fmt]])


def ort_name(onnx_path: str | Path) -> str:
    """The ORT-format twin of an ONNX file: hrm.fp32.kv.onnx -> hrm.fp32.kv.ort."""
    return f"{Path(onnx_path).stem}.ort"
