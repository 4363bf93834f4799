"""The .pte lowering workers' start (hrm_edge/export/workers.py), without an export: Ctrl-C is the export's to answer
(it terminates its workers), so a worker lets SIGINT pass, from its first moment, while a program it runs still ends
on it."""
import signal
import subprocess
import sys

from conftest import REPO
from hrm_edge.export.workers import spawn_workers

# a worker's start, then: sleep in Python (SIGINT comes meanwhile), then run a program and send it SIGINT
WORKER = """
import os, signal, subprocess, sys, time
from hrm_edge.export.workers import init_worker
init_worker(None, os.getppid())
print("ready", flush=True)
time.sleep(2)
print("slept", flush=True)
program = subprocess.Popen(["sleep", "30"])
time.sleep(0.5)
program.send_signal(signal.SIGINT)
try:
    print("program", program.wait(timeout=10), flush=True)
finally:
    program.kill()
"""


def test_a_worker_lets_ctrl_c_pass_and_the_programs_it_runs_do_not():
    """A worker sleeping in Python gets SIGINT and carries on (with Python's default it raised KeyboardInterrupt and
    printed a traceback); a program it runs (ExecuTorch runs flatc) still ends on SIGINT (under SIG_IGN, which a
    program inherits, it outlived its terminated worker)."""
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, f"slept\nprogram {-signal.SIGINT}\n", "")


def record_ctrl_c_at_start() -> None:
    """A spawned worker's initializer: how it found SIGINT, before any code of its own ran."""
    global CTRL_C_AT_START
    CTRL_C_AT_START = signal.getsignal(signal.SIGINT)


def ignored_ctrl_c_at_start(_) -> bool:
    return CTRL_C_AT_START == signal.SIG_IGN


def test_workers_start_with_ctrl_c_ignored_and_the_export_keeps_its_answer():
    """Before init_worker installs its handler (the ~0.3 s a spawned Python takes to import it), Ctrl-C is ignored, not
    Python's KeyboardInterrupt (a traceback from each worker); the export answers it again once they are started."""
    before = signal.getsignal(signal.SIGINT)
    pool = spawn_workers(2, record_ctrl_c_at_start)
    try:
        assert signal.getsignal(signal.SIGINT) is before
        assert pool.map(ignored_ctrl_c_at_start, range(2)) == [True, True]
    finally:
        pool.terminate()
        pool.join()
