"""The adaptive-depth halting head: `python -m hrm_edge.train --halting-head CHECKPOINT`.

A HaltingHead (hrm_edge.model.lm) learns, on the frozen model, whether a token's first outer cycle already predicts
what the full depth predicts: target = (first-cycle argmax == full-depth argmax), binary cross entropy, on windows of
the corpus's training split (never the held-out projects evaluate measures). Only the head's D + 3 numbers train,
from features computed once, so it takes minutes on a CPU. It is written to CHECKPOINT/halting.safetensors;
model.safetensors is not touched, so the model and its exports stay as they are.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hrm_edge.config import DataConfig
from hrm_edge.errors import UserError
from hrm_edge.io import check_writable_file
from hrm_edge.model.checkpoint import (HALTING, TOKENIZER, check_checkpoint, load_model, load_train_state,
                                      save_halting_head)
from hrm_edge.model.lm import HaltingHead, NoCache, check_adaptive
from hrm_edge.train.dataset import check_corpus, encode_documents, load_corpus, random_batch
from hrm_edge.train.tokenizer import load_tokenizer

TRAIN_TEXT_BYTES = 4_000_000  # training-split text encoded for windows (a random sample of its documents)


def head_examples(model, windows: np.ndarray, batch_size: int = 16):
    """windows [N, S] -> (features [N * S, D + 2], target [N * S] in {0, 1}) of every position."""
    feats, targets = [], []
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            tokens = torch.from_numpy(windows[i : i + batch_size])
            states = model.run_loop(model.step_inputs(tokens, NoCache()), model.cfg.H_cycles, aux=True)
            first, full = model.readout(states[0]), model.readout(states[-1])  # [B, S, V] each
            feats.append(HaltingHead.features(model.norm(states[0]), first).flatten(0, 1))
            targets.append((first.argmax(-1) == full.argmax(-1)).float().flatten())
    return torch.cat(feats), torch.cat(targets)


def fit_head(feats, targets, steps: int = 400, lr: float = 0.02, seed: int = 0) -> HaltingHead:
    """Full-batch Adam on the BCE of HaltingHead.proj over precomputed features [M, D + 2]."""
    torch.manual_seed(seed)
    head = HaltingHead(feats.shape[1] - 2)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(head.proj(feats).squeeze(-1), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def training_windows(corpus: str, tok, n: int, seq_len: int, seed: int) -> np.ndarray:
    """n random windows [n, seq_len] of the corpus's training split (a sample of its documents up to TRAIN_TEXT_BYTES)."""
    texts = load_corpus(DataConfig(corpus=corpus), required_splits=("train",)).train
    order, picked, size = np.random.default_rng(seed).permutation(len(texts)), [], 0
    for i in order:
        if size >= TRAIN_TEXT_BYTES:
            break
        picked.append(texts[i])
        size += len(texts[i].encode("utf-8"))
    return random_batch(encode_documents(tok, picked), n, seq_len, seed, 0)[0]


def head_report(head: HaltingHead, feats, targets) -> dict:
    """BCE, accuracy and the base rate (first cycle agrees) on held-back examples."""
    with torch.no_grad():
        logit = head.proj(feats).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(logit, targets).item()
        accuracy = ((logit > 0).float() == targets).float().mean().item()
    return {"examples": len(targets), "agree_rate": targets.mean().item(), "bce": bce, "accuracy": accuracy}


def train_halting_head(ckpt: Path, corpus: str | None = None, windows: int = 160, seq_len: int = 256, seed: int = 0,
                       log=print) -> dict:
    """Train and save CHECKPOINT/halting.safetensors; returns the held-back examples' report."""
    check_checkpoint(ckpt)  # where the head is trained from and written to, and its text, before the training
    check_writable_file(Path(ckpt) / HALTING)
    corpus = _trained_corpus(ckpt) if corpus is None else corpus
    check_corpus(corpus)
    model = load_model(ckpt)
    try:
        check_adaptive(model.cfg)
    except ValueError as e:
        raise UserError(f"--halting-head: {e}") from None
    for p in model.parameters():
        p.requires_grad_(False)
    seq_len = min(seq_len, model.cfg.max_seq_len)
    tok = load_tokenizer(ckpt / TOKENIZER)
    feats, targets = head_examples(model, training_windows(corpus, tok, windows, seq_len, seed))
    n_fit = windows * 9 // 10 * seq_len  # the last tenth of the windows is held back for the report
    head = fit_head(feats[:n_fit], targets[:n_fit], seed=seed)
    report = {"corpus": corpus, "windows": windows, "seq_len": seq_len} | head_report(head, feats[n_fit:], targets[n_fit:])
    save_halting_head(ckpt, head)
    log(f"halting head -> {ckpt / HALTING}: {report}")
    return report


def _trained_corpus(ckpt: Path) -> str:
    """The corpus the checkpoint was trained on (train_state.json; "" is the standard library), else pypi."""
    corpus = load_train_state(ckpt).get("data", {}).get("corpus")
    return "pypi" if corpus is None else corpus
