"""End to end: tiny preset -> fp32 ONNX (Loop) + fp32 .pte, parity gate, manifest; and the gate failing."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import REPO, perturbed_copy, run_module
from hrm_edge.export import pipeline
from hrm_edge.export.names import artifact_name, ort_name
from hrm_edge.io import sha256_file
from hrm_edge.runtime.manifest import Artifact, read_manifest, verify_files
from hrm_edge.verify.parity import FP32_TOLERANCE, adaptive_key, draft_check, load_bundle

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
        if art["precision"] == "fp32":
            check = parity["checks"][0]
            assert check["reference"].startswith("fp32 eager")
            assert check["top1_agreement"] >= 0.999
            assert check["max_abs_logit_error"] <= 1e-3 * check["logit_range"]
            assert check["samples"] >= 4
        # one self-contained file within the size rule
        assert art["bytes"] == (tiny_export / art["path"]).stat().st_size
        assert art["bytes"] <= 1.10 * art.get("weight_bytes", m["unique_weight_bytes"]) + 256 * 1024, art["path"]
    assert not list(tiny_export.glob("*.data")), "no external data files"
    for name in ("tokenizer.json", "config.json", "model.safetensors", "parity_report.md"):
        assert (tiny_export / name).is_file()
    assert "PASSED" in (tiny_export / "parity_report.md").read_text()
    assert m["parameters"]["unique"] < m["parameters"]["per_application"]
    table = m["model"]["vocab_size"] * m["model"]["d_model"]
    for art in m["artifacts"]:
        if art["format"] == "pte" and art["program"] == "kv_cache" and art["precision"] == "fp32":
            # the head runs in XNNPACK with its own copy of the tied table: stated, and counted by the size rule
            assert art["table_copies"] == 2 and art["weight_bytes"] == m["unique_weight_bytes"] + 4 * table
            assert art["bytes"] > m["unique_weight_bytes"] + 3 * table
    web = m["web_bundle"]
    assert (tiny_export / web["path"]).stat().st_size == web["bytes"] <= 2 * 1024 * 1024
    assert sha256_file(tiny_export / web["path"]) == web["sha256"]


def test_depth_dial(tiny_export):
    """--cycles 1: the 1-cycle artifacts are gated against the eager model at depth 1 (not the full depth),
    their ONNX Loop runs half the steps, and the manifest reports each depth's quality."""
    m = load_manifest(tiny_export)
    dial = {d["cycles"]: d for d in m["depth_dial"]}
    assert set(dial) == {1, 2} and dial[1]["block_applications"] == 2 and dial[2]["block_applications"] == 4
    assert dial[2]["top1_vs_full_depth"] == 1.0 and dial[1]["top1_vs_full_depth"] < 1.0
    depth1 = {a["path"]: a for a in m["artifacts"] if a.get("cycles") == 1}
    assert {"hrm.fp32.c1.onnx", "hrm.fp32.c1.ort", "hrm.int8-dynamic.c1.kv.pte"} <= set(depth1)
    for art in depth1.values():
        parity = next(iter(art["parity"].values()))
        assert parity["passed"] is True, art["path"]
        if art["program"] == "kv_cache":  # replays the 1-cycle eager model's greedy continuation
            assert parity["greedy_decode"]["new_tokens"] == 64
        assert all(c["reference"] != "fp32 eager" for c in parity["checks"])
    fp32 = next(iter(depth1["hrm.fp32.c1.onnx"]["parity"].values()))["checks"][0]
    assert fp32["reference"] == "fp32 eager, 1 outer cycle(s)" and fp32["max_abs_logit_error"] <= 1e-4 * fp32["logit_range"]
    # the 1-cycle graph differs from the full one: gating it against the full-depth logits would fail
    bundle = np.load(tiny_export / "parity_bundle.npz")
    assert np.abs(bundle["reference/fp32.c1"] - bundle["fp32_logits"]).max() > 100 * fp32["max_abs_logit_error"]


def test_onnx_iteration_is_a_loop_with_each_weight_stored_once(tiny_export):
    model = onnx.load(str(tiny_export / "hrm.fp32.onnx"))
    loops = [n for n in model.graph.node if n.op_type == "Loop"]
    assert len(loops) == 1, [n.op_type for n in model.graph.node]
    body = next(a.g for a in loops[0].attribute if a.name == "body")
    assert sum(n.op_type == "MatMul" for n in body.node) >= 7, "the shared block lives in the Loop body"
    # the shared block's weights are the body's (onnx_passes.weights_into_body), the tied table the main graph's
    cfg = json.loads((tiny_export / "config.json").read_text())
    D, F = cfg["d_model"], cfg["ffn_hidden"]
    body_shapes = sorted(tuple(i.dims) for i in body.initializer if len(i.dims) == 2)
    assert body_shapes.count((D, F)) == 2 and body_shapes.count((F, D)) == 1, body_shapes
    assert max(model.graph.initializer, key=lambda i: np.prod(i.dims)).name == "model.embed.weight"
    inits = list(model.graph.initializer) + list(body.initializer)
    assert len({i.name for i in inits}) == len(inits)
    m = load_manifest(tiny_export)
    init_bytes = sum(onnx.numpy_helper.to_array(i).nbytes for i in inits)
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
    d = perturbed_copy(tiny_export, tmp_path / "copy")
    proc = run_module("hrm_edge.parity", d)
    assert proc.returncode == 1
    assert "max abs logit error" in proc.stdout + proc.stderr


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of /proc/PID/stat: the parent pid
            kids.append(int(stat.parent.name))
    return kids


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="ignore")
    except OSError:  # it ended meanwhile
        return ""


def test_killed_export_leaves_nothing_listed(tiny_export, tmp_path):
    """kill -9 in the middle of an export: the earlier export in the folder stays whole (every file matches its
    manifest); the next run cleans up."""
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)  # an earlier complete export lives here
    cmd = [sys.executable, "-m", "hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out,
           "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    for line in proc.stdout:
        if "ExecuTorch" in line or time.time() > deadline:
            break
    time.sleep(3)
    workers = children_of(proc.pid)  # the .pte lowering workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert workers, "the export lowers its .pte programs in worker processes"
    for _ in range(50):  # they die with the export (PR_SET_PDEATHSIG), not minutes later
        if not any("spawn" in cmdline(pid) for pid in workers):  # "" once it is gone
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"worker processes {workers} outlived the killed export")
    # the run wrote into its staging folder only: the earlier export is still whole, manifest and files alike
    verify_files(out, read_manifest(out))
    onnx.checker.check_model(onnx.load(str(out / "hrm.fp32.onnx")), full_check=True)  # complete, not truncated
    proc = run_module("hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out,
                      "--no-progress", "--formats", "onnx", "--int8", "none")  # enough to clean up after the killed run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not list(out.glob(".*.tmp")) and not (out / ".export-staging").exists()  # the killed run's leftovers
    assert load_manifest(out)["passed"] is True
    # the earlier export's programs this ONNX-only one did not make are gone, not left of the earlier model
    assert not list(out.glob("*.pte")) and not (out / "calibration.json").exists()
    assert (out / "checkpoint" / "model.safetensors").is_file()


def test_ctrl_c_stops_the_export_with_one_line(tiny_export, tmp_path):
    """Ctrl-C in the middle of the .pte lowering (SIGINT to the export's process group, as a terminal sends it), with
    --verbose (the workers' stderr is the terminal's): the export exits 130 and ends with the one line `interrupted`,
    with no worker's KeyboardInterrupt traceback (the workers leave Ctrl-C to the export, which terminates them) and
    no leaked-semaphore warning from multiprocessing's resource tracker (torch.fx's progress bars made tqdm's lock a
    multiprocessing one in each worker, and a terminated worker never gave it back); the workers are gone and the
    earlier export in the folder stays whole. The signal comes once a worker has written a program into the staging
    folder (its lowering, progress bars included, has run) while the others are still lowering."""
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    cmd = [sys.executable, "-m", "hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out,
           "--no-progress", "--verbose"]
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:  # files: never full
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=REPO,
                                start_new_session=True,  # a process group of its own: the signal reaches no test
                                env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 600
        while not list((out / ".export-staging").glob("*.pte")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        workers = [pid for pid in children_of(proc.pid) if "spawn_main" in cmdline(pid)]
        assert workers, "the export lowers its .pte programs in worker processes, and they were still lowering"
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # a failed check above: stop it, not leave it to compete with the suite
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130 and err.splitlines()[-1:] == ["interrupted"], err[-1000:]
    assert "Traceback" not in err and "leaked semaphore" not in err, err[-3000:]
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    verify_files(out, read_manifest(out))
    assert not (out / ".export-staging").exists()


def test_a_new_export_removes_what_the_earlier_one_wrote_and_it_did_not(tmp_path, monkeypatch):
    """An export into an earlier export's folder left the earlier artifacts its manifest no longer lists (of the
    earlier model: a reader that opens hrm.fp32.kv.pte by name took them). They are removed after the new manifest is
    in place; files no export writes, and the checkpoint's, stay; a listed name outside the folder is never touched."""
    out = tmp_path / "out"
    out.mkdir()
    listed = [{"path": name} for name in ("hrm.fp32.kv.pte", "hrm.fp32.onnx", "../outside.txt", "model.safetensors")]
    (out / "manifest.json").write_text(json.dumps({"artifacts": listed}))
    earlier = ("hrm.fp32.kv.pte", "hrm.fp32.onnx", "calibration.json", "notes.txt", "config.json", "model.safetensors")
    for name in earlier:
        (out / name).write_text("earlier")
    (tmp_path / "outside.txt").write_text("not the export's")

    def stages(out_dir, staging, options, log):
        (staging / "hrm.fp32.onnx").write_text("new")
        (staging / "manifest.json").write_text(json.dumps({"artifacts": [{"path": "hrm.fp32.onnx"}]}))
        (staging / "parity_report.md").write_text("report")
        return True

    monkeypatch.setattr(pipeline, "check_inputs", lambda options: None)
    monkeypatch.setattr(pipeline, "export_stages", stages)
    logs = []
    assert pipeline.export_all(out, pipeline.ExportOptions(), log=logs.append)
    assert not (out / "hrm.fp32.kv.pte").exists() and not (out / "calibration.json").exists()
    assert (out / "hrm.fp32.onnx").read_text() == "new"
    assert (out / "notes.txt").exists() and (out / "config.json").exists() and (tmp_path / "outside.txt").exists()
    assert (out / "model.safetensors").read_text() == "earlier"  # listed as an artifact, but a checkpoint's file
    assert any("removed 2 files of the earlier export" in line for line in logs), logs


def test_int8_artifacts_pass_and_are_recorded(tiny_export):
    m = load_manifest(tiny_export)
    fp32 = {a["format"]: a for a in m["artifacts"] if a["precision"] == "fp32"}
    int8 = [a for a in m["artifacts"] if a["precision"] in ("int8", "int4")]
    assert {a["format"] for a in int8} == {"onnx", "ort", "pte"}
    assert {a["quantization"]["mode"] for a in int8 if a["precision"] == "int4"} == {"8da4w"}
    assert {a["quantization"]["mode"] for a in int8 if a["format"] == "pte"} == {"dynamic", "8da4w"}
    assert {a["quantization"]["activation_scales"] for a in int8 if a["format"] == "onnx"} == {"per_step", "shared"}
    for a in m["artifacts"]:
        if a["format"] == "onnx":
            verdict = a["mobile_usability"]  # onnxruntime's analysis ran (no "error") and its report is kept
            assert verdict.get("nnapi_or_coreml_may_help") is not None and "error" not in verdict, (a["path"], verdict)
            assert any("CoreML" in line for line in verdict["summary"]), (a["path"], verdict)
        if a["format"] == "ort":
            assert (tiny_export / a["converted_from"]).is_file()
    assert (tiny_export / "required_operators.config").read_text().strip()
    assert m["calibration"]["tokens_sha256"] and m["calibration"]["split"] == "calib"
    assert m["tolerances"]["int8_vs_fp32_eager"]["max_ppl_ratio"] <= 1.02
    for a in int8:
        r = next(iter(a["parity"].values()))
        assert r["passed"] is True, r
        assert a["bytes"] < 0.6 * fp32[a["format"]]["bytes"], "int8 must be a fraction of the fp32 artifact"
        if a["program"] == "branch":  # one check, against its reference's first cycle (test_speculative_graphs_...)
            continue
        vs_ref, vs_fp32 = r["checks"][:2]
        if a["program"] == "draft":  # then its own readout against its reference's first cycle
            assert r["checks"][2]["reference"].endswith("(the draft's own readout)") and len(r["checks"]) == 3
        assert vs_ref["reference"].startswith(f"{a['precision']} eager reference")
        assert vs_fp32["reference"].startswith("fp32 eager")
        # tighter against its own int8 reference than against fp32
        assert vs_ref["max_abs_logit_error"] < vs_fp32["max_abs_logit_error"]
        bound = m["tolerances"][f"{a['precision']}_vs_fp32_eager"]["max_ppl_ratio"]
        assert vs_fp32["perplexity"] <= bound * vs_fp32["reference_perplexity"]
        if a["quantization"]["mode"] == "static":
            assert a["quantization"]["calibration_sha256"] == m["calibration"]["tokens_sha256"]


def test_static_int8_onnx_keeps_the_loop_with_integer_ops_inside(tiny_export):
    for name in ("hrm.int8-static-perstep.onnx", "hrm.int8-static-shared.onnx"):
        model = onnx.load(str(tiny_export / name))
        m = load_manifest(tiny_export)
        loops = [n for n in model.graph.node if n.op_type == "Loop"]
        assert len(loops) == 1
        body = next(a.g for a in loops[0].attribute if a.name == "body")
        ops = [n.op_type for n in body.node]
        # wq, wk, wv read one input with one scale: one quantization, one MatMulInteger, split after; so do
        # w_up and w_gate; wo and w_down alone: 4 integer matmuls for 7 linears, no fp32 MatMul of a block weight
        assert ops.count("QuantizeLinear") == 4 and ops.count("MatMulInteger") == 4
        # queries and keys stay side by side for one RoPE (onnx_passes.merge_split_concat): the wq+wk+wv split
        # has two pieces, [q k] and v, and no Concat re-joins pieces of a split
        splits = [n for n in body.node if n.op_type == "Split" and n.name.startswith("q8.")]
        assert sorted(len(n.output) for n in splits) == [2, 2], [list(n.output) for n in splits]
        pieces = {o for n in body.node if n.op_type == "Split" for o in n.output}
        assert not [n for n in body.node if n.op_type == "Concat" and set(n.input) <= pieces]
        inits = {i.name: i for i in list(model.graph.initializer) + list(body.initializer)}
        weights = [i for i in inits.values() if i.data_type == onnx.TensorProto.UINT8 and len(i.dims) == 2]
        cfg = json.loads((tiny_export / "config.json").read_text())
        D, F, V = cfg["d_model"], cfg["ffn_hidden"], cfg["vocab_size"]
        assert sorted(tuple(i.dims) for i in weights) == sorted([(D, 3 * D), (D, D), (D, 2 * F), (F, D), (D, V)]), \
            "7 block linears in 4 groups + the tied embedding [D, V], each stored once"
        # uint8 x uint8 (int8 values + 128): per-step activation zero points are uint8, one per block application
        zero_points = [i for i in inits.values() if i.name.endswith(".x_zero_point")]
        assert len(zero_points) == 4 and all(i.data_type == onnx.TensorProto.UINT8 for i in zero_points)
        assert all(list(i.dims) == [m["block_applications"]] for i in zero_points)
        assert "q8.embed.w_uint8_t" in {i.name for i in model.graph.initializer}, "the table: main graph"
        assert {"q8.attn.wo.w_uint8", "q8.attn.wo.x_scale"} <= {i.name for i in body.initializer}, "block: body"
        scales = onnx.numpy_helper.to_array(inits["q8.attn.wo.x_scale"])
        assert scales.shape == (m["block_applications"],)
        if "perstep" in name:
            # a trained model's shared block sees different ranges at different steps
            assert len(set(scales.tolist())) > 1, scales
        else:
            assert len(set(scales.tolist())) == 1


def test_calibration_ranges_are_saved_per_step(tiny_export):
    cal = json.loads((tiny_export / "calibration.json").read_text())
    T = load_manifest(tiny_export)["block_applications"]
    for name, r in cal["activation_ranges"]["linears"].items():
        assert len(r["min"]) == len(r["max"]) == T
        assert all(lo < 0 < hi for lo, hi in zip(r["min"], r["max"]))


def test_kv_cache_programs_decode_like_the_full_model(tiny_export):
    m = load_manifest(tiny_export)
    kv = [a for a in m["artifacts"] if a["program"] == "kv_cache"]
    assert {(a["format"], a["precision"]) for a in kv} == {(f, p) for f in ("onnx", "ort", "pte") for p in ("fp32", "int8")} | {
        ("pte", "int4")}
    for a in kv:
        r = next(iter(a["parity"].values()))
        assert r["passed"] is True and 0 < a["prefill_len"] < m["parity_bundle"]["seq_len"]
        assert r["greedy_decode"]["new_tokens"] == 64
        if a["precision"] == "fp32":
            assert r["greedy_decode"]["identical_to_eager_fp32"] is True
            assert r["checks"][0]["max_abs_logit_error"] < 1e-4 * r["checks"][0]["logit_range"]
    onnx_kv = None
    for a in kv:
        if a["path"] == "hrm.fp32.kv.onnx":
            onnx_kv = onnx.load(str(tiny_export / a["path"]))
    assert "Loop" in [n.op_type for n in onnx_kv.graph.node]
    assert [i.name for i in onnx_kv.graph.input] == ["tokens", "past_k", "past_v"]
    assert [o.name for o in onnx_kv.graph.output] == ["logits", "present_k", "present_v"]


def test_speculative_graphs_pass_as_a_set(tiny_export):
    """The draft and verify graphs (fp32, and int8 with the per-step plan) each pass the gate as self-speculative
    decoding with their KV graph, and the ExecuTorch programs with draft and verify methods (fp32, int8 dynamic)
    with their own: logits at every verified position vs the eager references, and the greedy continuation; fp32
    reproduces the eager model's greedy tokens exactly."""
    m = load_manifest(tiny_export)
    spec = [a for a in m["artifacts"] if a["program"] in ("draft", "verify", "speculative")]
    assert sorted(a["path"] for a in spec) == sorted([f"hrm.{p}.{g}.onnx" for p in ("fp32", "int8-static-perstep")
                                                      for g in ("draft", "verify")]
                                                     + ["hrm.fp32.spec.pte", "hrm.int8-dynamic.spec.pte"])
    pte = {a["path"]: a for a in spec if a["format"] == "pte"}
    assert pte["hrm.int8-dynamic.spec.pte"]["reference"] == "hrm.int8-dynamic.kv.pte"  # the same quantized model
    assert all(0 < a["prefill_len"] < m["parity_bundle"]["seq_len"] for a in pte.values())
    for a in spec:
        r = next(iter(a["parity"].values()))
        assert r["passed"] is True and r["greedy_decode"]["new_tokens"] == 64
        if a["precision"] == "fp32":
            assert r["greedy_decode"]["identical_to_eager_fp32"] is True
            assert r["checks"][0]["max_abs_logit_error"] < 1e-4 * r["checks"][0]["logit_range"]
    # adaptive depth, once per set: exits as the eager rule's, logits within the artifact's own tolerance
    for a in [a for a in spec if a["program"] in ("verify", "speculative")]:
        r = next(iter(a["parity"].values()))["adaptive"]
        assert r["checked"] and r["passed"] and r["depth_agreement"] >= 0.99 and r["threshold"] == 0.8, (a["path"], r)
        assert r["positions_compared"] >= r["positions"] / 4
        assert r["max_abs_logit_error"] <= r["tolerance"]["max_abs_logit_error"]
        assert ("artifact's exits" if a["precision"] == "fp32" else "bundle's") in r["compared_with"]
    assert not [a for a in spec if a["program"] == "draft" and "adaptive" in next(iter(a["parity"].values()))]
    # a draft graph's own readout is checked too (its set's verify rounds return the verify graph's logits): against
    # its reference's first cycle; a reference that is off by +0.5 everywhere fails it
    draft = Artifact.from_json(next(a for a in spec if a["path"] == "hrm.fp32.draft.onnx"))
    bundle = load_bundle(tiny_export / "parity_bundle.npz")
    assert draft_check(tiny_export / draft.path, draft, bundle, FP32_TOLERANCE)["passed"]
    key = adaptive_key(draft) + "/first_cycle"
    assert not draft_check(tiny_export / draft.path, draft, bundle | {key: bundle[key] + 0.5}, FP32_TOLERANCE)["passed"]
    with np.load(tiny_export / "parity_bundle.npz") as bundle:
        assert {"reference/adaptive/fp32/exited", "reference/adaptive/hrm.int8-dynamic.kv.pte/logits",
                "reference/adaptive/hrm.int8-static-perstep.onnx/logits"} <= set(bundle.files)
    # the suggestion bar's branch graphs, beside each draft graph: first-cycle logits of rows sharing a context
    branches = [a for a in m["artifacts"] if a["program"] == "branch"]
    assert sorted(a["path"] for a in branches) == [f"hrm.{p}.branch.onnx" for p in ("fp32", "int8-static-perstep")]
    for a in branches:
        [check] = next(iter(a["parity"].values()))["checks"]
        assert check["passed"] and "first" in check["reference"] and check["top1_agreement"] >= 0.98, (a["path"], check)
    with np.load(tiny_export / "parity_bundle.npz") as bundle:
        assert bundle["reference/adaptive/fp32/first_cycle"].shape[0] == 2  # windows (BRANCH_WINDOWS)
    assert [i.name for i in onnx.load(str(tiny_export / "hrm.fp32.branch.onnx")).graph.input] == [
        "tokens", "context_k", "context_v", "past_k", "past_v"]
    draft = onnx.load(str(tiny_export / "hrm.fp32.draft.onnx"))
    verify = onnx.load(str(tiny_export / "hrm.fp32.verify.onnx"))
    assert [o.name for o in draft.graph.output] == ["logits", "state", "present_k", "present_v"]
    assert [i.name for i in verify.graph.input] == ["tokens", "state", "past_k", "past_v"]
    for g in (draft, verify):
        assert [n.op_type for n in g.graph.node].count("Loop") == 1


def test_nbits_graphs_pass_as_a_set(tiny_export, tmp_path):
    """--int8 nbits (the default and shipped presets make these; the shared tiny export does not): the 8- and 4-bit
    MatMulNBits forms of the full-sequence and KV graphs, their .ort files and their draft, branch and verify graphs
    each pass against their own eager reference, every block linear inside the Loop is a MatMulNBits of its bits,
    and the KV graphs shrink with the bits."""
    out = tmp_path / "nbits"
    proc = run_module("hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out, "--formats", "onnx",
                      "--int8", "nbits", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = load_manifest(out)
    nbits = {a["path"]: a for a in m["artifacts"] if (a.get("quantization") or {}).get("mode") == "nbits"}
    assert sorted(nbits) == sorted([f"hrm.{p}.{g}" for p in ("int8-nbits", "int4-nbits")
                                    for g in ("onnx", "ort", "kv.onnx", "kv.ort", "draft.onnx", "branch.onnx",
                                              "verify.onnx")])
    for path, a in nbits.items():
        r = next(iter(a["parity"].values()))
        assert r["passed"] is True and path.startswith(f"hrm.{a['precision']}-nbits."), (path, r)
        assert r["checks"][0]["reference"].startswith(f"{a['precision']} eager reference"), (path, r["checks"][0])
    size = {p: (out / f"hrm.{p}.kv.onnx").stat().st_size for p in ("fp32", "int8-nbits", "int4-nbits")}
    assert size["int4-nbits"] < size["int8-nbits"] < 0.5 * size["fp32"], size
    for bits in (8, 4):
        graph = onnx.load(str(out / f"hrm.int{bits}-nbits.kv.onnx"))
        [loop] = [n for n in graph.graph.node if n.op_type == "Loop"]
        body = [n for n in loop.attribute[0].g.node if n.op_type == "MatMulNBits"]
        # q/k/v (fused), the output projection, up (fused with its gate) and down; the low-rank memory gates stay fp32
        assert len(body) == 4 and all(next(x.i for x in n.attribute if x.name == "bits") == bits for n in body)


BLOCK_TORCH = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError: proves the path never imports it
from hrm_edge.verify.parity import main
code = main([sys.argv[1], '--bundle-only', '--formats', 'onnx'])
assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m] is not None)
sys.exit(code)
"""


def test_bundle_only_checks_onnx_without_torch(tiny_export, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(tiny_export, d)
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH, str(d)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "NOT checked" in proc.stdout and "hrm.fp32.pte" in proc.stdout
    m = load_manifest(d)
    skipped = next(iter(m["skipped"].values()))
    assert {s["path"] for s in skipped} == {a["path"] for a in m["artifacts"] if a["format"] == "pte"}


def test_artifact_names():
    assert artifact_name("hrm", "fp32", "onnx") == "hrm.fp32.onnx"
    assert artifact_name("hrm", "int8-static-perstep", "onnx", "kv_cache") == "hrm.int8-static-perstep.kv.onnx"
    assert artifact_name("hrm", "int8-dynamic", "pte", "kv_cache", n_cycles=1) == "hrm.int8-dynamic.c1.kv.pte"
    assert artifact_name("transformer", "fp32", "pte", "kv_cache") == "transformer.fp32.kv.pte"
    assert ort_name("out/hrm.fp32.kv.onnx") == "hrm.fp32.kv.ort"
    assert artifact_name("hrm", "int8-static-perstep", "onnx", "verify") == "hrm.int8-static-perstep.verify.onnx"
    assert artifact_name("hrm", "int8-dynamic", "pte", "speculative") == "hrm.int8-dynamic.spec.pte"
    with pytest.raises(ValueError):
        artifact_name("hrm", "fp32", "tflite")
