"""hrm_edge.quiet: third-party noise is kept off the console unless --verbose, and shown when a load fails."""
import subprocess
import sys

from conftest import REPO

NATIVE = """
import os, sys
from hrm_edge.quiet import native_stderr_to
with native_stderr_to(sys.argv[1]):
    os.write(2, b"native line\\n")  # what C++ code writes: straight to file descriptor 2
    print("python line", file=sys.stderr)
os.write(2, b"after the block\\n")
try:
    with native_stderr_to(sys.argv[1]):
        os.write(2, b"[cpuinfo_utils.cpp:125] a startup notice, left out of the replay\\n")
        os.write(2, b"line before a failed load\\n")
        raise RuntimeError("load failed")
except RuntimeError:
    pass
with native_stderr_to(None):  # verbose: nothing redirected
    os.write(2, b"verbose line\\n")
"""

PYTHON_LEVEL = """
import logging, sys, warnings
from hrm_edge.quiet import quiet_third_party
quiet_third_party(verbose=sys.argv[1] == "verbose")
logging.getLogger("torch.utils._pytree").warning("torch warning")
logging.getLogger("torchao").warning("Failed to load x.so")
logging.getLogger("executorch").error("executorch error")
warnings.warn_explicit("torchao deprecation", FutureWarning, "f.py", 1, module="torchao.quantization")
warnings.warn_explicit("our warning", UserWarning, "g.py", 1, module="hrm_edge.runtime.decoders")
"""


REFUSED = """
import os, sys
from hrm_edge.errors import UserError, run_cli
from hrm_edge.quiet import native_stderr_to
def main(argv):
    with native_stderr_to(sys.argv[1]):
        os.write(2, b"[cpuinfo_utils.cpp:125] a startup notice\\n")
        os.write(2, b"[program.cpp:114] File size is too small.\\n\\n")
        os.write(2, b"second native line\\n")
        raise UserError("cannot load x.pte: error 0x23")
run_cli(main)
"""


def run(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO)


def test_native_stderr_goes_to_the_file_and_is_shown_when_the_block_fails(tmp_path):
    caught = tmp_path / "native.txt"
    proc = run(NATIVE, str(caught))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "after the block\nline before a failed load\nverbose line\n"
    assert caught.read_text() == ("[cpuinfo_utils.cpp:125] a startup notice, left out of the replay\n"
                                  "line before a failed load\n")  # the second block's file replaced the first's


def test_a_refused_file_is_one_line_with_the_runtimes_reason(tmp_path):
    proc = run(REFUSED, str(tmp_path / "native.txt"))
    assert proc.returncode == 2
    assert proc.stderr == "error: cannot load x.pte: error 0x23 (File size is too small.; second native line)\n"


def test_third_party_warnings_and_logs_are_dropped_unless_verbose():
    quiet = run(PYTHON_LEVEL, "quiet")
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stderr.splitlines()
    assert "executorch error" in lines and any("our warning" in ln for ln in lines)
    assert not any(w in quiet.stderr for w in ("torch warning", "Failed to load", "torchao deprecation"))
    verbose = run(PYTHON_LEVEL, "verbose")
    for w in ("torch warning", "Failed to load", "executorch error", "torchao deprecation", "our warning"):
        assert w in verbose.stderr, w
