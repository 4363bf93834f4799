import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_module(module: str, *args, timeout=900, cwd=None):
    """Run `python -m module args` as a user would; returns CompletedProcess (text)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd or REPO)


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """One end-to-end tiny export shared by the slow tests (trains ~30 s, exports ~2 min), with the depth
    dial's 1-cycle artifacts."""
    out = tmp_path_factory.mktemp("tiny_export")
    proc = run_module("hrm_edge.export", "--preset", "tiny", "--out", out, "--cycles", "1", "--no-progress", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture
def text_corpus(tmp_path):
    """A small UTF-8 corpus folder: enough documents for every split."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py",
                 "fnmatch.py", "glob.py", "shlex.py", "colorsys.py"):
        (corpus / name.replace("/", "_")).write_text((root / name).read_text())
    return corpus
