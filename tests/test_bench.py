"""The decode benchmark's ratios and the weight-byte accounting of the .pte programs (fast, no export)."""
import torch

from pathlib import Path

from hrm_edge.measure.bench import (add_adaptive_speedups, add_decode_ratios, lead_rows, mode_words, render_peer_ratios,
                                   speculative_jobs)
from hrm_edge.runtime.manifest import Artifact
from hrm_edge.verify.parity import host_target
from hrm_edge.config import ModelConfig
from hrm_edge.model.lm import HRMLM
from hrm_edge.export.quantize import INT4_GROUP, pte_weight_bytes, weight_bytes


def row(model, artifact, fmt, precision, tps):
    return {"model": model, "artifact": artifact, "format": fmt, "precision": precision, "decode_tokens_per_s": tps,
            "bytes": 1000, "load_s": 0.0, "ttft_ms": 1.0, "prefill_tokens_per_s": 1.0, "peak_rss_mb": 1.0}


def test_each_program_is_compared_with_the_peer_of_its_runtime_and_precision_class():
    rows = [row("hrm", "eager", "eager", "fp32", 100.0),
            row("hrm", "hrm.fp32.kv.pte", "pte", "fp32", 400.0), row("hrm", "hrm.int8-dynamic.kv.pte", "pte", "int8", 600.0),
            row("hrm", "hrm.8da4w.kv.pte", "pte", "int4", 700.0), row("hrm", "hrm.fp32.kv.ort", "ort", "fp32", 300.0),
            row("hrm", "hrm.int8-static-perstep.kv.onnx", "onnx", "int8", 250.0),
            row("baseline", "transformer.int8-dynamic.kv.pte", "pte", "int8", 500.0),
            row("peer", "llama.fp32.pte", "pte", "fp32", 200.0), row("peer", "llama.8da4w.pte", "pte", "int4", 350.0),
            row("peer", "llama.fp32.onnx", "onnx", "fp32", 150.0), row("peer", "llama.int8.onnx", "onnx", "int8", 500.0)]
    add_decode_ratios(rows)
    by = {r["artifact"]: r for r in rows}
    assert by["hrm.fp32.kv.pte"]["peer"] == "llama.fp32.pte" and by["hrm.fp32.kv.pte"]["decode_vs_peer"] == 2.0
    assert by["hrm.int8-dynamic.kv.pte"]["peer"] == "llama.8da4w.pte"  # int8 and 4-bit: one precision class
    assert by["hrm.8da4w.kv.pte"]["decode_vs_peer"] == 2.0
    assert by["hrm.fp32.kv.ort"]["peer"] == "llama.fp32.onnx"  # .ort runs in onnxruntime too
    assert by["hrm.int8-static-perstep.kv.onnx"]["decode_vs_peer"] == 0.5
    assert by["hrm.int8-dynamic.kv.pte"]["decode_vs_baseline"] == 1.2
    assert "decode_vs_peer" not in by["llama.fp32.pte"] and by["eager"]["decode_vs_eager_fp32"] == 1.0
    table = render_peer_ratios({"decode": {"rows": rows, "lead": lead_rows(rows)}})
    # one line per peer: our fastest program of that class
    assert "| hrm.8da4w.kv.pte |" in table and "| hrm.int8-dynamic.kv.pte |" not in table
    assert "**0.50x**" in table and table.count("\n| ") == 4 + 1
    # a depth-dial program (fewer outer cycles) is faster by construction: never someone's peer match
    c1 = row("hrm", "hrm.int8-dynamic.c1.kv.pte", "pte", "int8", 5000.0) | {"full_depth": False}
    rows.append(c1)
    add_decode_ratios(rows)
    assert "decode_vs_peer" not in c1 and "hrm.int8-dynamic.c1" not in render_peer_ratios({"decode": {"rows": rows, "lead": lead_rows(rows)}})
    # a program that failed its parity gate (the opt-in 4-bit one) is not shipped: the next fastest leads
    by["hrm.8da4w.kv.pte"]["passed"] = False
    table = render_peer_ratios({"decode": {"rows": rows, "lead": lead_rows(rows)}})
    assert "| hrm.8da4w.kv.pte |" not in table and "| hrm.int8-dynamic.kv.pte |" in table and "**1.71x**" in table


def test_pte_weight_bytes_count_the_tables_second_copy():
    model = HRMLM(ModelConfig(vocab_size=512, d_model=64, n_heads=4, max_seq_len=32))
    V, D = model.embed.weight.shape
    fp32 = weight_bytes(model, {})
    assert fp32 == 4 * sum(p.numel() for p in model.parameters())
    assert pte_weight_bytes(model, "fp32") == fp32 + 4 * V * D
    int8 = pte_weight_bytes(model, "int8")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # every linear and both table copies int8 (+ a scale per row); the rest fp32
    assert int8 == fp32 - 3 * linear - 4 * V * D + 2 * (V * D + 4 * V) + 4 * sum(
        m.weight.shape[0] for m in model.modules() if isinstance(m, torch.nn.Linear))
    int4 = pte_weight_bytes(model, "int4")
    assert int4 < int8 and model.gate_fast.up.in_features % INT4_GROUP  # (this preset's gate_rank): int8


def test_the_lead_reports_speculative_decoding_apart_from_full_depth():
    rows = [row("hrm", "eager", "eager", "fp32", 100.0),
            row("hrm", "hrm.fp32.kv.onnx", "onnx", "fp32", 300.0),
            row("hrm", "hrm.fp32.kv.onnx", "onnx", "fp32", 450.0) | {"mode": "speculative"},
            row("hrm", "hrm.int8-static-perstep.kv.onnx", "onnx", "int8", 500.0) | {"mode": "speculative",
                                                                                      "passed": False},
            row("peer", "llama.fp32.onnx", "onnx", "fp32", 150.0), row("peer", "llama.int8.onnx", "onnx", "int8", 400.0)]
    add_decode_ratios(rows)
    lead = lead_rows(rows)
    assert [(x["runtime"], x["precision"], x["mode"], x["ratio"]) for x in lead] == [
        ("onnxruntime", "fp32", "full", 2.0), ("onnxruntime", "fp32", "speculative", 3.0)]  # the failing one: none
    assert set(lead[0]) >= {"runtime", "precision", "mode", "ours", "ours_tokens_per_s", "peer", "peer_tokens_per_s",
                            "ratio"}
    assert "| speculative | hrm.fp32.kv.onnx |" in render_peer_ratios({"decode": {"rows": rows, "lead": lead}})


def test_speculative_rows_for_the_executorch_program_and_the_onnx_set():
    """The .pte program holds its draft and verify methods: one file, its own verdict; an ONNX KV graph runs with
    its draft and verify graphs and passes where all three passed."""
    def art(path, fmt, program, passed=True):
        return Artifact.new(path, fmt, "fp32", program, "unrolled", parity={host_target(): {"passed": passed}})

    manifest = {"model": {"arch": "hrm"}, "artifacts": [
        art("hrm.fp32.kv.pte", "pte", "kv_cache"), art("hrm.fp32.spec.pte", "pte", "speculative", passed=False),
        art("hrm.fp32.kv.onnx", "onnx", "kv_cache"), art("hrm.fp32.draft.onnx", "onnx", "draft"),
        art("hrm.fp32.verify.onnx", "onnx", "verify")]}
    jobs = {j.name: j for j in speculative_jobs(Path("out"), manifest)}
    assert set(jobs) == {"eager", "hrm.fp32.spec.pte", "hrm.fp32.kv.onnx"}
    assert all(j.mode == "speculative" for j in jobs.values())
    pte = jobs["hrm.fp32.spec.pte"]
    assert (pte.format, pte.draft, pte.verify, pte.label) == ("pte", "", "", "hrm.fp32.spec.pte (speculative)")
    assert jobs["hrm.fp32.kv.onnx"].draft == "hrm.fp32.draft.onnx" and jobs["hrm.fp32.kv.onnx"].passed
    assert pte.passed is False  # timed, but never the lead


def test_adaptive_rows_their_full_depth_program_and_their_own_lead():
    """Adaptive depth runs the speculative sets with --exit-threshold (a .pte only where the gate checked its skip
    method); each row is compared with the same program at full depth; the lead keeps it apart from the exact modes."""
    def art(path, fmt, program, parity=None):
        return Artifact.new(path, fmt, "fp32", program, "unrolled", parity={host_target(): {"passed": True} | (parity or {})})

    manifest = {"model": {"arch": "hrm"}, "artifacts": [
        art("hrm.fp32.kv.pte", "pte", "kv_cache"), art("hrm.fp32.spec.pte", "pte", "speculative"),
        art("hrm.fp32.kv.onnx", "onnx", "kv_cache"), art("hrm.fp32.draft.onnx", "onnx", "draft"),
        art("hrm.fp32.verify.onnx", "onnx", "verify")]}
    jobs = {j.name: j for j in speculative_jobs(Path("out"), manifest, "adaptive")}
    assert set(jobs) == {"eager", "hrm.fp32.kv.onnx"}  # no adaptive check recorded: a .spec.pte without skip
    manifest["artifacts"][1] = art("hrm.fp32.spec.pte", "pte", "speculative", {"adaptive": {"passed": True, "checked": True}})
    jobs = {j.name: j for j in speculative_jobs(Path("out"), manifest, "adaptive")}
    assert set(jobs) == {"eager", "hrm.fp32.spec.pte", "hrm.fp32.kv.onnx"} and jobs["eager"].label == "eager (adaptive)"
    adaptive = {"mode": "adaptive", "exit_threshold": 0.8, "exit_rate": 0.25}
    rows = [row("hrm", "eager", "eager", "fp32", 100.0), row("hrm", "hrm.fp32.kv.pte", "pte", "fp32", 400.0),
            row("hrm", "hrm.fp32.kv.onnx", "onnx", "fp32", 300.0),
            row("hrm", "eager", "eager", "fp32", 120.0) | adaptive,
            row("hrm", "hrm.fp32.spec.pte", "pte", "fp32", 500.0) | adaptive,
            row("hrm", "hrm.fp32.kv.onnx", "onnx", "fp32", 330.0) | adaptive,
            row("peer", "llama.fp32.pte", "pte", "fp32", 200.0)]
    add_decode_ratios(rows)
    add_adaptive_speedups(rows)
    assert [(r["full_depth_artifact"], round(r["speedup_vs_full_depth"], 3)) for r in rows[3:6]] == [
        ("eager", 1.2), ("hrm.fp32.kv.pte", 1.25), ("hrm.fp32.kv.onnx", 1.1)]
    assert "speedup_vs_full_depth" not in rows[1]
    assert mode_words(rows[4]) == " adaptive, top prob >= 0.8: 25% exited, 1.25x full depth"
    lead = lead_rows(rows)
    assert [(x["mode"], x["ours"], x["ratio"]) for x in lead] == [("full", "hrm.fp32.kv.pte", 2.0),
                                                                   ("adaptive", "hrm.fp32.spec.pte", 2.5)]
