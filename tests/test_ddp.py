"""Data-parallel training under torchrun: 2 gloo processes on this machine train what 1 process trains.

Same global batch (the preset's batch_size, split across the ranks), so the only difference is the order
of floating-point sums. Measured on the 2-core dev box: max abs weight difference 1.2e-7 after 20 and after
30 steps (weights up to ~2 in size), validation losses equal to 1e-7, while one training step at the peak
learning rate moves weights by up to 3e-3 and the 20 steps by up to 3e-2."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from hrm_edge.config import ModelConfig
from hrm_edge.model.lm import HRMLM

# ~80x the measured 1-vs-2-process difference, 1/300 of what one training step moves a weight by
WEIGHT_TOL = 1e-5
LOSS_TOL = 1e-5
CHECKPOINT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors", "train_state.json"}


def preset_file(tmp_path, **overrides):
    """The tiny preset with a shorter run, fewer eval batches and a smaller corpus slice (start-up time)."""
    text = (REPO / "hrm_edge" / "train" / "presets" / "tiny.toml").read_text()
    changes = {"max_corpus_bytes": 400_000, "tokenizer_sample_bytes": 300_000, "steps": 20, "eval_every": 10,
               "eval_batches": 2, "checkpoint_every": 10, **overrides}
    for key, value in changes.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    path = tmp_path / "tiny_short.toml"
    path.write_text(text)
    return path


def run(*args, nproc=None):
    """python -m hrm_edge.train args, under torchrun with nproc processes if given."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc else []
    return subprocess.run([sys.executable, *launcher, "-m", "hrm_edge.train", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def weights(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


def max_diff(wa, wb):
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def history(ckpt):
    return json.loads((ckpt / "train_state.json").read_text())["history"]


def assert_same_history(h1, h2) -> float:
    """Same evaluation steps, losses within LOSS_TOL; returns the largest difference."""
    assert [h["step"] for h in h1] == [h["step"] for h in h2]
    worst = 0.0
    for a, b in zip(h1, h2):
        for key in ("val_loss", "val_bits_per_byte", "train_loss"):
            if key in a:
                assert abs(a[key] - b[key]) < LOSS_TOL, (a["step"], key, a[key], b[key])
                worst = max(worst, abs(a[key] - b[key]))
    return worst


@pytest.mark.slow
def test_two_processes_train_what_one_does(tmp_path):
    preset = preset_file(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    check(run("--preset", preset, "--out", one, "--threads", "1"))
    proc = check(run("--preset", preset, "--out", two, nproc=2))

    # rank 0 alone logs and writes: one of each line, the checkpoint files once, no leftover temporaries
    assert proc.stdout.count("done: step 20") == 1 and proc.stdout.count("step 10: val loss") == 1, proc.stdout
    assert {p.name for p in two.iterdir()} == CHECKPOINT_FILES
    assert (one / "tokenizer.json").read_text() == (two / "tokenizer.json").read_text()

    diff = max_diff(weights(one), weights(two))
    torch.manual_seed(json.loads((one / "train_state.json").read_text())["train"]["seed"])
    init = HRMLM(ModelConfig.load(one / "config.json")).state_dict()  # the weights training started from
    moved = max_diff(weights(one), init)
    assert diff < WEIGHT_TOL, diff
    assert moved > 100 * WEIGHT_TOL, moved  # the comparison can fail: training moved the weights far more
    losses = assert_same_history(history(one), history(two))
    print(f"1 vs 2 processes: max abs weight difference {diff:.2e} (training moved weights by up to {moved:.2e}), "
          f"losses {losses:.2e}")

    # --resume under torchrun: every rank loads rank 0's files and continues as one process would
    check(run("--preset", preset, "--out", one, "--threads", "1", "--resume", "--steps", "30"))
    check(run("--preset", preset, "--out", two, "--resume", "--steps", "30", nproc=2))
    assert history(two)[-1]["step"] == 30
    diff = max_diff(weights(one), weights(two))
    assert diff < WEIGHT_TOL, diff
    losses = assert_same_history(history(one), history(two))
    print(f"resumed to step 30: max abs weight difference {diff:.2e}, losses {losses:.2e}")
    assert {p.name for p in two.iterdir()} == CHECKPOINT_FILES


def test_batch_must_split_evenly(tmp_path):
    proc = run("--preset", preset_file(tmp_path, batch_size=15), "--out", tmp_path / "o", nproc=2)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert errors == ["error: batch_size 15 is not divisible by the number of processes (2); "
                      "the global batch is split evenly across them"], proc.stderr[-3000:]
