"""The eager reference of the parity gate: the PyTorch model's logits, the one part of verification that needs
torch and the model. The runtime side (hrm_edge.verify.parity) compares artifacts with the arrays computed here
and stored in the parity bundle; it imports this module only when it re-derives the bundle from the checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hrm_edge.errors import UserError
from hrm_edge.model.checkpoint import load_model
from hrm_edge.model.lm import HaltingRule, adaptive_logits, run_first_cycle
from hrm_edge.runtime.adaptive import BRANCH_TOKENS, BRANCH_WINDOWS, DEFAULT_EXIT_THRESHOLD, reference_name
from hrm_edge.runtime.manifest import verify_files


def eager_logits(model, tokens: np.ndarray, batch_size: int = 4) -> np.ndarray:
    """tokens [N, S] int64 -> logits [N, S, V] float32 of `model` (a module or a callable on token tensors)."""
    outs = []
    with torch.no_grad():
        for i in range(0, len(tokens), batch_size):
            outs.append(model(torch.from_numpy(tokens[i : i + batch_size])).numpy())
    return np.concatenate(outs, axis=0).astype(np.float32)


def verify_reference(out_dir: Path, bundle: dict, manifest: dict | None = None) -> str | None:
    """Recompute eager fp32 logits from the folder's checkpoint (its weights checked against the manifest's
    sha256 first, its config against the manifest's model); return a failure reason or None. Only the bundle's
    fp32_logits are recomputed: its int8, depth-dial, greedy and adaptive references are trusted through its sha256
    in the manifest."""
    ckpt = (manifest or {}).get("checkpoint") or {}
    if {"config", "weights"} <= set(ckpt):
        try:
            verify_files(out_dir, manifest, [ckpt["config"], ckpt["weights"]], hint="re-export")
        except UserError as e:
            return str(e)
    model = load_model(out_dir)
    ref = eager_logits(model, bundle["windows"][:, :-1])
    err = float(np.abs(ref - bundle["fp32_logits"]).max())
    if not err <= 1e-5 * float(ref.max() - ref.min()):  # written so that a NaN in the bundle fails
        return f"parity bundle does not match the eager model in {out_dir} (max abs {err:.3g})"
    return None


def eager_adaptive(model, tokens: np.ndarray, prefill_len: int, threshold: float, exited: np.ndarray | None = None,
                   batch_size: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Adaptive depth, teacher forced (hrm_edge.model.lm.adaptive_logits): tokens [N, S] -> (logits [N, S, V], the
    top-probability rule's own exits [N, S] at `threshold`; the first prefill_len positions never exit). The logits
    are those of `exited` [N, S] when given (an artifact's decisions), else of the rule's."""
    logits, rule_exits = [], []
    rule = HaltingRule(threshold)
    with torch.no_grad():
        for i in range(0, len(tokens), batch_size):
            first = run_first_cycle(model, torch.from_numpy(tokens[i: i + batch_size]))
            exits = rule.exits(model, first.output_state(model), first.logits)  # [b, S]
            exits[:, :prefill_len] = False
            mask = exits if exited is None else torch.from_numpy(exited[i: i + batch_size])
            logits.append(adaptive_logits(model, first, mask).numpy())
            rule_exits.append(exits.numpy())
    return np.concatenate(logits).astype(np.float32), np.concatenate(rule_exits)


def adaptive_references(model, reference: str, tokens: np.ndarray, prefill_len: int, batch_size: int = 4) -> dict:
    """The parity bundle's eager adaptive reference at DEFAULT_EXIT_THRESHOLD of the artifacts whose eager reference
    is `model` (named `reference`; "fp32" for the fp32 model): {name/logits: [N, S, V], name/exited: [N, S]}, the
    logits under the eager rule's own exits (what the gate compares with where no eager model runs), and
    name/first_cycle [BRANCH_WINDOWS, BRANCH_TOKENS, V], the first outer cycle's logits the set's branch graph is
    compared with (hrm_edge.verify.parity.branch_logits)."""
    logits, exited = eager_adaptive(model, tokens, prefill_len, DEFAULT_EXIT_THRESHOLD, batch_size=batch_size)
    with torch.no_grad():  # the set's branch graph decodes BRANCH_TOKENS after the prefill of BRANCH_WINDOWS windows
        first = run_first_cycle(model, torch.from_numpy(tokens[:BRANCH_WINDOWS, : prefill_len + BRANCH_TOKENS]))
    name = reference_name(reference)
    return {f"{name}/logits": logits, f"{name}/exited": exited,
            f"{name}/first_cycle": first.logits[:, prefill_len:].numpy().astype(np.float32)}


def folder_adaptive(out_dir: Path, tokens: np.ndarray, prefill_len: int, threshold: float, exited: np.ndarray):
    """eager_adaptive of the fp32 model in an export folder, with an artifact's exits."""
    return eager_adaptive(load_model(out_dir), tokens, prefill_len, threshold, exited)
