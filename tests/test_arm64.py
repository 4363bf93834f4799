"""ARM64 parity under QEMU user-mode emulation (hrm_edge.verify.arm64_*, `python -m hrm_edge.parity DIR --target aarch64`).

The slow tests fetch the toolchain on first use (~4.6 GB into ~/.cache/hrm-edge/aarch64, ~4 min; then cached per
machine) and run every artifact in emulated aarch64 Pythons. They never skip: a machine that cannot fetch the
toolchain fails them with the fetch step's one-line error.
"""
import json
import os
import shutil
import sys

import pytest

from conftest import perturbed_copy, run_module
from hrm_edge.runtime.manifest import Artifact
from hrm_edge.verify import arm64_toolchain as arm64
from hrm_edge.verify.arm64_gate import run_on_target


def load_manifest(d):
    return json.loads((d / "manifest.json").read_text())


# ---- fast: the cache and its steps ----
def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert arm64.cache_dir() == tmp_path / "hrm-edge" / "aarch64"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert arm64.cache_dir() == tmp_path / "home" / ".cache" / "hrm-edge" / "aarch64"


class ScriptToolchain:
    """A toolchain stand-in whose 'emulated Python' is this machine's, running `script` (the worker's stand-in)."""

    def __init__(self, script: str):
        self.script = script

    def command(self, cpu_model, args):
        return [sys.executable, "-c", self.script]

    def env(self, extra_python_path=()):
        return dict(os.environ)


def test_an_emulated_run_is_killed_when_it_stalls_not_when_it_is_long(tmp_path):
    """The target gate kills an emulated process that prints nothing for `timeout` s (a hung artifact), and lets one
    that keeps finishing artifacts run past that time in total; the artifacts it did not get to fail, named."""
    manifest = {"parity_bundle": {"path": "b.npz"}, "unique_weight_bytes": 1, "tolerances": {}}
    arts = [Artifact(path="a.onnx", format="onnx", runtime="onnxruntime", precision="fp32", program="kv_cache",
                     iteration="onnx_loop")]
    steady = "import time\nfor i in range(6):\n    print('artifact', i, flush=True)\n    time.sleep(0.5)"
    run = run_on_target(tmp_path, manifest, arts, "cortex-a76", ScriptToolchain(steady), log=lambda *_: None,
                        timeout=1.5)
    assert run.seconds >= 2.5 and "exit code 0" in run.results["a.onnx"]["reason"], run  # 3 s > 1.5 s in total
    stalled = "import time\nprint('artifact 0', flush=True)\ntime.sleep(30)"
    run = run_on_target(tmp_path, manifest, arts, "cortex-a76", ScriptToolchain(stalled), log=lambda *_: None,
                        timeout=1.5)
    assert run.seconds < 20 and "killed after 2 s without a finished artifact" in run.results["a.onnx"]["reason"]


def test_an_interrupted_step_is_redone_and_a_finished_one_is_not(tmp_path):
    calls = []

    def killed(tmp):  # a download that dies half-way
        (tmp / "half.whl").write_bytes(b"x")
        calls.append("killed")
        raise KeyboardInterrupt

    def complete(tmp):
        (tmp / "lib.so").write_bytes(b"x" * 10)
        calls.append("complete")

    with pytest.raises(KeyboardInterrupt):
        arm64.step(tmp_path, "piece", killed, log=lambda *_: None, what="a piece")
    assert not (tmp_path / "piece").exists() and not list(tmp_path.glob(".piece*")), "nothing half-done is kept"
    (tmp_path / "piece").mkdir()  # a folder without its marker (e.g. from an older, killed layout) is not trusted
    (tmp_path / "piece" / "stale").write_text("?")
    for _ in range(2):
        final = arm64.step(tmp_path, "piece", complete, log=lambda *_: None, what="a piece")
    assert calls == ["killed", "complete"], "fetched once, then taken from the cache"
    assert sorted(p.name for p in final.iterdir()) == [arm64.DONE, "lib.so"]
    assert json.loads((final / arm64.DONE).read_text())["bytes"] == 10


def test_cpu_flag_needs_the_aarch64_target(tmp_path):
    proc = run_module("hrm_edge.parity", tmp_path, "--cpu", "max")
    assert proc.returncode == 2 and "needs --target aarch64" in proc.stderr


# ---- slow: the artifacts on emulated ARM64 ----
# The CLI checks both CPU models and every format by default (~5 min on this 2-core machine); to keep the suite's
# time down the tests split that: every format on the phone-class core, ONNX/ORT (no torch import) on `max`.


def assert_close_to_x86(art: dict, r: dict) -> None:
    """How far ARM64 is from x86 on the same artifact and inputs. fp32: both runtimes compute the same graph and
    differ only in accumulation order and vector width (measured <= 7e-6 on a logit range of 18, i.e. 4e-7 x
    range); the bound is the fp32 gate's own 1e-4 x range. int8: the integer products are exact, but a rounding
    tie of an activation quantizer resolved the other way moves a value by one step and the later iterations carry
    it (static int8 ONNX: 3e-6 with per-step scales, 2.2e-2 with the shared scale), and XNNPACK's dynamic int8
    kernels round the per-token activation quantization differently on x86 and ARM (2.3e-2 = 1.3e-3 x range); the
    bound is the int8 gate's vs-own-reference 1e-2 x range, the same reasoning as that tolerance."""
    logit_range = max(c["logit_range"] for c in r["checks"])  # the model's logits on held-out windows, each check
    bound = (1e-4 if art["precision"] == "fp32" else 1e-2) * logit_range
    assert r["x86_vs_arm64_max_abs"] is not None and r["x86_vs_arm64_max_abs"] <= bound, (art["path"], r)
    assert r["x86_vs_arm64_top1_agreement"] >= (0.999 if art["precision"] == "fp32" else 0.99), (art["path"], r)


@pytest.mark.slow
def test_every_artifact_passes_on_a_phone_class_arm64_core(tiny_export, tmp_path):
    """ONNX, ORT and .pte artifacts, fp32 and int8, full-sequence and KV-cache, on an emulated Cortex-A76."""
    d = tmp_path / "copy"
    shutil.copytree(tiny_export, d)
    proc = run_module("hrm_edge.parity", d, "--target", "aarch64", "--cpu", "cortex-a76", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = load_manifest(d)
    t = m["targets"]["aarch64"]
    assert t["passed"] is True and t["failures"] == [] and t["skipped"] == []
    features = t["cpu_models"]["cortex-a76"]["cpu_features"].split()
    assert "asimddp" in features and "i8mm" not in features and "sve" not in features
    assert {(a["format"], a["precision"], a["program"]) for a in m["artifacts"]} >= {
        (f, p, prog) for f in ("onnx", "ort") for p in ("fp32", "int8") for prog in ("full_sequence", "kv_cache")} | {
        ("pte", "fp32", "full_sequence"), ("pte", "fp32", "kv_cache"), ("pte", "int8", "kv_cache")}
    for art in m["artifacts"]:
        assert set(art["targets"]["aarch64"]) == {"cortex-a76"}, art["path"]
        r = art["targets"]["aarch64"]["cortex-a76"]
        assert r["passed"] is True, (art["path"], r.get("reason"))
        assert_close_to_x86(art, r)
        if art["program"] == "kv_cache" and art["precision"] == "fp32":  # every export stores the greedy tokens
            assert r["greedy_decode"]["identical_to_eager_fp32"] is True, art["path"]
    report = (d / "parity_report.md").read_text()
    assert "## aarch64: PASSED" in report and "x86 vs aarch64 max abs" in report
    assert m["passed"] is True, "the host verdict is left as it was"


# The `-cpu max` run checks what differs from the Cortex-A76 run (i8mm and SVE int8 kernels; the two ways to fail)
# on the int8 programs of each kind (full sequence .onnx and .ort, KV cache), plus a .pte that --formats onnx must
# list as skipped. Every artifact already ran emulated in the A76 test, and emulation is the slow part of the suite
# (all ONNX artifacts of the tiny export on `max`: about 15 minutes on a loaded 2-core machine; this set: about 3).
MAX_CPU_SET = {"hrm.fp32.onnx", "hrm.int8-static-shared.ort", "hrm.int8-static-perstep.onnx",
               "hrm.int8-static-perstep.ort", "hrm.int8-static-perstep.kv.onnx", "hrm.fp32.kv.pte"}


def keep_only(export_dir, names: set) -> None:
    """The export folder's manifest lists only `names` (the other files stay on disk, unlisted, unchecked)."""
    manifest = load_manifest(export_dir)
    assert names <= {a["path"] for a in manifest["artifacts"]}, names
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["path"] in names]
    (export_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_on_max_cpu_onnx_passes_and_tampered_or_perturbed_artifacts_fail(tiny_export, tmp_path):
    """On `-cpu max` (i8mm, SVE: other int8 kernels), with one artifact whose weights are off but whose sha256 was
    fixed up in the manifest (fails on numbers) and one with a changed byte (fails on sha256); the other ONNX
    and ORT artifacts of MAX_CPU_SET pass. --formats onnx: no torch import in the emulated Python."""
    d = perturbed_copy(tiny_export, tmp_path / "copy")  # hrm.fp32.onnx: weights off, sha256 fixed up
    keep_only(d, MAX_CPU_SET)
    perturbed = d / "hrm.fp32.onnx"
    tampered = d / "hrm.int8-static-shared.ort"
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered.write_bytes(bytes(data))

    proc = run_module("hrm_edge.parity", d, "--target", "aarch64", "--cpu", "max", "--formats", "onnx", timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "max abs logit error" in out and "sha256 mismatch for hrm.int8-static-shared.ort" in out
    m = load_manifest(d)
    t = m["targets"]["aarch64"]
    features = t["cpu_models"]["max"]["cpu_features"].split()
    assert "i8mm" in features and "sve" in features
    entries = {a["path"]: a["targets"]["aarch64"] for a in m["artifacts"]}
    r = entries[perturbed.name]["max"]
    assert r["passed"] is False and "max abs logit error" in r["reason"]
    # ARM64 and x86 agree on the perturbed file's (wrong) numbers: the gate compares with the bundle, not the host
    assert r["x86_vs_arm64_max_abs"] < 1e-4 * r["checks"][0]["logit_range"]
    assert "sha256 mismatch" in entries[tampered.name]["max"]["reason"]
    for a in m["artifacts"]:
        if a["format"] == "pte":
            assert entries[a["path"]] == {}
        elif a["path"] not in (perturbed.name, tampered.name):
            assert entries[a["path"]]["max"]["passed"] is True, a["path"]
            assert_close_to_x86(a, entries[a["path"]]["max"])
    assert t["passed"] is False and len(t["failures"]) == 2
    assert {s["path"] for s in t["skipped"]} == {a["path"] for a in m["artifacts"] if a["format"] == "pte"}
    assert "## aarch64: FAILED" in (d / "parity_report.md").read_text()
