"""Eager decoding: the model behind the same prefill/decode interface as hrm_edge.runtime.decoders."""
from __future__ import annotations

import numpy as np
import torch

from hrm_edge.model.lm import DecodeForm


class EagerDecoder:
    """The eager PyTorch model with its in-place KV cache (DecodeForm): the runtime decoders' prefill/decode."""

    def __init__(self, model, threads: int = 0, n_cycles: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.form = DecodeForm(model.eval(), n_cycles=n_cycles)
        self.max_seq_len = model.cfg.max_seq_len
        self.pos = 0

    def reset(self):
        self.form.cache.reset()
        self.pos = 0

    def prefill(self, tokens: np.ndarray) -> np.ndarray:  # [S] -> [S, V]
        with torch.no_grad():
            out = self.form(torch.from_numpy(np.asarray(tokens, dtype=np.int64)[None, :]), torch.tensor([self.pos]))
        self.pos += len(tokens)
        return out.numpy()[0]

    def decode(self, token: int) -> np.ndarray:  # -> [V]
        return self.prefill(np.array([token]))[0]
