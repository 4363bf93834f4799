"""Where a decode step of an ONNX KV graph spends its time, by operator type: the nodes the graph runs per
step (the Loop body once per iteration) and onnxruntime's own per-node profile of real decode steps. And where a
self-speculative round's time goes: one call of each program, timed alone.

    python -c "from hrm_edge.measure.profile import print_decode_profile as p; p('D/hrm.fp32.kv.onnx')"
    python -c "from hrm_edge.measure.profile import print_round_costs as p; p('D/hrm.int8-dynamic.spec.pte')"

At batch 1 a step is a few hundred small nodes, so the node count (onnxruntime's dispatch is ~1 us a node)
matters as much as the arithmetic of the matmuls. Profiling itself costs time per node (it records memory
statistics for each): the profiled times say where a step's time goes, not how fast it runs unprofiled.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx

from hrm_edge.export.onnx_passes import step_op_counts
from hrm_edge.runtime.decoders import OnnxDecoder, PteDecoder
from hrm_edge.runtime.speculative import (DEFAULT_DRAFT_LEN, DEFAULT_LOOKUP_LEN, OnnxSpeculativeDecoder,
                                          PteSpeculativeDecoder, speculative_set)


CONTAINERS = {"Loop", "If", "Scan"}  # their time is their body's nodes', which the profile lists too


def decode_profile(path: Path, prompt_len: int = 64, steps: int = 16) -> dict:
    """One thread; a prompt of prompt_len tokens prefilled, then `steps` decode steps profiled. Returns
    {"graph": {op: nodes per step} (step_op_counts: the Loop body times its trip count, past_k's first
    dimension), "profiled": {op: {"nodes": nodes per step, "us": microseconds per step}} (onnxruntime's
    per-node kernel times; a Loop's own entry, the sum of its body's, left out), "kernel_us": their sum per step, "step_us": median time of a step inside
    onnxruntime (its model_run events: kernels plus dispatch)}."""
    graph = onnx.load(str(path), load_external_data=False).graph
    trip_count = next(i for i in graph.input if i.name == "past_k").type.tensor_type.shape.dim[0].dim_value
    decoder = OnnxDecoder(path, threads=1, profile=True)
    decoder.prefill(np.zeros(prompt_len, dtype=np.int64))
    for _ in range(steps):
        decoder.decode(0)
    profile = Path(decoder.session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink()
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-steps:]
    start, end = runs[0]["ts"], runs[-1]["ts"] + runs[-1]["dur"]
    profiled: dict = {}
    for e in events:
        if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and start <= e["ts"] <= end
                and e["args"]["op_name"] not in CONTAINERS):
            op = profiled.setdefault(e["args"]["op_name"], {"nodes": 0, "us": 0.0})
            op["nodes"] += 1 / steps
            op["us"] += e["dur"] / steps
    profiled = dict(sorted(profiled.items(), key=lambda kv: -kv[1]["us"]))
    return {"graph": step_op_counts(graph, trip_count), "profiled": profiled,
            "kernel_us": sum(op["us"] for op in profiled.values()),
            "step_us": statistics.median(r["dur"] for r in runs)}


def print_decode_profile(path: str, prompt_len: int = 64, steps: int = 16, top: int = 12) -> None:
    p = decode_profile(Path(path), prompt_len, steps)
    graph_nodes, nodes = sum(p["graph"].values()), sum(op["nodes"] for op in p["profiled"].values())
    print(f"{Path(path).name}: {graph_nodes} nodes per step in the graph, {nodes:.0f} run (onnxruntime's fusions); "
          f"step {p['step_us']:.0f} us, kernels {p['kernel_us']:.0f} us")
    for name, op in list(p["profiled"].items())[:top]:
        print(f"  {name:<24} {op['nodes']:6.0f} nodes {op['us']:8.0f} us  ({op['us'] / p['kernel_us']:.0%})")


SNAPSHOT = ("pos", "k", "v", "first", "rest")  # a decoder's cache state (the attributes it has of these)


def _snapshot(decoder) -> dict:
    return {name: getattr(decoder, name) for name in SNAPSHOT if hasattr(decoder, name)}


def _restore(decoder, saved: dict) -> None:
    """Back to a snapshot, nothing pending (the ONNX decoders' caches are arrays a call replaces; the programs' rows
    past pos are rewritten by the next call)."""
    for name, value in saved.items():
        setattr(decoder, name, value)
    decoder.pending_tokens, decoder.pending_states = [], []


def _median_us(call, decoder, saved: dict, calls: int) -> float:
    """Median microseconds of call() over `calls` runs, each from the snapshot `saved` of `decoder`."""
    times = []
    for _ in range(calls):
        _restore(decoder, saved)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def round_costs(path: Path, calls: int = 100, prompt_len: int = 128) -> dict:
    """One thread, at position prompt_len (a prompt cut from the export's calibration windows: real text): median
    microseconds of one full-depth decode step of the KV program, one draft call, one verify call over n = 1 ..
    DEFAULT_DRAFT_LEN + 1 drafted positions, and one full-depth call over n = 1 .. DEFAULT_LOOKUP_LEN + 1 positions
    (a context-guess round: verify_many). path: a .spec.pte (its KV program: the sibling .kv.pte; XNNPACK's weight
    cache on) or any graph of an ONNX speculative set. A round of draft length k costs (k + 1) drafts + verify(k + 1)
    and yields its tokens_per_round: it beats plain decoding where that is less than tokens_per_round steps
    ("break_even"). n positions do not cost n steps: a call's matrix products take its n rows together, in tiles of
    rows whose size is the CPU's and the kernel library's (full_us shows where a tile ends)."""
    prompt = np.load(path.parent / "calibration_set.npz")["windows"][0, :prompt_len]
    if path.suffix == ".pte":
        # XNNPACK's weight cache on, as the bench and ExecuTorch's phone builds run the programs
        kv = path.with_name(path.name.replace(".spec.", ".kv."))
        full, spec = PteDecoder(kv, 1, weight_cache=True), PteSpeculativeDecoder(path, 1, weight_cache=True)
    else:
        files = [path.parent / name for name in speculative_set(path.name)]
        full, spec = OnnxDecoder(files[0], 1), OnnxSpeculativeDecoder(*files, threads=1)
    full.prefill(prompt)
    spec.prefill(prompt)
    token, prefilled = int(prompt[-1]), _snapshot(spec)
    step = _median_us(lambda: full.decode(token), full, _snapshot(full), calls)
    draft = _median_us(lambda: spec.draft(token), spec, prefilled, calls)
    verify = {n: _verify_us(spec, prefilled, token, n, calls) for n in range(1, DEFAULT_DRAFT_LEN + 2)}
    # a context-guess round's positions: real text (the prompt's last n tokens)
    full_us = {n: _guess_round_us(spec, prefilled, prompt[-n:].tolist(), calls)
               for n in range(1, DEFAULT_LOOKUP_LEN + 2)}
    n, m = DEFAULT_DRAFT_LEN + 1, DEFAULT_LOOKUP_LEN + 1
    return {"step_us": step, "draft_us": draft, "verify_us": verify,
            "break_even": (n * draft + verify[n]) / step,  # tokens a round must yield to match plain decoding
            "full_us": full_us, "guess_us": full_us[m], "guess_len": m}


def _verify_us(spec, prefilled: dict, token: int, n: int, calls: int) -> float:
    """Median microseconds of one verify call over n drafted positions (the drafts made once, before the timing)."""
    _restore(spec, prefilled)
    for _ in range(n):
        spec.draft(token)
    pending = (spec.pending_tokens, spec.pending_states)

    def verify_once():
        spec.pending_tokens, spec.pending_states = pending
        spec.verify()
    return _median_us(verify_once, spec, _snapshot(spec), calls)


def _guess_round_us(spec, prefilled: dict, tokens: list[int], calls: int) -> float:
    """Median microseconds of a context-guess round of len(tokens) positions (verify_many)."""
    return _median_us(lambda: spec.verify_many(tokens), spec, prefilled, calls)


def print_round_costs(path: str, calls: int = 100) -> None:
    c = round_costs(Path(path), calls)
    n = DEFAULT_DRAFT_LEN + 1
    print(f"{Path(path).name}: full-depth step {c['step_us']:.0f} us, draft {c['draft_us']:.0f} us "
          f"({c['draft_us'] / c['step_us']:.0%} of a step), verify " +
          ", ".join(f"{k} pos {us:.0f} us" for k, us in c["verify_us"].items()))
    print(f"  a round of {n} drafts + verify({n}) matches plain decoding at {c['break_even']:.2f} tokens per round")
    print("  the full depth over n positions in one call (a context-guess round): " +
          ", ".join(f"{k} pos {us:.0f} us ({us / c['step_us']:.2f} steps)" for k, us in c["full_us"].items()))
