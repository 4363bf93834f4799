"""Trust what runs on the phone (issue 10): every reader verifies what it loads against the manifest, manifests
stay inside their folder, and user mistakes (a checkpoint that does not fit its config, a bad preset, a corpus
smaller than a window, a foreign or busy --out, a full disk) are one `error:` line with exit code 2.

The fast tests use a small hand-made export (mini_export: a random tiny model and the shipped tokenizer,
listed with sha256s) that --runtime eager runs; the slow ones export a tiny checkpoint for real."""
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, run_module
from test_cli_errors import assert_user_error  # exit 2, no traceback, one `error:` line with each needle
from hrm_edge.app.demo import export_routes
from hrm_edge.model.checkpoint import CONFIG, TOKENIZER, WEIGHTS, load_model, save_model
from hrm_edge.config import ModelConfig, QuantConfig, load_preset
from hrm_edge.errors import UserError
from hrm_edge.export.pipeline import EXPORT_MARKER, STAGING, check_output_folder
from hrm_edge.io import (atomic_write_bytes, folder_lock, one_line_write_errors, publish, sha256_file, staging_folder,
                         write_failure)
from hrm_edge.runtime.manifest import (Artifact, contained_path, expected_sha256, manifest_json, read_manifest,
                                      verify_files)
from hrm_edge.model.lm import HRMLM
from hrm_edge.train.tokenizer import bos_id, eos_id, load_tokenizer
from hrm_edge.verify.parity import REPORT, run_gate, tolerances

SHIPPED_TOKENIZER = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
FAKE_KV = "hrm.fp32.kv.onnx"  # bytes that are not ONNX: what an edited artifact run with --no-verify looks like


def mini_export(root: Path) -> Path:
    """A small consistent export folder: a random tiny model (config.json, model.safetensors), the shipped
    tokenizer, a parity bundle, and one fake KV-cache ONNX artifact; every file listed with its sha256."""
    root.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(SHIPPED_TOKENIZER)
    torch.manual_seed(0)
    model = HRMLM(ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_heads=4, max_seq_len=256, H_cycles=1,
                              L_cycles=1)).eval()
    save_model(root, model)
    shutil.copyfile(SHIPPED_TOKENIZER, root / "tokenizer.json")
    rng = np.random.default_rng(0)
    np.savez(root / "parity_bundle.npz", windows=rng.integers(0, 64, (2, 17)),
             fp32_logits=rng.standard_normal((2, 16, 64)).astype(np.float32))
    (root / FAKE_KV).write_bytes(b"not really onnx" * 10)
    art = Artifact.new(FAKE_KV, "onnx", "fp32", "kv_cache", "onnx_loop", prefill_len=4, bytes=150,
                       sha256=sha256_file(root / FAKE_KV), parity={"x86_64": {"passed": True}})
    manifest = {"format_version": 1, "model": dataclasses.asdict(model.cfg), "artifacts": [art], "passed": True,
                "tokenizer": {"path": "tokenizer.json", "sha256": sha256_file(root / "tokenizer.json"),
                              "vocab_size": tok.get_vocab_size(), "bos_id": bos_id(tok), "eos_id": eos_id(tok)},
                "parity_bundle": {"path": "parity_bundle.npz", "sha256": sha256_file(root / "parity_bundle.npz"),
                                  "samples": 2, "seq_len": 16},
                "block_applications": model.cfg.n_steps, "parameters": {"unique": 1, "per_application": 1},
                "checkpoint": {"config": CONFIG, "weights": WEIGHTS, "weights_sha256": sha256_file(root / WEIGHTS)},
                "unique_weight_bytes": (root / WEIGHTS).stat().st_size, "tolerances": tolerances(QuantConfig())}
    (root / "manifest.json").write_text(manifest_json(manifest))
    return root


def edit_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def export_dir(tmp_path):
    return mini_export(tmp_path / "export")


# ---- 2. manifests cannot point outside their folder ----
def test_contained_path_refuses_every_way_out(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "outside").write_text("x")
    (tmp_path / "e" / "in").write_text("x")
    assert contained_path(tmp_path / "e", "in") == tmp_path / "e" / "in"
    for bad in ("../outside", "/etc/passwd", "a/../../outside", "", "a\0b", 7, None, ["in"]):
        with pytest.raises(UserError, match="not a plain path inside"):
            contained_path(tmp_path / "e", bad)
    (tmp_path / "e" / "link").symlink_to(tmp_path / "outside")
    (tmp_path / "e" / "loop").symlink_to(tmp_path / "e" / "loop")
    for bad in ("link", "loop"):
        with pytest.raises(UserError, match="link to a file outside"):
            contained_path(tmp_path / "e", bad)
    (tmp_path / "e" / "inner").symlink_to(tmp_path / "e" / "in")  # a link that stays inside is a file inside
    assert contained_path(tmp_path / "e", "inner").read_text() == "x"


@pytest.mark.parametrize("entry", ["artifact", "tokenizer", "parity_bundle", "web_bundle", "weights"])
def test_read_manifest_refuses_a_path_outside_before_opening_it(export_dir, entry):
    paths = {"artifact": lambda m: m["artifacts"][0].update(path="../../etc/passwd"),
             "tokenizer": lambda m: m["tokenizer"].update(path="/etc/passwd"),
             "parity_bundle": lambda m: m["parity_bundle"].update(path="../x.npz"),
             "web_bundle": lambda m: m.update(web_bundle={"path": "../../w.bin", "sha256": "0" * 64}),
             "weights": lambda m: m["checkpoint"].update(weights="sub/../../w.safetensors")}
    edit_manifest(export_dir, paths[entry])
    with pytest.raises(UserError, match="not a plain path inside the export folder"):
        read_manifest(export_dir)


@pytest.mark.parametrize("command", [("hrm_edge.parity", "{dir}"), ("hrm_edge.bench", "{dir}"),
                                     ("hrm_edge.complete", "--artifacts", "{dir}", "--runtime", "onnx", "def "),
                                     ("hrm_edge.demo", "{dir}")])
def test_every_reader_refuses_dotdot_before_opening_the_file(tmp_path, command):
    """The `..` target is a FIFO: a reader that opened it would block there (and time out here) instead of
    refusing the folder with one line."""
    root = mini_export(tmp_path / "a" / "b")
    os.mkfifo(tmp_path / "fifo")
    edit_manifest(root, lambda m: m["artifacts"][0].update(path="../../fifo"))
    proc = run_module(command[0], *[c.format(dir=root) for c in command[1:]], timeout=120)
    assert_user_error(proc, "'../../fifo'", "not a plain path inside")


def test_a_symlink_leaving_the_folder_is_refused(export_dir, tmp_path):
    (tmp_path / "elsewhere.onnx").write_bytes((export_dir / FAKE_KV).read_bytes())
    (export_dir / FAKE_KV).unlink()
    (export_dir / FAKE_KV).symlink_to(tmp_path / "elsewhere.onnx")
    for module, args in (("hrm_edge.parity", [export_dir]), ("hrm_edge.bench", [export_dir, "--no-verify"]),
                         ("hrm_edge.complete", ["--artifacts", export_dir, "--runtime", "onnx", "--no-verify", "x"])):
        assert_user_error(run_module(module, *args), f"{FAKE_KV} in", "link to a file outside")


# ---- 1. verify before use ----
def test_verify_files_names_the_modified_file_and_no_verify_skips_it(export_dir):
    manifest = read_manifest(export_dir)
    assert verify_files(export_dir, manifest) == [export_dir / p for p in
                                                  (FAKE_KV, "tokenizer.json", "parity_bundle.npz", WEIGHTS, CONFIG)]
    flip_byte(export_dir / "parity_bundle.npz")
    with pytest.raises(UserError, match=r"^parity_bundle.npz does not match the sha256 in .*--no-verify"):
        verify_files(export_dir, manifest)
    unchecked = verify_files(export_dir, manifest, ["parity_bundle.npz"], no_verify=True)
    assert unchecked == [export_dir / "parity_bundle.npz"]
    (export_dir / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="tokenizer.json is missing"):
        verify_files(export_dir, manifest, ["tokenizer.json"], no_verify=True)  # missing is never skipped


@pytest.mark.parametrize("command", ["bench", "parity", "peers", "complete"])
def test_a_manifest_without_its_model_or_bundle_is_one_line(export_dir, command):
    """Every export writes "model", "tokenizer" and "parity_bundle"; a manifest without one (edited by hand) was a
    KeyError deep in bench, parity, peers and complete. Readers that do not need them (tests' small manifests) are
    not affected: the commands check what they read."""
    needs = {"peers": ("model",), "complete": ("model", "tokenizer")}.get(command, ("model", "parity_bundle"))
    for drop in needs:
        edit_manifest(export_dir, lambda m: m.pop(drop))
        args = ["--artifacts", export_dir, "def "] if command == "complete" else [export_dir]
        assert_user_error(run_module(f"hrm_edge.{command}", *args), f"has no '{drop}' entry", "re-export")
        shutil.rmtree(export_dir)
        mini_export(export_dir)


@pytest.mark.parametrize("command", ["parity", "complete"])
def test_a_manifest_with_bad_sizes_or_bytes_is_one_line(export_dir, command):
    """A model size readers index (missing, or not a positive integer), parity's tolerances and size bound, or a
    manifest that is not UTF-8: one line, not a KeyError, TypeError or UnicodeDecodeError in the command."""
    args = ["--artifacts", export_dir, "def "] if command == "complete" else [export_dir]
    edits = [(lambda m: m["model"].pop("max_seq_len"), "'model.max_seq_len'"),
             (lambda m: m["model"].update(H_cycles="2"), "'model.H_cycles'")]
    if command == "parity":
        edits += [(lambda m: m.pop("tolerances"), "'tolerances'"),
                  (lambda m: m.update(unique_weight_bytes=None), "'unique_weight_bytes'")]
    for edit, needle in edits:
        edit_manifest(export_dir, edit)
        assert_user_error(run_module(f"hrm_edge.{command}", *args), needle, "re-export")
        shutil.rmtree(export_dir)
        mini_export(export_dir)
    (export_dir / "manifest.json").write_bytes(b"\xff")
    assert_user_error(run_module(f"hrm_edge.{command}", *args), "is not valid JSON")


def test_a_config_that_is_not_the_manifests_model_is_refused(export_dir):
    cfg = json.loads((export_dir / CONFIG).read_text())
    (export_dir / CONFIG).write_text(json.dumps(cfg | {"rope_theta": 500.0}))
    with pytest.raises(UserError, match="config.json .* does not match the manifest's model .*rope_theta"):
        verify_files(export_dir, read_manifest(export_dir), [CONFIG])


def test_bench_no_verify_on_a_file_that_is_not_onnx(export_dir):
    """--no-verify runs what it finds: a file that is not ONNX is one line naming it (it was the benchmark child's
    traceback), not a RuntimeError carrying the child's stderr."""
    proc = run_module("hrm_edge.bench", export_dir, "--no-verify", "--repeats", "1", "--rounds", "1", "--no-baseline",
                      "--prompt-len", "8", "--new-tokens", "4")
    assert_user_error(proc, f"onnxruntime cannot load {FAKE_KV}", "INVALID_PROTOBUF")


@pytest.mark.parametrize("name, args", [("model.safetensors", ["--runtime", "eager"]),
                                        ("config.json", ["--runtime", "eager"]),
                                        ("tokenizer.json", ["--runtime", "eager"]),
                                        (FAKE_KV, ["--runtime", "onnx"])])
def test_complete_refuses_a_flipped_byte_and_no_verify_loads_it(export_dir, name, args):
    path = export_dir / name
    if name == "config.json":  # a byte of a JSON number: still valid JSON, another model
        text = path.read_text()
        path.write_text(text.replace('"rope_theta": 10000.0', '"rope_theta": 10001.0'))
        assert path.read_text() != text
    else:
        flip_byte(path)
    assert_user_error(run_module("hrm_edge.complete", "--artifacts", export_dir, *args, "--max-new-tokens", "4", "def "),
                      name, "does not match", "--no-verify")
    proc = run_module("hrm_edge.complete", "--artifacts", export_dir, *args, "--max-new-tokens", "4", "--no-verify",
                      "def ")
    if name == FAKE_KV:  # it is loaded, and onnxruntime cannot parse it: still one line, naming it
        assert_user_error(proc, f"onnxruntime cannot load {FAKE_KV}")
    elif name == TOKENIZER and proc.returncode == 2:  # the flip hit the JSON's structure: one line, naming it
        assert_user_error(proc, f"{TOKENIZER} is not a valid tokenizer.json")
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith("def ") and "decode" in proc.stdout.splitlines()[-1]


def test_complete_runs_a_verified_export(export_dir):
    proc = run_module("hrm_edge.complete", "--artifacts", export_dir, "--runtime", "eager", "--max-new-tokens", "5",
                      "import os\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("import os\n") and "[eager model.safetensors, 1 thread(s)]" in proc.stdout


def test_bench_refuses_a_modified_file_before_running_anything(export_dir):
    flip_byte(export_dir / WEIGHTS)
    assert_user_error(run_module("hrm_edge.bench", export_dir, "--no-baseline"), WEIGHTS, "does not match the sha256")


def test_bench_checks_where_it_writes_before_running_anything(export_dir, tmp_path):
    """--json goes where the results are written after minutes of timing: a folder, or a path below a file, is
    refused at once (it was a traceback after the benchmark)."""
    (tmp_path / "a_file").write_text("x")
    for path, needle in [(tmp_path, "is a folder, not a file to write"),
                         (tmp_path / "a_file" / "b.json", "a_file is a file, not a folder")]:
        proc = run_module("hrm_edge.bench", export_dir, "--no-baseline", "--json", path)
        assert_user_error(proc, needle)
        assert "decode benchmark" not in proc.stdout


def test_parity_reports_modified_weights_by_name(export_dir):
    flip_byte(export_dir / WEIGHTS, 0.9)
    proc = run_module("hrm_edge.parity", export_dir, "--formats", "onnx")
    assert proc.returncode == 1
    assert f"{WEIGHTS} does not match the sha256" in proc.stderr


def test_the_gate_keeps_an_earlier_verdict_only_for_the_file_it_was_given_for(export_dir):
    """An artifact the run does not check (its format skipped) keeps its earlier verdict only while its sha256 is
    the manifest's, and the report says the verdict is an earlier run's; a listed web bundle that was modified fails
    the run (the gate re-checks every file the clients read)."""
    skip = {"onnx": "not asked for (--formats pte)"}
    assert run_gate(export_dir, read_manifest(export_dir), recompute_reference=False, log=lambda *a: None, skip=skip,
                    eager=False)
    assert read_manifest(export_dir)["artifacts"][0].parity["x86_64"]["passed"] is True
    assert "yes (an earlier run's; not checked by this one)" in (export_dir / REPORT).read_text()
    (export_dir / FAKE_KV).write_bytes(b"changed since it was checked")
    assert not run_gate(export_dir, read_manifest(export_dir), recompute_reference=False, log=lambda *a: None,
                        skip=skip, eager=False)
    art = read_manifest(export_dir)["artifacts"][0]
    assert art.parity["x86_64"] == {"passed": False, "reason": "modified since it was checked (sha256)"}
    shutil.rmtree(export_dir)
    mini_export(export_dir)
    (export_dir / "web_bundle.bin").write_bytes(b"HRMWEB01 edited")
    edit_manifest(export_dir, lambda m: m.update(web_bundle={"path": "web_bundle.bin", "sha256": "0" * 64}))
    assert not run_gate(export_dir, read_manifest(export_dir), recompute_reference=False, log=lambda *a: None,
                        skip=skip, eager=False)
    assert "web_bundle.bin is missing or modified (sha256)" in read_manifest(export_dir)["failures"]


def test_demo_uses_the_shared_check(export_dir):
    """The demo serves only verified files; a listed web bundle is checked like an artifact."""
    (export_dir / "web_bundle.bin").write_bytes(b"web bundle bytes")
    edit_manifest(export_dir, lambda m: m.update(web_bundle={"path": "web_bundle.bin",
                                                             "sha256": sha256_file(export_dir / "web_bundle.bin")}))
    routes, config = export_routes(export_dir, read_manifest(export_dir), verify=True, log=lambda *_: None)
    assert set(routes) == {"/export/tokenizer.json", f"/export/{FAKE_KV}", "/export/web_bundle.bin"}
    assert config["default_model"] == FAKE_KV and config["models"][0]["passed"] is True
    flip_byte(export_dir / "web_bundle.bin")
    with pytest.raises(UserError, match="^web_bundle.bin does not match the sha256.*--no-verify"):
        export_routes(export_dir, read_manifest(export_dir), verify=True, log=lambda *_: None)
    routes, _ = export_routes(export_dir, read_manifest(export_dir), verify=False, log=lambda *_: None)
    assert routes["/export/web_bundle.bin"] == export_dir / "web_bundle.bin"


def test_verification_is_fast_next_to_loading():
    """What verification adds to `complete`'s start-up: sha256 of the files it loads. Measured here on a
    16 MB file (the size of the default model's fp32 KV graph): well under a tenth of a second."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f"
        path.write_bytes(os.urandom(16 << 20))
        t = time.perf_counter()
        sha256_file(path)
        assert time.perf_counter() - t < 0.5


# ---- 3. one line for every user mistake ----
def test_checkpoint_whose_config_does_not_fit_its_weights(tmp_path):
    torch.manual_seed(0)
    save_model(tmp_path, HRMLM(ModelConfig(vocab_size=64, d_model=32, n_heads=4, max_seq_len=16, H_cycles=1,
                                           L_cycles=1)))
    cfg = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps(cfg | {"vocab_size": 80}))
    with pytest.raises(UserError) as e:
        load_model(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / WEIGHTS) in message
    assert "tensor 'embed.weight' has shape [64, 32] in the file, [80, 32] from the config" in message, message
    shutil.copyfile(REPO / "hrm_edge" / "default_model" / TOKENIZER, tmp_path / TOKENIZER)  # every file is there
    proc = run_module("hrm_edge.export", "--checkpoint", tmp_path, "--out", tmp_path / "out")
    assert_user_error(proc, "embed.weight", "[64, 32]", "[80, 32]", WEIGHTS)
    (tmp_path / CONFIG).write_text(json.dumps(cfg | {"gating": False}))
    with pytest.raises(UserError, match=r"file has tensor 'gate_fast.bias' \[32\], which the config has no place for"):
        load_model(tmp_path)


@pytest.mark.parametrize("table, values, needle", [
    ("model", {"n_heads": 0}, "model.n_heads must be > 0, got 0"),
    ("model", {"d_model": 66, "n_heads": 4}, "d_model (66) must be divisible by n_heads (4)"),
    ("model", {"d_model": "wide"}, "model.d_model must be an integer, got 'wide'"),
    ("model", {"gate_dropout": 1.5}, "model.gate_dropout must be in [0, 1)"),
    ("model", {"norm_eps": float("nan")}, "model.norm_eps must be > 0"),
    ("train", {"steps": -5}, "train.steps must be > 0, got -5"),
    ("train", {"lr": 0.0}, "train.lr must be > 0"),
    ("train", {"batch_size": True}, "train.batch_size must be an integer, got True"),
    ("data", {"val_percent": 60, "calib_percent": 60}, "val_percent + data.calib_percent must be <= 100"),
    ("quant", {"calib_samples": 0}, "quant.calib_samples must be > 0"),
    ("train", {"colour": "red"}, "unknown key(s) colour"),
])
def test_bad_presets_are_one_line(tmp_path, table, values, needle):
    raw = tomllib.loads((REPO / "hrm_edge" / "train" / "presets" / "tiny.toml").read_text())
    raw[table] = raw.get(table, {}) | values
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(f"[{t}]\n" + "\n".join(f"{k} = {toml_value(v)}" for k, v in kv.items())
                              for t, kv in raw.items()) + "\n")
    with pytest.raises(UserError) as e:
        load_preset(str(path))
    assert needle in str(e.value) and str(path) in str(e.value), str(e.value)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v != v:
        return "nan"
    return json.dumps(v)


def test_a_bad_preset_through_the_cli(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text((REPO / "hrm_edge" / "train" / "presets" / "tiny.toml").read_text().replace("n_heads = 4", "n_heads = 0"))
    assert_user_error(run_module("hrm_edge.train", "--preset", path, "--out", tmp_path / "o"), "n_heads must be > 0")
    assert_user_error(run_module("hrm_edge.export", "--preset", path, "--out", tmp_path / "o2"), "n_heads must be > 0")


def test_config_json_that_is_not_json(tmp_path):
    save_model(tmp_path, HRMLM(ModelConfig(vocab_size=64, d_model=32, n_heads=4, max_seq_len=16, H_cycles=1,
                                           L_cycles=1)))
    for text in ("{not json", "[1, 2]", '{"d_model": null}'):
        (tmp_path / CONFIG).write_text(text)
        with pytest.raises(UserError, match="config.json"):
            load_model(tmp_path)


def test_corpus_smaller_than_one_window(tmp_path, text_corpus):
    preset = tmp_path / "long.toml"
    preset.write_text((REPO / "hrm_edge" / "train" / "presets" / "tiny.toml").read_text()
                      .replace("seq_len = 64", "seq_len = 4000").replace("max_seq_len = 128", "max_seq_len = 4096"))
    proc = run_module("hrm_edge.train", "--preset", preset, "--corpus", text_corpus, "--out", tmp_path / "o",
                      "--no-progress")
    assert_user_error(proc, "smaller than one window", "4001")


def unreadable_checkpoint(root: Path) -> Path:
    """A checkpoint folder whose files are all there, its weights unreadable: an export of it gets past the input and
    output-folder checks and the lock, and then fails in one line ("cannot load model.safetensors")."""
    ckpt = root / "ckpt"
    ckpt.mkdir()
    for name in (CONFIG, TOKENIZER):
        shutil.copyfile(REPO / "hrm_edge" / "default_model" / name, ckpt / name)
    (ckpt / WEIGHTS).write_bytes(b"not safetensors")
    return ckpt


def test_out_that_holds_other_files_is_refused(tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"jpeg")
    proc = run_module("hrm_edge.export", "--checkpoint", unreadable_checkpoint(tmp_path), "--out", out)
    assert_user_error(proc, f"--out {out} is not an export folder", "holiday.jpg")
    assert sorted(p.name for p in out.iterdir()) == ["holiday.jpg"]  # nothing was written into it


def test_an_export_folder_or_the_checkpoint_itself_is_accepted(tmp_path, export_dir):
    check_output_folder(tmp_path / "new", None)  # created
    check_output_folder(export_dir, None)  # has a manifest
    (export_dir / "manifest.json").unlink()
    with pytest.raises(UserError, match="not an export folder"):
        check_output_folder(export_dir, None)
    check_output_folder(export_dir, export_dir)  # exporting a checkpoint into its own folder
    (export_dir / EXPORT_MARKER).write_text("")  # a folder an export wrote (a killed one too)
    check_output_folder(export_dir, None)


def test_a_second_export_into_a_locked_folder_is_refused(tmp_path):
    """The lock is held here (as a running export holds it); an export started meanwhile refuses, naming the
    holder's pid; once released the same command gets past the lock."""
    out, checkpoint = tmp_path / "out", unreadable_checkpoint(tmp_path)
    out.mkdir()
    with folder_lock(out, EXPORT_MARKER):
        assert (out / EXPORT_MARKER).read_text() == f"pid {os.getpid()}\n"
        proc = run_module("hrm_edge.export", "--checkpoint", checkpoint, "--out", out)
        assert_user_error(proc, f"is being written by another run (pid {os.getpid()})")
    assert (out / EXPORT_MARKER).read_text() == ""
    assert_user_error(run_module("hrm_edge.export", "--checkpoint", checkpoint, "--out", out),
                      "cannot load model.safetensors")


def test_a_stale_lock_of_a_killed_export_is_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone (a run killed with -9 leaves its pid in the file, and no lock)
    (out / EXPORT_MARKER).write_text(f"pid {dead.pid}\n")
    (out / STAGING).mkdir()
    (out / STAGING / "hrm.fp32.onnx").write_bytes(b"half a graph")  # what it had written
    proc = run_module("hrm_edge.export", "--checkpoint", unreadable_checkpoint(tmp_path), "--out", out)
    assert_user_error(proc, "cannot load model.safetensors")  # past the lock: the real mistake is reported
    assert f"the run of pid {dead.pid} did not finish (killed?); taking over its stale lock" in proc.stdout
    assert not (out / STAGING).exists()
    assert (out / EXPORT_MARKER).read_text() == ""


# ---- 5. out of disk: the pieces ----
def test_write_failure_is_found_through_causes_and_worker_messages():
    try:
        try:
            raise OSError(27, "File too large", "/x/hrm.fp32.pte")
        except OSError as e:
            raise RuntimeError("lowering failed") from e
    except RuntimeError as e:
        assert write_failure(e).filename == "/x/hrm.fp32.pte"
    assert write_failure(RuntimeError(f"ORT conversion failed: ... OSError: [Errno 28] {os.strerror(28)}")).errno == 28
    assert write_failure(ValueError("bad shape")) is None
    assert write_failure(OSError(2, "No such file or directory")) is None
    with pytest.raises(UserError, match=r"^cannot write a.bin into /out: No space left on device"):
        with one_line_write_errors(Path("/out")):
            raise OSError(28, os.strerror(28), "/out/.export-staging/a.bin")


def test_atomic_write_over_a_file_size_limit_names_the_file_and_leaves_nothing(tmp_path):
    def child():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    code = ("import sys; from pathlib import Path; from hrm_edge.io import atomic_write_bytes\n"
            "try:\n    atomic_write_bytes(Path(sys.argv[1]), bytes(200_000))\n"
            "except OSError as e:\n    print(e.errno, e.filename)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.bin")], capture_output=True, text=True,
                          preexec_fn=child, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.split() == ["27", str(tmp_path / "big.bin")], proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []  # no temp file, no partial file


def test_a_failed_staged_write_leaves_the_folder_as_it_was(tmp_path):
    (tmp_path / "manifest.json").write_text("old manifest")
    (tmp_path / "a.onnx").write_text("old a")
    with pytest.raises(OSError):
        with staging_folder(tmp_path, ".staging") as staging:
            atomic_write_bytes(staging / "a.onnx", b"new a")
            raise OSError(28, os.strerror(28))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "manifest.json"]
    assert (tmp_path / "a.onnx").read_text() == "old a"
    with staging_folder(tmp_path, ".staging") as staging:
        atomic_write_bytes(staging / "a.onnx", b"new a")
        atomic_write_bytes(staging / "b.onnx", b"new b")
        atomic_write_bytes(staging / "manifest.json", b"new manifest")
        publish(staging, tmp_path, last=("manifest.json",))
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "a.onnx": "new a", "b.onnx": "new b", "manifest.json": "new manifest"}


# ---- the slow end-to-end checks: real exports of the suite's tiny checkpoint ----
@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_export):
    """The checkpoint the suite's shared tiny export was made from."""
    return tiny_export / "checkpoint"


@pytest.fixture(scope="module")
def onnx_export(tiny_checkpoint, tmp_path_factory):
    """Its fp32 ONNX artifacts alone: what the out-of-disk test exports again under a file-size limit (so the
    limit can sit between this export's largest graph and its parity bundle)."""
    out = tmp_path_factory.mktemp("reliab") / "onnx"
    proc = run_module("hrm_edge.export", "--checkpoint", tiny_checkpoint, "--out", out, "--formats", "onnx",
                      "--int8", "none", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_out_of_disk_ends_in_one_line_and_keeps_the_previous_export(onnx_export, tiny_checkpoint, tmp_path):
    """The second export runs under a file-size limit between its largest ONNX file and its parity bundle:
    the graphs and .ort files are written, the bundle is not. One error line naming the bundle; no staging
    folder, no temp file; the folder's previous export is untouched and still passes parity."""
    out = tmp_path / "out"
    shutil.copytree(onnx_export, out)
    before = {p.name: sha256_file(p) for p in out.iterdir() if p.is_file()}
    sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file()}
    bundle = sizes.pop("parity_bundle.npz")
    largest = max(sizes[n] for n in sizes if n.endswith((".onnx", ".ort", ".safetensors")))
    assert largest < bundle, sizes  # the limit lets the graphs through and stops the bundle
    limit = (largest + bundle) // 2

    def child():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "hrm_edge.export", "--checkpoint", str(tiny_checkpoint), "--out",
                           str(out), "--formats", "onnx", "--int8", "none", "--no-progress"], capture_output=True,
                          text=True, preexec_fn=child, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          timeout=900)
    assert_user_error(proc, "cannot write parity_bundle.npz", "File too large", "nothing was published")
    assert "wrote 2 ONNX graphs" in proc.stdout  # it failed part-way, not at the start
    after = {p.name: sha256_file(p) for p in out.iterdir() if p.is_file()}
    assert after == before  # nothing listed, nothing replaced, no temp or staging file left
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == []
    proc = run_module("hrm_edge.parity", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_complete_refuses_each_flipped_artifact_of_a_real_export(tiny_export, tmp_path):
    """A byte flipped in the middle of each file `complete --runtime onnx` or `eager` loads: exit 2, one line
    naming the file; the untouched copy completes."""
    cases = {"hrm.fp32.kv.onnx": "onnx", "tokenizer.json": "onnx", WEIGHTS: "eager"}
    for name, runtime in cases.items():
        d = tmp_path / name
        shutil.copytree(tiny_export, d)
        flip_byte(d / name)
        proc = run_module("hrm_edge.complete", "--artifacts", d, "--runtime", runtime, "--max-new-tokens", "8", "def ")
        assert_user_error(proc, f"{name} does not match the sha256", "--no-verify")
    proc = run_module("hrm_edge.complete", "--artifacts", tiny_export, "--runtime", "onnx", "--max-new-tokens", "8",
                      "def ")
    assert proc.returncode == 0 and proc.stdout.startswith("def "), proc.stderr[-2000:]



@pytest.mark.slow
def test_a_cut_program_loaded_unverified_is_one_line_with_executorchs_reason(tiny_export, tmp_path):
    """`complete --no-verify` on a .pte cut short: ExecuTorch's own reason (it writes it to fd 2 from C++) is part
    of the one error line, and nothing else is printed (it was a native line above the error)."""
    d = tmp_path / "cut"
    shutil.copytree(tiny_export, d)
    os.truncate(d / "hrm.fp32.kv.pte", 100_000)
    proc = run_module("hrm_edge.complete", "--artifacts", d, "--runtime", "executorch", "--no-verify",
                      "--max-new-tokens", "4", "def ")
    assert_user_error(proc, "executorch cannot load hrm.fp32.kv.pte", "File size is too small")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

# ---- 6. reproducible artifacts ----
# Two exports of one checkpoint (the seeds come from the checkpoint and the artifact, not from the options): which
# files are the same bytes. The others differ in layout only, never in what they compute (docs/parity.md): their
# parity numbers are identical. The second export makes a subset of the first's programs (the fp32 ONNX graphs, the
# per-step static int8 graphs and the fp32 KV .pte, `--int8 static --pte-programs kv_cache`): one .pte lowering
# instead of seven, the slow part of an export.

@pytest.fixture(scope="module")
def two_full_exports(tiny_export, tmp_path_factory):
    """The suite's tiny export and a second export of its checkpoint making a subset of its artifacts."""
    out = tmp_path_factory.mktemp("reliab") / "second"
    proc = run_module("hrm_edge.export", "--checkpoint", tiny_export / "checkpoint", "--out", out,
                      "--int8", "static", "--pte-programs", "kv_cache", "--no-progress", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [tiny_export, out]


def parity_numbers(art: Artifact) -> dict:
    result = next(iter(art.parity.values()))
    return {"passed": result["passed"], "greedy": result.get("greedy_decode"),
            "checks": [{k: c.get(k) for k in ("reference", "max_abs_logit_error", "top1_agreement", "perplexity",
                                               "reference_perplexity")} for c in result.get("checks", [])]}


@pytest.mark.slow
def test_two_exports_are_byte_identical_but_ort_and_pte_layout(two_full_exports):
    first, second = (read_manifest(d) for d in two_full_exports)
    a, b = expected_sha256(first), expected_sha256(second)
    assert set(b) <= set(a) and len(b) < len(a)
    # what follows the set of artifacts made: the bundles (below, array by array) and onnxruntime's operator list
    for name in ("parity_bundle.npz", "web_bundle.bin"):
        a.pop(name), b.pop(name)
    for name in ("calibration.json", "calibration_set.npz"):
        a[name], b[name] = (sha256_file(d / name) for d in two_full_exports)
    differ = {name for name in b if a[name] != b[name]}
    # may differ in layout only (docs/parity.md): .ort (onnxruntime's converter writes its kernel-type-string
    # table in hash-map order) and .pte (XNNPACK's lowering orders some delegate calls' inputs per process)
    assert not {name for name in differ if not name.endswith((".ort", ".pte"))}, sorted(differ)
    assert [p for p in b if p.endswith(".onnx")] and [p for p in b if p.endswith(".pte")] == ["hrm.fp32.kv.pte"]
    arts = {x.path: x for x in first["artifacts"]}
    for y in second["artifacts"]:
        assert parity_numbers(arts[y.path]) == parity_numbers(y), y.path
    bundles = [np.load(d / "parity_bundle.npz") for d in two_full_exports]
    assert set(bundles[1].files) <= set(bundles[0].files)
    for key in bundles[1].files:
        np.testing.assert_array_equal(bundles[0][key], bundles[1][key], err_msg=key)
    assert first["model"] == second["model"] and first["tolerances"] == second["tolerances"]


@pytest.mark.slow
def test_complete_refuses_each_flipped_program_of_a_real_export(tiny_export, tmp_path):
    """The ExecuTorch programs and the int8 ones too: a flipped byte is refused before the runtime sees it."""
    export = tiny_export
    manifest = read_manifest(export)
    kv = [a for a in manifest["artifacts"] if a.program == "kv_cache" and a.format in ("onnx", "pte")
          and a.cycles is None and next(iter(a.parity.values()))["passed"]]
    assert {(a.format, a.precision) for a in kv} >= {("onnx", "fp32"), ("pte", "fp32")}, [a.path for a in kv]
    for art in kv:
        d = tmp_path / art.path
        shutil.copytree(export, d)
        flip_byte(d / art.path)
        runtime = "onnx" if art.format == "onnx" else "executorch"
        proc = run_module("hrm_edge.complete", "--artifacts", d, "--runtime", runtime, "--precision", art.precision,
                          "--max-new-tokens", "8", "def ")
        assert_user_error(proc, f"{art.path} does not match the sha256", "--no-verify")
