"""Third-party console noise, silenced unless asked for (--verbose).

Loading torch, torchao and ExecuTorch prints lines that say nothing about our run: torchao logs "Failed to load
... .so" for its CUDA-only kernels, torch logs a pytree deprecation warning while torchao registers its enums,
and ExecuTorch's C++ runtime writes cpuinfo / threadpool lines straight to file descriptor 2 (no Python logger
or warnings filter reaches those). quiet_third_party handles the Python-level part for the whole process;
native_stderr_to catches the C++ part around the import or load that emits it.

    quiet_third_party(verbose)            # once, at the start of a CLI
    with native_stderr_to(None if verbose else tmp / "native.txt"):
        decoder = PteDecoder(path)        # a failure inside shows what was caught (a UserError in its one line)
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

from hrm_edge.errors import UserError

# the loggers and warning sources of the runtimes and exporters we load (their own names and sub-loggers)
THIRD_PARTY = ("torch", "torchao", "executorch", "onnxruntime", "onnx", "onnxscript")
# ExecuTorch's C++ startup notices (its CPU probe, its threadpool's size): every load writes them, so a failed load's
# replay leaves them out and shows the lines about the failure
STARTUP_NOTICES = ("[cpuinfo_utils.cpp:", "[threadpool.cpp:")
SOURCE_TAG = re.compile(r"^\[[\w.]+:\d+\] ")  # "[program.cpp:114] ": where in the runtime's C++ a line comes from


def quiet_third_party(verbose: bool) -> None:
    """Unless verbose: Python warnings raised in THIRD_PARTY's modules are ignored, and log records below ERROR
    are dropped. Process-wide (logging.disable), because torch resets its loggers' levels when it is imported,
    which happens later (with the first .pte), so a level set on the "torch" logger now would not hold."""
    if verbose:
        return
    warnings.filterwarnings("ignore", module=rf"({'|'.join(THIRD_PARTY)})(\.|$)")
    logging.disable(logging.WARNING)


@contextlib.contextmanager
def native_stderr_to(path: Path | str | None):
    """File descriptor 2 (what C/C++ code and sys.stderr write) goes to `path` inside the block, and back after it.
    None: nothing is redirected (verbose). If the block raises, what was caught (without STARTUP_NOTICES) is shown: a
    UserError (a file the runtime refused) is raised again with it in its one line, any other exception propagates
    after it is written to the real stderr (the runtime's own lines about the failure)."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as caught:
            os.dup2(caught.fileno(), 2)
        try:
            yield
        except BaseException as e:
            _restore(saved)
            lines = Path(path).read_text(errors="replace").splitlines(keepends=True)
            lines = [line for line in lines if line.strip() and not line.startswith(STARTUP_NOTICES)]
            if isinstance(e, UserError) and lines:  # one line: the runtime's reason joins the error's own
                said = "; ".join(SOURCE_TAG.sub("", line.strip()) for line in lines)
                raise UserError(f"{e} ({said[:500]})") from None
            sys.stderr.write("".join(lines))
            sys.stderr.flush()
            raise
    finally:
        _restore(saved)
        os.close(saved)


@contextlib.contextmanager
def native_stderr_kept_back(verbose: bool):
    """native_stderr_to a temporary file, shown only if the block raises; nothing redirected with verbose."""
    if verbose:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="hrm-stderr-") as tmp:
        with native_stderr_to(Path(tmp) / "stderr.txt"):
            yield


def _restore(saved_fd: int) -> None:
    sys.stderr.flush()
    os.dup2(saved_fd, 2)
