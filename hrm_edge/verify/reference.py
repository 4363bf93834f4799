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
    sha256 first, its config against the manifest's model); return a failure reason or None."""
    ckpt = (manifest or {}).get("checkpoint") or {}
    if {"config", "weights"} <= set(ckpt):
        try:
            verify_files(out_dir, manifest, [ckpt["config"], ckpt["weights"]], hint="re-export")
        except UserError as e:
            return str(e)
    model = load_model(out_dir)
    ref = eager_logits(model, bundle["windows"][:, :-1])
    err = float(np.abs(ref - bundle["fp32_logits"]).max())
    if err > 1e-5 * float(ref.max() - ref.min()):
        return f"parity bundle does not match the eager model in {out_dir} (max abs {err:.3g})"
    return None
