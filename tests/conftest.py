import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest

from hrm_edge.io import sha256_file

REPO = Path(__file__).resolve().parent.parent


def run_module(module: str, *args, timeout=900, cwd=None):
    """Run `python -m module args` as a user would; returns CompletedProcess (text)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd or REPO)


class ParserBuilt(Exception):
    pass


def parser_of(main) -> argparse.ArgumentParser:
    """The parser a CLI's main(argv) builds, caught where it would parse: nothing after that runs."""
    built = []

    def catch(self, *args, **kwargs):
        built.append(self)
        raise ParserBuilt

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", catch):
        try:
            main(["--help"])
        except ParserBuilt:
            return built[0]
    raise AssertionError(f"{main.__module__}.main returned without parsing its arguments")


# fixtures that train or export (minutes each): only tests marked slow may use them, so that -m "not slow" stays
# the fast subset
EXPORTING_FIXTURES = {"tiny_export", "tiny_checkpoint", "onnx_export", "two_full_exports", "default_export",
                      "tiny_peers"}


def pytest_collection_modifyitems(items):
    unmarked = [item.nodeid for item in items
                if EXPORTING_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"mark these tests slow (they use an exporting fixture): {unmarked}")


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` made by build(folder) once per test run. Under pytest-xdist (the suite runs on 2 workers,
    setup.cfg) every worker asks for it: the first builds it while the others wait on a lock, then all read it. A
    build that failed is not tried again: the others fail with its message."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    out, done, failed = root / name, root / f"{name}.built", root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.is_file():
            raise AssertionError(f"building {name} failed in another worker:\n{failed.read_text()}")
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                build(out)
            except BaseException as e:
                failed.write_text(str(e)[-6000:] or type(e).__name__)
                raise
            done.write_text("")
    return out


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """The one end-to-end tiny export of the suite (4-10 minutes alone on 2 cores), with the depth dial's 1-cycle
    artifacts, every int8 variant and the opt-in 4-bit program: the slow tests of test_export, test_generate,
    test_reliability, test_android_core and test_arm64 read it (on either worker), and copy it before changing
    anything."""
    def build(out: Path):
        proc = run_module("hrm_edge.export", "--preset", "tiny", "--out", out, "--cycles", "1", "--int8",
                          "static,static-shared,dynamic,8da4w", "--no-progress", timeout=3600)  # a guard
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return built_once(tmp_path_factory, "tiny_export", build)


@pytest.fixture
def text_corpus(tmp_path):
    """A small UTF-8 corpus folder: enough documents for every split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py",
                 "fnmatch.py", "glob.py", "shlex.py", "colorsys.py"):
        (corpus / name.replace("/", "_")).write_text((root / name).read_text())
    return corpus


def perturbed_copy(export_dir: Path, dest: Path, name: str = "hrm.fp32.onnx") -> Path:
    """A copy of an export folder in which ONNX artifact `name` has its embedding table perturbed (0.01 x
    N(0, 1)) and its sha256 and size fixed up in the manifest: it must fail parity on numbers, not sha256."""
    shutil.copytree(export_dir, dest)
    path = dest / name
    model = onnx.load(str(path))
    init = max(model.graph.initializer, key=lambda i: np.prod(i.dims))  # the embedding table
    w = onnx.numpy_helper.to_array(init).copy()
    w += 0.01 * np.random.default_rng(0).standard_normal(w.shape).astype(w.dtype)
    init.CopyFrom(onnx.numpy_helper.from_array(w, init.name))
    onnx.save(model, str(path))
    manifest = json.loads((dest / "manifest.json").read_text())
    art = next(a for a in manifest["artifacts"] if a["path"] == name)
    art["sha256"], art["bytes"] = sha256_file(path), path.stat().st_size
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


@pytest.fixture(scope="session")  # one instance for every module that reads it (defined here, not imported)
def default_export(tmp_path_factory):
    """The shipped default model exported once for the page, keyboard, healing, speculative and adaptive tests: every
    ONNX graph of the fp32, static int8 and MatMulNBits programs (the page's default: int8-nbits) with their .ort
    files, and the fp32 ExecuTorch KV and speculative programs (`complete --runtime executorch`, the speculative
    program's four methods). The dynamic int8 programs and the full-sequence .pte are left out: no test reads them
    here (the tiny export has them)."""
    def build(out: Path):
        proc = run_module("hrm_edge.export", "--int8", "static,nbits", "--pte-programs", "kv_cache,speculative",
                          "--out", out, "--no-progress", timeout=1800)
        manifest = json.loads((out / "manifest.json").read_text())
        fp32_kv = next(a for a in manifest["artifacts"] if a["path"] == "hrm.fp32.kv.onnx")
        # the page needs the fp32 KV graph to pass; an int8 failure is checked below against Python's verdict
        assert all(r["passed"] for r in fp32_kv["parity"].values()), proc.stdout[-3000:] + proc.stderr[-3000:]

    return built_once(tmp_path_factory, "default_export", build)
