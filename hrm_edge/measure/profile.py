"""Where a decode step of an ONNX KV graph spends its time, by operator type: the nodes the graph runs per
step (the Loop body once per iteration) and onnxruntime's own per-node profile of real decode steps.

    python -c "from hrm_edge.measure.profile import print_decode_profile as p; p('D/hrm.fp32.kv.onnx')"

At batch 1 a step is a few hundred small nodes, so the node count (onnxruntime's dispatch is ~1 us a node)
matters as much as the arithmetic of the matmuls. Profiling itself costs time per node (it records memory
statistics for each): the profiled times say where a step's time goes, not how fast it runs unprofiled.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import onnx

from hrm_edge.export.onnx_passes import step_op_counts
from hrm_edge.runtime.decoders import OnnxDecoder


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
