"""The .pte lowering workers' start (hrm_edge/export/workers.py), without an export: Ctrl-C is the export's to answer
(it terminates its workers), so a worker lets SIGINT pass, while a program it runs still ends on it."""
import signal
import subprocess
import sys

from conftest import REPO

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
