"""The .pte lowering workers' start, in a module of its own: a spawned worker imports the module of its
initializer before running it, and this one imports the standard library, tqdm and hrm_edge.quiet only, so a worker
arms its death signal within moments of starting (the pipeline module imports torch, onnx and the exporters first,
seconds in which a killed export would leave the worker an orphan)."""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

from tqdm import tqdm

from hrm_edge.quiet import quiet_third_party


def ignore_signal(signum, frame) -> None:
    pass


def init_worker(stderr_dir: Path | None, parent_pid: int) -> None:
    """A worker's start: it must not outlive a killed export (kill -9 leaves no orphan still writing into the
    folder); unless --verbose, the libraries' notices are off and native stderr (ExecuTorch's and cpuinfo's
    C++ lines) goes to a file, shown only if the export fails. Ctrl-C is the export's to answer: it reaches the
    whole process group, and the export stops its workers (Pool.terminate) and prints one line."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the export died before the signal was armed: nothing to lower for
        os._exit(1)
    # Ctrl-C does nothing here (else each worker printed its own KeyboardInterrupt traceback): a handler, not SIG_IGN,
    # which a program the worker runs (ExecuTorch's flatc) would inherit and outlive the worker with
    signal.signal(signal.SIGINT, ignore_signal)
    # torch.fx's progress bars made tqdm's lock a multiprocessing one, registered with the resource tracker: a worker
    # stopped mid-lowering never unregistered it, and a leaked-semaphore warning followed "interrupted"
    tqdm.set_lock(threading.RLock())
    if stderr_dir is not None:
        quiet_third_party(False)
        sys.stderr.flush()
        fd = os.open(stderr_dir / f"worker-{os.getpid()}.stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)


def spawn_workers(processes: int, initializer, initargs: tuple = ()):
    """A pool of `processes` spawned workers that start with Ctrl-C ignored: SIG_IGN survives exec and Python leaves
    an ignored SIGINT ignored, so one pressed in the ~0.3 s before init_worker installs its handler prints no traceback.
    The export itself ignores Ctrl-C only while the pool starts them (some 30 ms)."""
    answer = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return multiprocessing.get_context("spawn").Pool(processes, initializer=initializer, initargs=initargs)
    finally:
        signal.signal(signal.SIGINT, answer)
