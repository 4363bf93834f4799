"""python -m hrm_edge.demo: the CLI's one-line errors, the server's file table, and (slow) the page in a real
headless Chromium at a phone's viewport against the shipped default model's ONNX export."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, run_module
from hrm_edge.app.demo import (DemoHandler, addresses_to_open, export_routes, kind, kv_artifacts, listen, page_default,
                              served_files, with_shared_weights)
from hrm_edge.app.shared_weights import page_form, share_weights
from hrm_edge.errors import UserError
from hrm_edge.export.onnx_passes import NbitsFormat, blockwise_quantize, nbits_node
from hrm_edge.io import sha256_file
from hrm_edge.runtime.adaptive import AdaptiveDecoder, TopProbRule
from hrm_edge.runtime.manifest import Artifact
from hrm_edge.runtime.speculative import OnnxSpeculativeDecoder
from hrm_edge.train.tokenizer import load_tokenizer
from hrm_edge.verify.parity import load_bundle, read_manifest
from hrm_edge.verify.web_bundle import check_web_bundle, kv_logits, read_web_bundle, write_web_bundle
from test_cli_errors import assert_user_error

CHROMIUM = "/usr/bin/chromium"
# flags that work for Debian's chromium as root in a container (no sandbox, no GPU, no network chatter)
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True, "has_touch": True}
PROMPT = "import os\ndef "


# ---- a small fake export: what export_routes reads, with consistent sha256s ----
def fake_export(root: Path, kv: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    (root / "tokenizer.json").write_text('{"model": {}}')
    np.savez(root / "parity_bundle.npz", windows=rng.integers(0, 64, (2, 17)),
             fp32_logits=rng.standard_normal((2, 16, 64)).astype(np.float32))
    (root / "m.kv.onnx").write_bytes(b"not really onnx")
    arts = [{"path": "m.kv.onnx", "format": "onnx", "runtime": "onnxruntime", "iteration": "onnx_loop", "precision": "fp32", "program": "kv_cache" if kv else "full_sequence",
             "prefill_len": 4, "bytes": 15, "sha256": sha256_file(root / "m.kv.onnx"), "parity": {"x86_64": {"passed": True}}}]
    tol = {"rel_max_abs": 1e-4, "min_top1": 0.999, "max_ppl_ratio": 1.001}
    manifest = {"format_version": 1, "model": {"max_seq_len": 32, "vocab_size": 64}, "artifacts": arts,
                "tokenizer": {"path": "tokenizer.json", "sha256": sha256_file(root / "tokenizer.json"), "eos_id": 1},
                "parity_bundle": {"path": "parity_bundle.npz", "sha256": sha256_file(root / "parity_bundle.npz")},
                "tolerances": {"fp32_vs_fp32_eager": tol, "int8_vs_fp32_eager": tol}, "passed": True}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def edit_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_not_an_export_folder(tmp_path):
    assert_user_error(run_module("hrm_edge.demo", tmp_path), "no manifest.json")
    assert_user_error(run_module("hrm_edge.demo", tmp_path / "nope"), "export folder not found")


def test_export_without_onnx_kv_artifact(tmp_path):
    assert_user_error(run_module("hrm_edge.demo", fake_export(tmp_path / "e", kv=False)), "no ONNX KV-cache artifact")


def test_unknown_keyboard_model_is_one_line(tmp_path):
    assert_user_error(run_module("hrm_edge.demo", fake_export(tmp_path / "e"), "--keyboard-bench", "--keyboard-model",
                                 "nope.kv.onnx"), "--keyboard-model 'nope.kv.onnx' is not one of", "m.kv.onnx")


def test_keyboard_threads_out_of_range_is_one_line(tmp_path):
    assert_user_error(run_module("hrm_edge.demo", fake_export(tmp_path / "e"), "--keyboard-bench", "--keyboard-threads",
                                 "0"), "--keyboard-threads must be in 1..16, not 0")


def test_keyboard_interval_out_of_range_is_one_line(tmp_path):
    assert_user_error(run_module("hrm_edge.demo", fake_export(tmp_path / "e"), "--keyboard-bench",
                                 "--keyboard-interval", "-5"), "--keyboard-interval must be in 0..10000 ms, not -5")


def test_keyboard_cpu_slowdown_out_of_range_or_with_threads_is_one_line(tmp_path):
    demo = ("hrm_edge.demo", fake_export(tmp_path / "e"), "--keyboard-bench", "--keyboard-cpu-slowdown")
    for value, needle in [("0.5", "--keyboard-cpu-slowdown must be in 1..20, not 0.5"),
                          ("nan", "--keyboard-cpu-slowdown must be in 1..20, not nan")]:
        assert_user_error(run_module(*demo, value), needle)
    # Chromium throttles the page's main thread only: onnxruntime-web's worker threads would run at full speed
    assert_user_error(run_module(*demo, "4", "--keyboard-threads", "2"), "slows the page's main thread, not")


def test_spread_sample_of_a_given_text_is_one_line(tmp_path):
    text = tmp_path / "t.py"
    text.write_text("import os\n")
    assert_user_error(run_module("hrm_edge.demo", fake_export(tmp_path / "e"), "--keyboard-bench", "--keyboard-text",
                                 text, "--keyboard-sample", "spread"), "--keyboard-sample spread samples the held-out")


def test_a_keyboard_text_that_is_not_utf8_or_too_short_is_one_line(tmp_path):
    (tmp_path / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (tmp_path / "empty.py").write_text("")
    for name, needle in [("latin1.py", "is not UTF-8 text"), ("empty.py", "holds fewer than 2 characters")]:
        assert_user_error(run_module("hrm_edge.demo", fake_export(tmp_path / "e"), "--keyboard-bench",
                                     "--keyboard-text", tmp_path / name, "--keyboard-sample", "start"), needle)


def test_sha256_mismatch_names_the_file(tmp_path):
    root = fake_export(tmp_path / "e")
    (root / "m.kv.onnx").write_bytes(b"changed bytes!!")
    assert_user_error(run_module("hrm_edge.demo", root), "m.kv.onnx does not match the sha256", "--no-verify")


def test_paths_outside_the_folder_are_refused(tmp_path):
    root = fake_export(tmp_path / "e")
    (tmp_path / "outside.onnx").write_bytes(b"x")
    edit_manifest(root, lambda m: m["artifacts"][0].update(path="../outside.onnx"))
    assert_user_error(run_module("hrm_edge.demo", root), "not a plain path inside")
    (root / "link.kv.onnx").symlink_to(tmp_path / "outside.onnx")
    edit_manifest(root, lambda m: m["artifacts"][0].update(path="link.kv.onnx"))
    assert_user_error(run_module("hrm_edge.demo", root, "--no-verify"), "link to a file outside")


def test_modified_web_bundle_is_refused(tmp_path):
    """Until the export lists the web bundle in the manifest, the demo checks it against the bytes it must have
    (rebuilt from the sha256-checked parity bundle)."""
    root = fake_export(tmp_path / "e")
    routes, config = export_routes(root, read_manifest(root), verify=True, log=lambda *_: None)
    bundle = root / "web_bundle.bin"
    assert routes["/export/web_bundle.bin"] == bundle and bundle.is_file()  # written on first use
    assert config["default_model"] == "m.kv.onnx" and config["max_seq_len"] == 32
    assert set(routes) == {"/export/tokenizer.json", "/export/m.kv.onnx", "/export/web_bundle.bin"}
    data = bytearray(bundle.read_bytes())
    data[-1] ^= 0x40
    bundle.write_bytes(bytes(data))
    assert_user_error(run_module("hrm_edge.demo", root), "web_bundle.bin does not match", "--no-verify")


def test_the_page_gets_the_gated_draft_and_verify_graphs(tmp_path):
    """A KV graph's draft, branch and verify graphs are served and named in its config entry when they passed the
    gate; a draft that failed it is not served (the page then extends words with the branch graph, and has no
    adaptive depth)."""
    root = fake_export(tmp_path / "e")
    for program in ("draft", "branch", "verify"):
        (root / f"m.{program}.onnx").write_bytes(program.encode())

    def add(passed_draft):
        def edit(manifest):
            base = manifest["artifacts"][0]
            manifest["artifacts"][1:] = [base | {"path": f"m.{p}.onnx", "program": p, "bytes": len(p),
                                                 "sha256": sha256_file(root / f"m.{p}.onnx"),
                                                 "parity": {"x86_64": {"passed": p == "verify" or passed_draft}}}
                                         for p in ("draft", "branch", "verify")]
        return edit

    edit_manifest(root, add(True))
    routes, config = export_routes(root, read_manifest(root), verify=True, log=lambda *_: None)
    entry = config["models"][0]
    assert (entry["draft_url"], entry["verify_url"]) == ("/export/m.draft.onnx", "/export/m.verify.onnx")
    assert entry["branch_url"] == "/export/m.branch.onnx"
    assert {"/export/m.draft.onnx", "/export/m.branch.onnx", "/export/m.verify.onnx"} <= set(routes)
    edit_manifest(root, add(False))
    routes, config = export_routes(root, read_manifest(root), verify=True, log=lambda *_: None)
    assert config["models"][0]["draft_url"] is None and config["models"][0]["verify_url"] is None
    assert "/export/m.draft.onnx" not in routes and "/export/m.verify.onnx" in routes
    (root / "web_bundle.bin").write_bytes(b"changed")  # verify=True still checks the bundle (not shadowed)
    with pytest.raises(Exception, match="web_bundle.bin does not match"):
        export_routes(root, read_manifest(root), verify=True, log=lambda *_: None)


def loop_graph(path: Path, steps: int, w: np.ndarray, b_main: np.ndarray, b_body: np.ndarray) -> Path:
    """y = (x W + b_body) applied `steps` times in a Loop, then y W + b_main: W is a Loop-body initializer and a
    main-graph one under other names (the same bytes), and "b" names a different tensor in each graph."""
    f32 = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("MatMul", ["h", "w_body"], ["hw"]),
         helper.make_node("Add", ["hw", "b"], ["h_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []), f32("h", [1, 256])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), f32("h_out", [1, 256])],
        [numpy_helper.from_array(w, "w_body"), numpy_helper.from_array(b_body, "b")])
    main = helper.make_graph(
        [helper.make_node("Loop", ["steps", "", "x"], ["h"], body=body), helper.make_node("MatMul", ["h", "w"], ["hw"]),
         helper.make_node("Add", ["hw", "b"], ["y"])], "main", [f32("x", [1, 256])], [f32("y", [1, 256])],
        [numpy_helper.from_array(np.array(steps, np.int64), "steps"), numpy_helper.from_array(w, "w"),
         numpy_helper.from_array(b_main, "b")])
    model = helper.make_model(main, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_programs_graphs_share_one_weights_file(tmp_path):
    """shared_weights: the graphs compute what they did (onnxruntime, bit for bit), each distinct large tensor is
    stored once for every graph and name, no large initializer is left in a graph or a Loop body (onnxruntime-web
    reads external data of the main graph's only), and a name the main graph has already is renamed in the body."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
    b_main, b_body = (rng.standard_normal(256).astype(np.float32) for _ in range(2))
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    graphs = [loop_graph(tmp_path / "src" / f"g{k}.onnx", k, w, b_main, b_body) for k in (2, 3)]
    written = share_weights(graphs, tmp_path / "dst", "p.weights")
    assert [p.name for p in written] == ["g2.onnx", "g3.onnx", "p.weights"]
    assert written[-1].stat().st_size == w.nbytes + 2 * b_main.nbytes  # W once; each b once (64-aligned sizes)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    for src, dst in zip(graphs, written):
        want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        got = ort.InferenceSession(dst, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        assert np.array_equal(got, want)
        model = onnx.load(dst, load_external_data=False)
        body = model.graph.node[0].attribute[0].g
        assert not body.initializer and all(len(t.raw_data) < 1024 for t in model.graph.initializer)
        assert "Loop.b" in body.node[2].input  # the body's "b", renamed beside the main graph's
        assert dst.stat().st_size < 4096
    (tmp_path / "bad.onnx").write_bytes(b"not really onnx")
    with pytest.raises(ValueError, match="bad.onnx is not an ONNX graph"):
        share_weights([tmp_path / "bad.onnx"], tmp_path / "dst", "q.weights")


def nbits_graph(path: Path, rng, accuracy_level: int, opset: int = 18) -> Path:
    """h = x Wb (8-bit MatMulNBits in a Loop body, 2 steps), then h Wm (8-bit, a main-graph initializer of the same
    bytes) and h W4 (4-bit): the nbits programs' operators, 64 x 64 weights in blocks of 32 (16 for 4 bits)."""
    w8, w4 = ((rng.standard_normal((64, 64)) / 8).astype(np.float32) for _ in range(2))
    b8, s8, _ = blockwise_quantize(w8, 8, 32)
    b4, s4, _ = blockwise_quantize(w4, 4, 16)
    f8, f4 = NbitsFormat(8, 32, accuracy_level), NbitsFormat(4, 16, accuracy_level)
    f32 = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 64])  # noqa: E731
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), nbits_node("h", "h_out", "b8", "s8", 64, 64, f8)],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond", TensorProto.BOOL, []), f32("h")],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), f32("h_out")],
        [numpy_helper.from_array(b8, "b8"), numpy_helper.from_array(s8, "s8")])
    main = helper.make_graph(
        [helper.make_node("Loop", ["steps", "", "x"], ["h"], body=body), nbits_node("h", "hm", "m8", "t8", 64, 64, f8),
         nbits_node("hm", "y", "m4", "t4", 64, 64, f4)], "main", [f32("x")], [f32("y")],
        [numpy_helper.from_array(np.array(2, np.int64), "steps"), numpy_helper.from_array(b8, "m8"),
         numpy_helper.from_array(s8, "t8"), numpy_helper.from_array(b4, "m4"), numpy_helper.from_array(s4, "t4")])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(main, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_matmulnbits_are_served_as_float_matmuls(tmp_path):
    """The nbits programs' 8- and 4-bit MatMulNBits reach the page as float MatMuls over the weights their bytes stand
    for: MatMulNBits's numbers at accuracy_level 0 (float products), the 8-bit (4-bit) bytes stored once (not 4-byte
    floats), and onnxruntime folds the dequantization into constants at session start (no per-call work); below
    opset 18 (no BitwiseAnd) a 4-bit one stays."""
    (tmp_path / "dst").mkdir()
    exported = nbits_graph(tmp_path / "g.onnx", np.random.default_rng(0), accuracy_level=4)
    float_products = nbits_graph(tmp_path / "g0.onnx", np.random.default_rng(0), accuracy_level=0)
    served, weights = share_weights([exported], tmp_path / "dst", "p.weights")
    graph = onnx.load(served, load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert "MatMulNBits" not in ops and ops.count("MatMul") == 2 and ops.count("Transpose") == 3
    loop = next(n for n in graph.node if n.op_type == "Loop")
    assert [n.op_type for n in loop.attribute[0].g.node] == ["Identity", "MatMul"]
    assert weights.stat().st_size < 64 * 64 * 2  # the 8-bit bytes once (2 names), the 4-bit ones, scales; no floats
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # not the notice that a saved optimized model may be specific to this machine
    options.optimized_model_filepath = str(tmp_path / "dst" / "optimized.onnx")
    got = ort.InferenceSession(served, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = ort.InferenceSession(float_products, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    folded = onnx.load(tmp_path / "dst" / "optimized.onnx", load_external_data=False).graph
    left = {"Cast", "Sub", "Transpose", "BitwiseAnd", "BitShift"} & {n.op_type for n in folded.node}
    assert not left, [n.op_type for n in folded.node]
    old = share_weights([nbits_graph(tmp_path / "o.onnx", np.random.default_rng(0), 4, opset=17)], tmp_path / "dst",
                        "o.weights")[0]
    bits = [a.i for n in onnx.load(old, load_external_data=False).graph.node for a in n.attribute if a.name == "bits"]
    assert bits == [4]


def test_the_page_opens_with_the_8bit_weights_program():
    """The page's default: the int8 MatMulNBits program (served as float MatMuls: the fastest int8 program in the
    browser and the smallest download), then another int8 one, then the rest; ONNX first; only a gated one."""
    def art(path, precision, mode=None, fmt="onnx", passed=True):
        quantization = {"mode": mode} if mode else None
        return Artifact.new(path, fmt, precision, "kv_cache", "onnx_loop", quantization=quantization,
                            parity={"x86_64": {"passed": passed}})

    fp32, static = art("f.kv.onnx", "fp32"), art("s.kv.onnx", "int8", "static")
    nbits, nbits_ort = art("n.kv.onnx", "int8", "nbits"), art("n.kv.ort", "int8", "nbits", fmt="ort")
    assert page_default([fp32, static, nbits_ort, nbits]) == "n.kv.onnx"
    assert [kind(a) for a in (fp32, static, nbits)] == ["fp32", "int8 static", "int8 nbits"]  # the selector's names
    assert page_default([fp32, static, art("n.kv.onnx", "int8", "nbits", passed=False)]) == "s.kv.onnx"
    assert page_default([fp32, art("i4.kv.onnx", "int4", "nbits")]) == "f.kv.onnx"
    assert page_default([art("f.kv.onnx", "fp32", passed=False)]) == "f.kv.onnx"
    # an ORT-format MatMulNBits program is not offered: it cannot take the page's form, and the browser's own
    # MatMulNBits ran 3-5x slower

    static_ort = art("s.kv.ort", "int8", "static", fmt="ort")
    assert kv_artifacts({"artifacts": [fp32, static, nbits_ort, nbits, static_ort]}) == [fp32, static, nbits, static_ort]


def test_graphs_onnx_cannot_read_are_served_as_exported(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = fake_export(tmp_path / "e")
    routes, config = export_routes(root, read_manifest(root), verify=True, log=lambda *_: None)
    lines = []
    with_shared_weights(routes, config, log=lines.append)
    assert config["models"][0]["url"] == "/export/m.kv.onnx" and "weights" not in config["models"][0]
    assert lines == ["[demo] m.kv.onnx: serving its graphs as exported (their weights not shared: m.kv.onnx is not an "
                     "ONNX graph)"]


def test_missing_npm_is_one_error_line(tmp_path):
    root = fake_export(tmp_path / "e")
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=str(tmp_path / "empty-bin"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "hrm_edge.demo", str(root)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert_user_error(proc, "npm not found")


def test_server_serves_its_table_only(tmp_path):
    """Known URLs with COOP/COEP and the right MIME types; everything else (listing, `..`) is a 404. A reload
    revalidates (304, the ETag); a file changed or swapped for a link after the server checked it is refused (it was
    read again on every request, link followed: the start-up checks could be bypassed)."""
    (tmp_path / "a.mjs").write_text("export const a = 1;")
    (tmp_path / "b.wasm").write_bytes(b"\0asm")
    (tmp_path / "c.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("top secret")
    routes = served_files({"/app/js/a.mjs": tmp_path / "a.mjs", "/vendor/ort/b.wasm": tmp_path / "b.wasm",
                           "/export/c.json": tmp_path / "c.json"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(DemoHandler, routes=routes, config=b"{}", quiet=True))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(base + "/app/js/a.mjs") as r:
            assert r.headers["Content-Type"].startswith("text/javascript") and r.read() == b"export const a = 1;"
            assert r.headers["Cross-Origin-Opener-Policy"] == "same-origin"
            assert r.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
        with urllib.request.urlopen(base + "/vendor/ort/b.wasm") as r:
            assert r.headers["Content-Type"] == "application/wasm"
        for bad in ("/app/js/", "/app/js/../../secret.txt", "/app/js/%2e%2e/secret.txt", "/secret.txt", "//etc/passwd"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + bad)
            assert e.value.code == 404, bad
        with urllib.request.urlopen(base + "/vendor/ort/b.wasm") as r:
            etag = r.headers["ETag"]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(base + "/vendor/ort/b.wasm", headers={"If-None-Match": etag}))
        assert e.value.code == 304 and e.value.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
        (tmp_path / "c.json").unlink()
        (tmp_path / "c.json").symlink_to(tmp_path / "secret.txt")
        (tmp_path / "a.mjs").write_text("export const a = 2;")
        for changed in ("/export/c.json", "/app/js/a.mjs"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + changed)
            assert e.value.code == 410 and b"top secret" not in e.value.read(), changed
    finally:
        server.shutdown()
        server.server_close()



def test_an_ipv6_host_is_served(tmp_path):
    """--host :: and ::1 listen on IPv6 (they failed with "Address family for hostname not supported"); :: takes IPv4
    clients too, and the printed URL brackets the address. Where this machine has no IPv6, the demo says so in one
    line."""
    (tmp_path / "c.json").write_text("{}")
    routes = served_files({"/export/c.json": tmp_path / "c.json"})
    handler = partial(DemoHandler, routes=routes, config=b"{}", quiet=True)
    assert addresses_to_open("::1", 8000) == ["http://[::1]:8000/"]
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:  # no IPv6 on this machine: what a user gets is one line
        with pytest.raises(UserError, match="cannot listen on ::1:0"):
            listen("::1", 0, handler)
        return
    server = listen("::", 0, handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for host in ("[::1]", "127.0.0.1"):
            with urllib.request.urlopen(f"http://{host}:{server.server_address[1]}/export/c.json", timeout=10) as r:
                assert r.read() == b"{}", host
    finally:
        server.shutdown()
        server.server_close()


# ---- the page in a real browser (slow) ----
class DemoServer:
    def __init__(self, export_dir: Path, *args):
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "hrm_edge.demo", str(export_dir), "--port", "0", "--quiet",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        self.log = []
        # npm ci on first use can take a minute; a server that never prints its address is killed, not waited on
        watchdog = threading.Timer(600, self.proc.kill)
        watchdog.start()
        try:
            self._wait_for_address()
        finally:
            watchdog.cancel()

    def _wait_for_address(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("open "):
                self.url = line.split()[1]
                return
        raise AssertionError("demo server did not start:\n" + "".join(self.log))

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install '.[test]' installs playwright")
    assert Path(CHROMIUM).is_file(), "Debian's chromium is missing: apt-get install chromium (python -m hrm_edge.sysdeps does)"
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, url, requests: list | None = None):
    """The page at a phone's viewport, loaded with no page error; `requests` gets the url of every request."""
    page = browser.new_page(**PHONE)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    if requests is not None:
        page.on("request", lambda r: requests.append(urlsplit(r.url).path))
    page.goto(url)
    page.wait_for_function("document.getElementById('status').dataset.ready === '1'", timeout=120_000)
    assert not errors, errors
    return page


def run_self_test(page) -> dict:
    page.evaluate("document.getElementById('selftest-result').dataset.passed = ''")
    page.click("#selftest")
    page.wait_for_function("document.getElementById('selftest-result').dataset.passed", timeout=300_000)
    return page.evaluate("window.hrmDemo.lastSelfTest")


def select_model(page, model_id):
    page.select_option("#model", model_id)
    page.wait_for_function("(id) => document.getElementById('status').dataset.model === id && "
                           "document.getElementById('status').dataset.ready === '1'", arg=model_id, timeout=120_000)


def python_self_test(export_dir: Path, model_id: str) -> dict:
    web = read_web_bundle(export_dir / "web_bundle.bin")
    precision = "int8" if "int8" in model_id else "fp32"
    return check_web_bundle(kv_logits(export_dir / model_id, web), web, precision)


def page_form_self_test(export_dir: Path, model_id: str, dest: Path) -> dict:
    """python_self_test on the graph as the demo serves it (shared_weights.page_form)."""
    dest.mkdir(parents=True, exist_ok=True)
    web = read_web_bundle(export_dir / "web_bundle.bin")
    return check_web_bundle(kv_logits(page_form(export_dir / model_id, dest), web), web, "int8")


def int8_reference_self_test(export_dir: Path, model_id: str) -> dict:
    """The Self-test's numbers had the int8 program computed exactly its eager int8 reference."""
    manifest = json.loads((export_dir / "manifest.json").read_text())
    art = next(a for a in manifest["artifacts"] if a["path"] == model_id)
    web = read_web_bundle(export_dir / "web_bundle.bin")
    n, s = web.logits.shape[:2]
    reference = load_bundle(export_dir / "parity_bundle.npz")[f"reference/{art['reference']}"][:n, :s]
    return check_web_bundle(reference, web, "int8")


def page_completion(page, prompt: str, fields: dict) -> tuple[str, dict]:
    """The page's Complete on `prompt` with the given fields ({"#exit": "0.8", ...}): (the text box, lastCompletion)."""
    page.evaluate("window.hrmDemo.lastCompletion = null")
    page.fill("#text", prompt)
    for field, value in fields.items():
        page.fill(field, value)
    page.click("#complete")
    page.wait_for_function("window.hrmDemo.lastCompletion", timeout=180_000)
    return page.input_value("#text"), page.evaluate("window.hrmDemo.lastCompletion")


@pytest.mark.slow
def test_page_adaptive_depth_and_draft_rounds_are_completes(default_export, browser):
    """The page's Complete on the draft + verify graphs (fp32, greedy) prints what `complete --runtime onnx` prints:
    with an exit threshold (adaptive depth, some tokens exit) what `--exit-threshold` prints, and with draft rounds
    what `--speculative` prints, which is plain greedy decoding's text (some proposals rejected, most kept)."""
    prompt = "import os\nimport sys\n\n\ndef main():\n    "
    greedy = {"#temperature": "0", "#top-k": "0", "#max-new": "48"}
    server = DemoServer(default_export)
    try:
        page = open_page(browser, server.url)
        select_model(page, "hrm.fp32.kv.onnx")
        adaptive_text, adaptive = page_completion(page, prompt, greedy | {"#exit": "0.8"})
        rounds_text, rounds = page_completion(page, prompt, greedy | {"#exit": "", "#lookup": "0", "#draft": "4"})
    finally:
        server.close()
    cli = run_module("hrm_edge.complete", "--artifacts", default_export, "--runtime", "onnx", "--precision", "fp32",
                     "--exit-threshold", "0.8", "--max-new-tokens", "48", prompt)
    assert cli.returncode == 0, cli.stderr
    assert adaptive_text == cli.stdout.rsplit("\n", 2)[0]  # prompt + continuation; then the stats line
    assert adaptive["calls"] == 47 and 0 < adaptive["exited"] < 47, adaptive  # some exit, not all
    plain = run_module("hrm_edge.complete", "--artifacts", default_export, "--runtime", "onnx", "--precision", "fp32",
                       "--max-new-tokens", "48", prompt)
    assert plain.returncode == 0, plain.stderr
    assert rounds_text == plain.stdout.rsplit("\n", 2)[0]
    assert rounds["rounds"] + rounds["accepted"] == 47 and 0 < rounds["accepted"] < rounds["proposed"], rounds


ADAPTIVE_STEPS = """async ({ tokens, prefill, threshold }) => {
  const { AdaptiveModel } = await import("/app/js/model.mjs");
  const { state } = window.hrmDemo;
  const info = state.modelInfo;
  const adaptive = await AdaptiveModel.load(info.draft_url, info.verify_url, state.config.max_seq_len, info.weights);
  const out = await state.model.run(tokens.slice(0, prefill), state.model.emptyPast());
  let halves = adaptive.split(out.past);
  const steps = [];
  for (const token of tokens.slice(prefill)) {
    const s = await adaptive.step(token, halves, threshold);
    halves = s.halves;
    steps.push({ logits: Array.from(s.logits), exited: s.exited });
  }
  return steps;
}"""


@pytest.mark.slow
def test_page_adaptive_steps_are_pythons(default_export, browser):
    """The page's AdaptiveModel, teacher-forced over held-out-like code: the same exits and logits (within 1e-4) as
    hrm_edge.runtime.adaptive on the same draft + verify graphs (fp32), so a wrongly filled skipped slot shows."""
    tokens = load_tokenizer(default_export / "tokenizer.json").encode(
        "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = make_parser()\n    args = parser.parse_args(argv)\n"
        "    for name in sorted(args.names):\n        print(name, os.path.getsize(name))\n    return 0\n",
        add_special_tokens=False).ids
    server = DemoServer(default_export)
    try:
        page = open_page(browser, server.url)
        select_model(page, "hrm.fp32.kv.onnx")
        steps = page.evaluate(ADAPTIVE_STEPS, {"tokens": tokens, "prefill": 8, "threshold": 0.5})
    finally:
        server.close()
    decoder = AdaptiveDecoder(OnnxSpeculativeDecoder(*(default_export / f"hrm.fp32.{p}.onnx" for p in
                                                       ("kv", "draft", "verify")), threads=1), 2, TopProbRule(0.5))
    decoder.prefill(np.array(tokens[:8]))
    want = [decoder.decode(t) for t in tokens[8:]]
    assert [s["exited"] for s in steps] == decoder.exited and 0 < sum(decoder.exited) < len(want)
    for step, logits in zip(steps, want, strict=True):
        np.testing.assert_allclose(np.array(step["logits"]), logits, atol=1e-4)


def check_suggestions_and_requests(page, requests: list) -> None:
    """The default program's graphs and weights requests, and its chips after typing (a chip is for its text)."""
    # the default (int8 weights) program's KV and branch graphs came with their weights in one file, fetched once
    shared = [u for u in requests if u.startswith("/shared/")]
    assert sorted(u.rsplit("/", 1)[1] for u in shared) == ["hrm.int8-nbits.branch.onnx", "hrm.int8-nbits.kv.onnx",
                                                           "hrm.int8-nbits.weights"], requests
    assert not [u for u in requests if u.startswith("/export/") and u.endswith(".onnx")], requests
    # suggestions after typing
    page.fill("#text", "import o")
    page.wait_for_function("window.hrmDemo.lastSuggestions && window.hrmDemo.lastSuggestions.text === 'import o'",
                           timeout=60_000)
    chips = page.locator("#suggestions button.suggestion").all_inner_texts()
    assert 1 <= len(chips) <= 3 and all(chips), chips
    assert "os" in [c.strip() for c in chips] or any(c.startswith("o") for c in chips), chips
    assert page.inner_text("#suggest-time").endswith("ms")
    # a chip is for the text it was computed for: after a key typed since (set here without an input event and
    # with the box unfocused, so that no new chips come), a tap inserts nothing
    page.evaluate("() => { const box = document.getElementById('text'); box.blur(); box.value = 'import ox'; "
                  "box.setSelectionRange(9, 9); }")
    page.locator("#suggestions button.suggestion").first.click()
    assert page.input_value("#text") == "import ox"


def check_greedy_completion(page, export_dir: Path, requests: list) -> None:
    """The page's greedy Complete (fp32) is `python -m hrm_edge.complete --runtime onnx`'s text; each weights file is
    fetched once."""
    # greedy completion == python -m hrm_edge.complete --runtime onnx (fp32, 64 new tokens)
    select_model(page, "hrm.fp32.kv.onnx")
    page.fill("#text", PROMPT)
    page.fill("#temperature", "0")
    page.fill("#top-k", "0")
    page.fill("#max-new", "64")
    page.click("#complete")
    page.wait_for_function("window.hrmDemo.lastCompletion", timeout=120_000)
    cli = run_module("hrm_edge.complete", "--artifacts", export_dir, "--runtime", "onnx", "--max-new-tokens", "64",
                     PROMPT)
    assert cli.returncode == 0, cli.stderr
    expected = cli.stdout.rsplit("\n", 2)[0]  # prompt + continuation; then the stats line
    assert page.input_value("#text") == expected
    completion = page.evaluate("window.hrmDemo.lastCompletion")
    assert len(completion["ids"]) == 64 and completion["decodeTokensPerS"] > 0
    # the page's default lookup (8): each token after the first from a decode call or a verified guess
    assert completion["calls"] + completion["fromContext"] == 63, completion
    print(f"browser greedy decode: {completion['decodeTokensPerS']:.0f} tokens/s; {page.inner_text('#stats')}")
    weights = [u.rsplit("/", 1)[1] for u in requests if u.endswith(".weights")]
    assert weights == ["hrm.int8-nbits.weights", "hrm.fp32.weights"], weights  # each program's once


def check_self_tests(page, export_dir: Path, tmp_path: Path) -> None:
    """The page's self-test on fp32, its .ort form, static int8 and the default program, against Python's numbers."""
    # self-test: fp32 passes, with the numbers Python computes on the same bundle
    fp32 = run_self_test(page)
    want = python_self_test(export_dir, "hrm.fp32.kv.onnx")
    assert fp32["passed"] and want["passed"], (fp32, want)
    assert page.get_attribute("#selftest-result", "data-passed") == "1"
    assert "PASSED" in page.inner_text("#selftest-result")
    assert fp32["top1_agreement"] == want["top1_agreement"] == 1.0
    assert abs(fp32["max_abs_logit_error"] - want["max_abs_logit_error"]) < 1e-4
    assert abs(fp32["perplexity"] / want["perplexity"] - 1) < 1e-5
    print("fp32 self-test:", {k: fp32[k] for k in ("max_abs_logit_error", "top1_agreement", "perplexity", "ms")})
    page.wait_for_function("window.hrmDemo.lastSuggestions && "
                           "window.hrmDemo.lastSuggestions.text === document.getElementById('text').value",
                           timeout=60_000)  # the suggestions after the completed text, for the picture
    page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
    (REPO / "docs").mkdir(exist_ok=True)
    shutil.copyfile(tmp_path / "demo.png", REPO / "docs" / "demo.png")

    # the same program in ONNX Runtime's .ort format loads and passes too
    select_model(page, "hrm.fp32.kv.ort")
    ort_format = run_self_test(page)
    assert ort_format["passed"] and abs(ort_format["max_abs_logit_error"] - fp32["max_abs_logit_error"]) < 1e-4, ort_format

    # int8: the browser computes what the int8 eager reference computes (the parity bundle's
    # reference/<name> logits, cut like the web bundle), judged against fp32 with the same tolerances
    int8_id = "hrm.int8-static-perstep.kv.onnx"
    select_model(page, int8_id)
    int8 = run_self_test(page)
    want = int8_reference_self_test(export_dir, int8_id)
    ort_python = python_self_test(export_dir, int8_id)
    print("int8 self-test:", {k: int8[k] for k in ("max_abs_logit_error", "top1_agreement", "perplexity", "passed",
                                                    "reason", "ms")},
          "| int8 eager reference:", {k: want[k] for k in ("max_abs_logit_error", "top1_agreement", "perplexity")},
          "| python onnxruntime on this CPU:", {k: ort_python[k] for k in ("max_abs_logit_error", "top1_agreement")})
    assert int8["passed"] == want["passed"]
    assert abs(int8["top1_agreement"] - want["top1_agreement"]) <= 2 / int8["positions"]
    assert abs(int8["perplexity"] / want["perplexity"] - 1) < 0.005  # int8_vs_int8_reference's bound
    assert abs(int8["max_abs_logit_error"] - want["max_abs_logit_error"]) < 1e-2 * want["logit_range"]

    # the default program, 8-bit weights served as float MatMuls (shared_weights): what Python's onnxruntime
    # computes on the same served graph, as close as fp32's (one float graph, other kernels), and it passes
    select_model(page, "hrm.int8-nbits.kv.onnx")
    served = run_self_test(page)
    want = page_form_self_test(export_dir, "hrm.int8-nbits.kv.onnx", tmp_path / "page-form")
    print("int8 weights (page form) self-test:", {k: served[k] for k in ("max_abs_logit_error", "top1_agreement",
                                                                          "perplexity", "ms")})
    assert served["passed"] and want["passed"], (served, want)
    assert served["top1_agreement"] == want["top1_agreement"]
    assert abs(served["max_abs_logit_error"] - want["max_abs_logit_error"]) < 1e-4
    assert abs(served["perplexity"] / want["perplexity"] - 1) < 1e-5


@pytest.mark.slow
def test_page_on_a_phone_viewport(default_export, browser, tmp_path):
    server, requests = DemoServer(default_export), []
    try:
        page = open_page(browser, server.url, requests)
        check_suggestions_and_requests(page, requests)
        check_greedy_completion(page, default_export, requests)
        check_self_tests(page, default_export, tmp_path)
    finally:
        server.close()


@pytest.mark.slow
def test_self_test_fails_on_a_perturbed_web_bundle(default_export, browser, tmp_path):
    export = tmp_path / "perturbed"
    shutil.copytree(default_export, export)
    path = write_web_bundle(export, json.loads((export / "manifest.json").read_text()),
                            load_bundle(export / "parity_bundle.npz"))
    web = read_web_bundle(path)
    data = bytearray(path.read_bytes())
    offset = web.header["logits_offset"]
    logits = np.frombuffer(bytes(data[offset:]), dtype="<f4").copy()
    logits += 0.05 * np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32)  # > 1e-4 x range
    data[offset:] = logits.astype("<f4").tobytes()
    path.write_bytes(bytes(data))
    # without --no-verify the demo refuses the modified bundle
    assert_user_error(run_module("hrm_edge.demo", export, "--port", "0"), "web_bundle.bin does not match")
    server = DemoServer(export, "--no-verify")
    try:
        page = open_page(browser, server.url)
        select_model(page, "hrm.fp32.kv.onnx")
        result = run_self_test(page)
        assert not result["passed"] and "max abs logit error" in result["reason"], result
        assert page.get_attribute("#selftest-result", "data-passed") == "0"
        assert "FAILED" in page.inner_text("#selftest-result")
    finally:
        server.close()


@pytest.mark.slow
def test_the_page_recovers_from_a_failed_load_and_keeps_to_the_cursor(default_export, browser):
    """A program whose branch graph did not download left the page stuck (every control disabled, the program list
    too) or half-loaded (an error at every key); chips stayed for a caret moved without typing; and keys typed while
    Complete ran were overwritten by it."""
    server = DemoServer(default_export)
    try:
        page = browser.new_page(**PHONE)
        errors, aborted = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))

        def abort_once(route):  # the first program's branch graph fails, as on a flaky network; later ones load
            if aborted:
                route.continue_()
            else:
                aborted.append(route.request.url)
                route.abort()

        page.route("**/*.branch.onnx", abort_once)
        page.goto(server.url)
        page.wait_for_function("document.getElementById('status').classList.contains('error')", timeout=120_000)
        assert "branch.onnx" in page.inner_text("#status"), page.inner_text("#status")  # the failed file is named
        assert page.is_disabled("#complete") and page.is_enabled("#model")
        select_model(page, "hrm.fp32.kv.onnx")
        page.fill("#text", "import os\nimport sy")
        page.wait_for_function("window.hrmDemo.lastSuggestions?.text === 'import os\\nimport sy'", timeout=60_000)
        # the caret moved back to the end of the first line, no key typed: the chips follow it
        page.evaluate("() => { const box = document.getElementById('text'); box.focus(); "
                      "box.setSelectionRange(10, 10); }")
        page.wait_for_function("window.hrmDemo.lastSuggestions?.text === 'import os\\n'", timeout=60_000)
        page.evaluate("() => { const box = document.getElementById('text'); box.setSelectionRange(19, 19); }")
        page.fill("#max-new", "24")
        page.evaluate("() => { window.readOnlyWhileBusy = []; new MutationObserver(() => window.readOnlyWhileBusy.push("
                      "document.getElementById('text').readOnly)).observe(document.getElementById('text'), "
                      "{attributes: true, attributeFilter: ['readonly']}); }")
        page.click("#complete")
        page.wait_for_function("window.hrmDemo.lastCompletion", timeout=120_000)
        # no key lands in the box while Complete writes it: read-only from the start to the end of the run
        assert page.evaluate("window.readOnlyWhileBusy") == [True, False]
        assert page.input_value("#text").startswith("import os\nimport sy") and not errors, errors
    finally:
        server.close()
