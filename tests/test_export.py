"""End to end: tiny preset -> fp32 ONNX (Loop) + fp32 .pte, parity gate, manifest; and the gate failing."""
import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from conftest import REPO, run_module

pytestmark = pytest.mark.slow


def load_manifest(d):
    return json.loads((d / "manifest.json").read_text())


def test_tiny_export_passes(tiny_export):
    m = load_manifest(tiny_export)
    assert m["passed"] is True and m["failures"] == []
    kinds = {(a["format"], a["precision"]) for a in m["artifacts"]}
    assert {("onnx", "fp32"), ("pte", "fp32")} <= kinds
    for art in m["artifacts"]:
        parity = next(iter(art["parity"].values()))
        assert parity["passed"] is True
        assert parity["top1_agreement"] >= 0.999
        assert parity["max_abs_logit_error"] <= 1e-3 * parity["logit_range"]
        assert parity["samples"] >= 4
        # one self-contained file within the size rule
        assert art["bytes"] == (tiny_export / art["path"]).stat().st_size
        assert art["bytes"] <= 1.10 * m["unique_weight_bytes"] + 256 * 1024, art
    assert not list(tiny_export.glob("*.data")), "no external data files"
    for name in ("tokenizer.json", "config.json", "model.safetensors", "parity_report.md"):
        assert (tiny_export / name).is_file()
    assert "PASSED" in (tiny_export / "parity_report.md").read_text()
    assert m["parameters"]["unique"] < m["parameters"]["per_application"]


def test_onnx_iteration_is_a_loop_with_weights_outside(tiny_export):
    model = onnx.load(str(tiny_export / "hrm.fp32.onnx"))
    loops = [n for n in model.graph.node if n.op_type == "Loop"]
    assert len(loops) == 1, [n.op_type for n in model.graph.node]
    body = next(a.g for a in loops[0].attribute if a.name == "body")
    assert sum(n.op_type == "MatMul" for n in body.node) >= 7, "the shared block lives in the Loop body"
    assert len(body.initializer) == 0, "weights belong to the outer graph, stored once"
    m = load_manifest(tiny_export)
    init_bytes = sum(onnx.numpy_helper.to_array(i).nbytes for i in model.graph.initializer)
    assert init_bytes <= 1.02 * m["unique_weight_bytes"]
    names = {i.name for i in model.graph.input}
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert names == {"tokens"} and all(dims), f"dynamic batch and sequence axes: {dims}"


def test_parity_cli_reverifies(tiny_export, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(tiny_export, d)
    proc = run_module("hrm_edge.parity", d)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert load_manifest(d)["passed"] is True


def test_corrupted_artifact_fails(tiny_export, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(tiny_export, d)
    path = d / "hrm.fp32.pte"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    proc = run_module("hrm_edge.parity", d)
    assert proc.returncode == 1
    assert "sha256 mismatch" in proc.stdout + proc.stderr
    m = load_manifest(d)
    assert m["passed"] is False
    pte = next(a for a in m["artifacts"] if a["path"] == "hrm.fp32.pte")
    assert next(iter(pte["parity"].values()))["passed"] is False
    onnx_art = next(a for a in m["artifacts"] if a["path"] == "hrm.fp32.onnx")
    assert next(iter(onnx_art["parity"].values()))["passed"] is True


def test_wrong_numbers_fail_parity(tiny_export, tmp_path):
    """An artifact whose sha256 is in order but whose weights are off must fail on numbers."""
    from hrm_edge.io import sha256_file

    d = tmp_path / "copy"
    shutil.copytree(tiny_export, d)
    path = d / "hrm.fp32.onnx"
    model = onnx.load(str(path))
    init = max(model.graph.initializer, key=lambda i: np.prod(i.dims))  # the embedding table
    w = onnx.numpy_helper.to_array(init).copy()
    w += 0.01 * np.random.default_rng(0).standard_normal(w.shape).astype(w.dtype)
    init.CopyFrom(onnx.numpy_helper.from_array(w, init.name))
    onnx.save(model, str(path))
    m = load_manifest(d)
    art = next(a for a in m["artifacts"] if a["path"] == "hrm.fp32.onnx")
    art["sha256"], art["bytes"] = sha256_file(path), path.stat().st_size
    (d / "manifest.json").write_text(json.dumps(m))
    proc = run_module("hrm_edge.parity", d)
    assert proc.returncode == 1
    assert "max abs logit error" in proc.stdout + proc.stderr


def test_killed_export_leaves_nothing_listed(tiny_export, tmp_path):
    """kill -9 in the middle of an export: no manifest lists a partial artifact; the next run cleans up."""
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)  # an earlier complete export lives here
    cmd = [sys.executable, "-m", "hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out,
           "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    for line in proc.stdout:
        if "ExecuTorch" in line or time.time() > deadline:
            break
    time.sleep(3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "a stale manifest would list files being replaced"
    onnx.checker.check_model(onnx.load(str(out / "hrm.fp32.onnx")), full_check=True)  # complete, not truncated
    proc = run_module("hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out,
                      "--no-progress", "--formats", "onnx")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not list(out.glob(".*.tmp"))
    assert load_manifest(out)["passed"] is True
