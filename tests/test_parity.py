"""The parity gate's pure parts, fast: the metrics (log_softmax, perplexity, compare) on arrays built to miss
each tolerance by a known margin, the artifact record's JSON round trip, the report, and check_artifact on a
hand-built ONNX graph (no export, no torch)."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO
from hrm_edge.config import QuantConfig
from hrm_edge.errors import UserError
from hrm_edge.io import sha256_file
from hrm_edge.runtime.adaptive import BRANCH_TOKENS, BRANCH_WINDOWS
from hrm_edge.runtime.manifest import Artifact, manifest_json, read_manifest
from hrm_edge.verify.parity import (BRANCH_ROWS, FP32_TOLERANCE, Tolerance, check_artifact, compare, gate_tolerances,
                                    load_bundle, log_softmax, perplexity, reference_checks, render_report, tolerances,
                                    write_bundle)

N, S, V = 4, 16, 32  # 64 positions


def logits_and_targets(seed=0):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((N, S, V))).astype(np.float32)
    return logits, rng.integers(0, V, size=(N, S))


# ---- metrics ----
def test_log_softmax_normalizes_and_ignores_a_shift():
    x, _ = logits_and_targets()
    lp = log_softmax(x.astype(np.float64))
    assert np.allclose(np.exp(lp).sum(-1), 1.0, atol=1e-12)
    assert np.allclose(log_softmax(x.astype(np.float64) + 1000.0), lp, atol=1e-9)  # no overflow, same result


def test_perplexity_known_values():
    targets = np.zeros((2, 3), dtype=np.int64)
    assert perplexity(np.zeros((2, 3, V), np.float32), targets) == pytest.approx(V)  # uniform: ppl = vocabulary
    # target logit a above the V - 1 others: p = e^a / (e^a + V - 1)
    a = 2.0
    x = np.zeros((2, 3, V), np.float32)
    x[..., 0] = a
    assert perplexity(x, targets) == pytest.approx((math.exp(a) + V - 1) / math.exp(a), rel=1e-6)


def test_compare_identical_passes_with_zero_error():
    ref, targets = logits_and_targets()
    r = compare(ref.copy(), ref, targets, FP32_TOLERANCE, "fp32 eager")
    assert r["passed"] is True and r["reason"] == ""
    assert r["max_abs_logit_error"] == 0.0 and r["top1_agreement"] == 1.0
    assert r["perplexity"] == r["reference_perplexity"]
    assert r["samples"] == N and r["seq_len"] == S
    assert r["tolerance"]["max_abs_logit_error"] == pytest.approx(1e-4 * (ref.max() - ref.min()))


def lower_one_runner_up(ref: np.ndarray, by: float) -> np.ndarray:
    """ref with one non-top logit lowered by `by`: top-1 unchanged, perplexity not raised."""
    out = ref.copy()
    i = np.argsort(out[0, 0])[0]  # the smallest logit of the first position
    out[0, 0, i] -= by
    return out


@pytest.mark.parametrize("factor, passes", [(0.5, True), (1.5, False)])
def test_compare_max_abs_bound(factor, passes):
    ref, targets = logits_and_targets()
    limit = FP32_TOLERANCE.rel_max_abs * float(ref.max() - ref.min())
    r = compare(lower_one_runner_up(ref, factor * limit), ref, targets, FP32_TOLERANCE, "fp32 eager")
    assert r["max_abs_logit_error"] == pytest.approx(factor * limit, rel=1e-3)
    assert r["top1_agreement"] == 1.0 and r["perplexity"] <= r["reference_perplexity"] * (1 + 1e-9)
    assert r["passed"] is passes
    assert r["reason"] == ("" if passes else f"max abs logit error {factor * limit:.3g} > {limit:.3g}")


@pytest.mark.parametrize("flipped, passes", [(3, True), (4, False)])
def test_compare_top1_bound(flipped, passes):
    """64 positions, at least 0.95 must agree: 3 flips (0.953) pass, 4 (0.9375) fail."""
    ref, targets = logits_and_targets()
    out = ref.copy()
    flat = out.reshape(N * S, V)
    for p in range(flipped):  # swap the top two logits of position p
        top2 = np.argsort(flat[p])[-2:]
        flat[p, top2] = flat[p, top2[::-1]]
    tol = Tolerance(rel_max_abs=1.0, min_top1=0.95, max_ppl_ratio=10.0)  # only top-1 can fail
    r = compare(out, ref, targets, tol, "fp32 eager")
    assert r["top1_agreement"] == pytest.approx(1 - flipped / (N * S))
    assert r["passed"] is passes
    assert r["reason"] == ("" if passes else f"top-1 agreement {1 - flipped / (N * S):.4f} < 0.95")


@pytest.mark.parametrize("margin, passes", [(1.01, True), (0.99, False)])
def test_compare_perplexity_bound(margin, passes):
    """Every target logit lowered by 0.25: the perplexity ratio, computed here without the module's helpers, must
    be reported, and a bound 1% above it passes while one 1% below fails."""
    ref, targets = logits_and_targets()
    out = ref.copy()
    np.put_along_axis(out, targets[..., None], np.take_along_axis(out, targets[..., None], -1) - 0.25, -1)
    nll = [np.mean(np.log(np.exp(x.astype(np.float64)).sum(-1)) - np.take_along_axis(x, targets[..., None], -1)[..., 0])
           for x in (ref, out)]
    expected = math.exp(nll[1] - nll[0])
    assert expected > 1.1
    limit = round(margin * expected, 4)
    tol = Tolerance(rel_max_abs=1.0, min_top1=0.0, max_ppl_ratio=limit)  # only perplexity can fail
    r = compare(out, ref, targets, tol, "fp32 eager")
    assert r["perplexity"] / r["reference_perplexity"] == pytest.approx(expected, rel=1e-9)
    assert r["passed"] is passes
    assert r["reason"] == ("" if passes else f"perplexity ratio {expected:.5f} > {limit}")


def test_compare_wrong_shape_and_non_finite_fail():
    ref, targets = logits_and_targets()
    r = compare(ref[:, :-1], ref, targets, FP32_TOLERANCE, "x")
    assert r["passed"] is False and r["reason"] == f"output shape [{N}, {S - 1}, {V}] != reference [{N}, {S}, {V}]"
    bad = ref.copy()
    bad[1, 2, 3] = np.nan
    r = compare(bad, ref, targets, FP32_TOLERANCE, "x")
    assert r["passed"] is False and r["reason"] == "non-finite logits"
    # a NaN in the reference (an edited bundle) made every bound NaN, and NaN > bound is False: a wrong artifact passed
    wrong = ref * 3 + 7
    assert compare(wrong, ref, targets, FP32_TOLERANCE, "x")["passed"] is False
    r = compare(wrong, bad, targets, FP32_TOLERANCE, "x")
    assert r["passed"] is False and r["reason"] == "non-finite reference logits (the bundle)"


# ---- the artifact record ----
ENTRIES = [  # manifest entries as the export writes them (key order of the static int8 KV graph's included)
    {"path": "hrm.fp32.kv.onnx", "format": "onnx", "runtime": "onnxruntime", "precision": "fp32", "program": "kv_cache",
     "iteration": "onnx_loop", "prefill_len": 16, "mobile_usability": {"summary": "ok"}, "bytes": 10, "sha256": "ab",
     "parity": {"x86_64": {"passed": True, "reason": ""}}},
    {"path": "hrm.int8-static-perstep.kv.onnx", "format": "onnx", "runtime": "onnxruntime", "precision": "int8",
     "program": "kv_cache", "iteration": "onnx_loop", "reference": "hrm.int8-static-perstep.onnx", "weight_bytes": 5,
     "quantization": {"mode": "static", "calibration_sha256": "cd"}, "prefill_len": 16, "bytes": 7, "sha256": "ef"},
    {"path": "hrm.int8-dynamic.c1.kv.pte", "format": "pte", "runtime": "executorch", "precision": "int8",
     "program": "kv_cache", "iteration": "unrolled", "backend": "xnnpack", "prefill_len": 16, "cycles": 1,
     "fp32_reference": "reference/fp32.c1", "reference": "hrm.int8-dynamic.c1.kv.pte", "weight_bytes": 3,
     "quantization": {"mode": "dynamic", "calibration_sha256": None}, "bytes": 9, "sha256": "01",
     "targets": {"aarch64": {}}},
    {"path": "hrm.fp32.ort", "format": "ort", "runtime": "onnxruntime", "precision": "fp32", "program": "full_sequence",
     "iteration": "onnx_loop", "converted_from": "hrm.fp32.onnx", "bytes": 11, "sha256": "23"},
]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["path"] for e in ENTRIES])
def test_artifact_json_round_trip(entry):
    art = Artifact.from_json(json.loads(json.dumps(entry)))
    assert art.to_json() == entry
    assert art.format == entry["format"] and art.precision == entry["precision"] and art.program == entry["program"]


def test_artifact_new_fills_runtime_and_backend_and_omits_absent_fields():
    pte = Artifact.new("/x/hrm.fp32.pte", "pte", "fp32", "full_sequence", "unrolled").to_json()
    assert pte == {"path": "hrm.fp32.pte", "format": "pte", "runtime": "executorch", "precision": "fp32",
                   "program": "full_sequence", "iteration": "unrolled", "backend": "xnnpack", "bytes": None,
                   "sha256": None}
    onnx = Artifact.new("hrm.fp32.kv.onnx", "onnx", "fp32", "kv_cache", "onnx_loop", prefill_len=8).to_json()
    assert onnx["runtime"] == "onnxruntime" and "backend" not in onnx and onnx["prefill_len"] == 8


def test_an_artifact_passed_the_gate_only_if_every_recorded_verdict_passed():
    """complete and the demo run an artifact only if every host's verdict passed (complete read the first one)."""
    art = Artifact.from_json(ENTRIES[0])
    assert art.passed_gate()
    art.record_parity("aarch64", {"passed": False, "reason": "top-1 agreement 0.5 < 0.999"})
    assert not art.passed_gate()
    assert not Artifact.from_json({**ENTRIES[0], "parity": {}}).passed_gate()  # never checked


def test_artifact_rejects_unknown_or_missing_fields():
    with pytest.raises(UserError, match="unknown field"):
        Artifact.from_json(ENTRIES[0] | {"colour": "red"})
    with pytest.raises(UserError, match="missing field.*sha256"):
        Artifact.from_json({k: v for k, v in ENTRIES[0].items() if k != "sha256"})


def test_artifact_rejects_fields_of_the_wrong_type():
    """A hand-edited manifest (`"parity": "yes"`, `"precision": 5`) was a traceback in whichever reader touched the
    field first (complete, bench, parity); now one line naming the field. Optional fields may be null, the first six
    may not."""
    for change, needle in [({"parity": "yes"}, "parity (str, not dict)"), ({"precision": 5}, "precision (int, not str)"),
                           ({"parity": {"x86_64": "passed"}}, "parity (a value not a dict"),
                           ({"bytes": True}, "bytes (bool, not int)"), ({"quantization": "nbits"}, "quantization (str"),
                           ({"program": None}, "program (NoneType, not str)")]:
        with pytest.raises(UserError, match=re.escape(needle)):
            Artifact.from_json(ENTRIES[0] | change)
    assert Artifact.from_json(ENTRIES[0] | {"cycles": None, "bytes": None}).cycles is None


def test_manifest_round_trips_through_its_file(tmp_path):
    manifest = {"format_version": 1, "model": {"arch": "hrm"}, "artifacts": [Artifact.from_json(e) for e in ENTRIES]}
    (tmp_path / "manifest.json").write_text(manifest_json(manifest))
    assert json.loads((tmp_path / "manifest.json").read_text())["artifacts"] == ENTRIES
    again = read_manifest(tmp_path)
    assert again["artifacts"] == manifest["artifacts"] and again["model"] == {"arch": "hrm"}
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 2, "artifacts": []}))
    with pytest.raises(UserError, match="unsupported manifest format 2"):
        read_manifest(tmp_path)


# ---- the report ----
def check(reference, max_abs, top1, ppl=10.0):
    return {"reference": reference, "max_abs_logit_error": max_abs, "top1_agreement": top1, "perplexity": ppl,
            "reference_perplexity": 10.0, "tolerance": {"max_abs_logit_error": 1e-3, "min_top1": 0.999}}


def test_report_renders_every_result():
    ok = Artifact.from_json(ENTRIES[0] | {"parity": {"x86_64": {
        "passed": True, "reason": "", "checks": [check("fp32 eager", 2e-6, 1.0)],
        "greedy_decode": {"new_tokens": 64, "identical_to_eager_fp32": True, "matching_prefix": 64}}}})
    bad = Artifact.from_json(ENTRIES[3] | {"parity": {"x86_64": {
        "passed": False, "reason": "vs fp32 eager: top-1 agreement 0.9000 < 0.999",
        "checks": [check("fp32 eager", 5e-4, 0.9, 11.0)]}},
        "targets": {"aarch64": {"max": {"passed": True, "reason": "", "seconds": 3.0, "x86_vs_arm64_max_abs": 1e-7,
                                        "checks": [check("fp32 eager", 3e-6, 1.0)]}}}})
    manifest = {"model": {"arch": "hrm", "d_model": 64}, "block_applications": 4,
                "parameters": {"unique": 1000, "per_application": 3000}, "unique_weight_bytes": 4000,
                "parity_bundle": {"samples": N, "seq_len": S}, "artifacts": [ok, bad], "passed": False,
                "failures": ["hrm.fp32.ort: vs fp32 eager: top-1 agreement 0.9000 < 0.999"],
                "skipped": {"x86_64": [{"path": "hrm.fp32.pte", "reason": "not asked for"}]},
                "targets": {"aarch64": {"passed": True, "failures": [], "skipped": [], "host": "x86_64",
                                        "emulator": "QEMU user mode, qemu-aarch64 10.0", "cpu_models": {
                                            "max": {"seconds": 3.0, "cpu_features": "asimd sve"}},
                                        "versions": {"onnxruntime": "1.2", "numpy": "2.0", "python": "3.11.2"}}}}
    report = render_report(manifest)
    lines = report.splitlines()
    assert lines[0] == "# Parity report"
    assert ("| hrm.fp32.kv.onnx | onnx | fp32 | x86_64 | 10 | fp32 eager | 2.00e-06 | 1.00e-03 | 1.0000 (≥ 0.999) | "
            "10.000 / 10.000 | yes |") in lines
    assert ("| hrm.fp32.ort | ort | fp32 | x86_64 | 11 | fp32 eager | 5.00e-04 | 1.00e-03 | 0.9000 (≥ 0.999) | "
            "11.000 / 10.000 | **NO**: vs fp32 eager: top-1 agreement 0.9000 < 0.999 |") in lines
    assert "| hrm.fp32.kv.onnx | x86_64 | 64 | yes | 64 |" in lines  # the greedy table
    assert "Not checked on x86_64: hrm.fp32.pte (not asked for)" in lines
    assert "Overall: FAILED" in lines and "- hrm.fp32.ort: vs fp32 eager: top-1 agreement 0.9000 < 0.999" in lines
    assert "## aarch64: PASSED" in lines and "- `max` (3 s): asimd sve" in lines
    assert "| hrm.fp32.ort | max | fp32 eager | 3.00e-06 | 1.00e-03 | 1.0000 | 10.000 / 10.000 | 1.00e-07 | – | 3.0 | yes |" in lines


# ---- check_artifact on a real runtime, without an export ----
def table_graph(path, table: np.ndarray) -> None:
    """An ONNX graph logits[n, s] = table[tokens[n, s]]: a stand-in for a model whose logits we choose."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "tokens"], ["logits"], axis=0)], "table",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["n", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", "s", table.shape[1]])],
        [numpy_helper.from_array(table, "table")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def test_check_artifact_passes_the_right_numbers_and_fails_wrong_ones(tmp_path):
    rng = np.random.default_rng(0)
    # rows beyond V are never gathered: they make the file ~270 kB, past the size rule's 256 KiB of graph room
    table = (3 * rng.standard_normal((V + 2100, V))).astype(np.float32)
    windows = rng.integers(0, V, size=(N, S + 1))
    write_bundle(tmp_path / "bundle.npz", windows, table[windows[:, :-1]])
    bundle = load_bundle(tmp_path / "bundle.npz")
    tol = tolerances(QuantConfig())

    def entry(name, t):
        table_graph(tmp_path / name, t)
        return Artifact.new(name, "onnx", "fp32", "full_sequence", "onnx_loop", bytes=(tmp_path / name).stat().st_size,
                            sha256=sha256_file(tmp_path / name))

    good = entry("good.onnx", table)
    r = check_artifact(tmp_path, good, bundle, table.nbytes, tol)
    assert r["passed"] is True and r["checks"][0]["max_abs_logit_error"] == 0.0, r
    assert r["size_limit_bytes"] == int(1.10 * table.nbytes + 256 * 1024)
    r = check_artifact(tmp_path, good, bundle, 0, tol)  # the file holds more than the (claimed) weights
    assert r["passed"] is False and r["reason"] == f"{good.bytes} bytes > size limit {256 * 1024}"
    off = table.copy()
    off[windows[0, 0], 0] += 1.0  # one logit of a position the bundle uses
    r = check_artifact(tmp_path, entry("off.onnx", off), bundle, table.nbytes, tol)
    assert r["passed"] is False and r["reason"].startswith("vs fp32 eager: max abs logit error 1 >"), r["reason"]
    edited = entry("edited.onnx", table)
    edited.sha256 = "0" * 64
    assert check_artifact(tmp_path, edited, bundle, table.nbytes, tol)["reason"].startswith("sha256 mismatch for edited.onnx")
    assert check_artifact(tmp_path, Artifact.new("gone.onnx", "onnx", "fp32", "full_sequence", "onnx_loop"), bundle,
                          table.nbytes, tol) == {"passed": False, "reason": "gone.onnx is missing"}


def test_the_gate_judges_with_its_own_bounds_not_the_manifests():
    """A check of an export took every bound from the manifest it checks: widened there (the same edit that fixes up a
    changed artifact's sha256) they passed an artifact with weights x 1.5. Only the quality bounds a preset chooses
    (int8 / int4 top-1 and perplexity against fp32) are read from it, and they must be in range."""
    chosen = tolerances(QuantConfig(int8_min_top1=0.95, int4_max_ppl_ratio=1.2))
    widened = {k: dict(v) for k, v in chosen.items()}
    for key in ("fp32_vs_fp32_eager", "int8_vs_int8_reference", "int8_vs_fp32_eager"):
        widened[key]["rel_max_abs"] = 10.0
    widened["fp32_vs_fp32_eager"]["min_top1"] = 0.5
    widened["int8_vs_int8_reference"]["max_ppl_ratio"] = 9.0
    assert gate_tolerances({"tolerances": widened}) == chosen
    assert gate_tolerances({}) == tolerances(QuantConfig())
    widened["int8_vs_fp32_eager"]["min_top1"] = 1.5
    with pytest.raises(UserError, match="int8_min_top1 must be in"):
        gate_tolerances({"tolerances": widened})


def test_a_branch_graph_is_compared_with_its_references_first_cycle():
    """A branch graph's logits (BRANCH_ROWS rows per window) are held to the first-cycle eager logits stored with its
    set's adaptive reference, every row; a missing reference is a failure with its reason."""
    rng, p = np.random.default_rng(0), 3
    windows = rng.integers(0, V, size=(BRANCH_WINDOWS + 1, p + BRANCH_TOKENS + 1))
    first = (3 * rng.standard_normal((BRANCH_WINDOWS, BRANCH_TOKENS, V))).astype(np.float32)
    art = Artifact.new("hrm.fp32.branch.onnx", "onnx", "fp32", "branch", "onnx_loop", prefill_len=p)
    bundle, tol = {"windows": windows, "reference/adaptive/fp32/first_cycle": first}, tolerances(QuantConfig())
    logits = np.repeat(first, BRANCH_ROWS, axis=0)
    [check] = reference_checks(art, logits, bundle, tol)
    assert check["passed"] and check["reference"] == "fp32 eager, first outer cycle", check
    logits[-1, 5, 0] += 1.0  # one logit of the last row
    [check] = reference_checks(art, logits, bundle, tol)
    assert not check["passed"] and check["reason"].startswith("max abs logit error 1 >"), check
    del bundle["reference/adaptive/fp32/first_cycle"]
    assert "no first-cycle reference" in reference_checks(art, logits, bundle, tol)


# ---- what the parity module pulls in ----
def test_parity_imports_no_torch_no_trainer_no_emulation():
    code = ("import sys, hrm_edge.verify.parity, hrm_edge.runtime.manifest, hrm_edge.model.checkpoint; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m in "
            "('hrm_edge.train.loop', 'hrm_edge.verify.arm64_gate', 'hrm_edge.verify.reference', "
            "'hrm_edge.model.lm', 'tqdm')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
