"""Calibration set and per-step activation ranges for static int8.

The calibration set is data made reproducibly: windows drawn with a fixed seed from the corpus's
calibration split (a hash bucket of documents that is never the validation split the parity gate uses).
Its record (source, seed, windows, length, token count, sha256 of the tokens) goes into calibration.json
beside the artifacts, the windows themselves into calibration_set.npz.

The shared block sees different statistics at step 1 and step T, so ranges are recorded per iteration step:
for every block linear, the min and max of its input at each of the T applications.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hrm_edge.config import DataConfig
from hrm_edge.errors import UserError
from hrm_edge.io import atomic_path
from hrm_edge.train.dataset import encode_documents, load_corpus

# The linears of the shared block whose inputs get static int8 scales, in call order within one step.
BLOCK_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_up", "ffn.w_down")


@dataclass
class CalibrationRecord:
    source: str
    split: str
    seed: int
    samples: int
    seq_len: int
    token_count: int
    tokens_sha256: str


def make_calibration_set(tok, data_cfg: DataConfig, samples: int, seq_len: int, seed: int,
                         calib_corpus: str | None = None, corpus=None) -> tuple[np.ndarray, CalibrationRecord]:
    """Windows [samples, seq_len] int64 drawn with `seed` from the calibration split (or all of calib_corpus but the
    documents of data_cfg's validation split: the parity gate's windows come from there, and a static int8 graph
    calibrated on them would be judged on its own calibration text). corpus: the already loaded Corpus of data_cfg,
    if the caller has it (saves reading it again)."""
    if samples < 1:
        raise UserError("--calib-samples must be >= 1")
    if calib_corpus:
        held_out = (corpus or load_corpus(data_cfg)).val
        given = load_corpus(DataConfig(corpus=calib_corpus, val_percent=0, calib_percent=100), required_splits=())
        texts = outside(given.calib, held_out)
        left_out = len(given.calib) - len(texts)
        split = "all" + (f" but {left_out} texts within or holding validation documents" if left_out else "")
        source = given.source
    else:
        corpus = corpus or load_corpus(data_cfg)
        texts, split, source = corpus.calib, "calib", corpus.source
    if not texts and calib_corpus and left_out:
        raise UserError(f"calibration corpus {source} holds no text outside the validation documents the parity gate "
                        f"reads ({left_out} texts within or holding them)")
    if not texts:
        raise UserError(f"calibration corpus {source} is empty (its {split} split has no text)")
    stream = encode_documents(tok, texts)
    if len(stream) < seq_len + 1:
        raise UserError(f"calibration corpus {source} is too short: {len(stream)} tokens, "
                        f"need at least {seq_len + 1} for one window of {seq_len}")
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.integers(0, len(stream) - seq_len, size=samples))
    windows = np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int64)
    record = CalibrationRecord(source=source, split=split, seed=seed, samples=samples, seq_len=seq_len,
                               token_count=int(windows.size),
                               tokens_sha256=hashlib.sha256(windows.tobytes()).hexdigest())
    return windows, record


def outside(texts: list[str], held_out: list[str]) -> list[str]:
    """The texts that neither lie within a held-out text nor hold one. Equal texts were not enough: a corpus of fewer
    than MIN_DOCUMENTS files is cut into pieces (dataset.load_corpus), so a validation document can be whole on one
    side and in pieces on the other (3 validation files given as the calibration corpus left none out)."""
    held_out = sorted(set(held_out), key=len)
    return [t for t in texts if not any(t in v or v in t for v in held_out)]


def activation_ranges(model, windows: np.ndarray, batch_size: int = 8) -> dict:
    """Run the eager model (Python-loop form) over the calibration windows and record, for every block
    linear, min/max of its input at each step t (lists of length T).

    Each block linear is called exactly once per block application, in step order, so its call count
    within one forward is the step index."""
    cfg = model.cfg
    T = cfg.n_steps
    mins = {name: np.full(T, np.inf) for name in BLOCK_LINEARS}
    maxs = {name: np.full(T, -np.inf) for name in BLOCK_LINEARS}
    calls = {name: 0 for name in BLOCK_LINEARS}
    handles = []

    def observer(name):
        def hook(module, inputs):
            t = calls[name] % T
            calls[name] += 1
            x = inputs[0].detach()
            mins[name][t] = min(mins[name][t], x.min().item())
            maxs[name][t] = max(maxs[name][t], x.max().item())
        return hook

    for name in BLOCK_LINEARS:
        handles.append(model.block.get_submodule(name).register_forward_pre_hook(observer(name)))
    try:
        with torch.no_grad():
            for i in range(0, len(windows), batch_size):
                model(torch.from_numpy(windows[i : i + batch_size]))
    finally:
        for h in handles:
            h.remove()
    return {
        "steps": T,
        "linears": {name: {"min": mins[name].tolist(), "max": maxs[name].tolist()} for name in BLOCK_LINEARS},
    }


def save_calibration_set(path: Path, windows: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, windows=windows)
