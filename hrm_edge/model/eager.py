"""Eager decoding: the model behind the same prefill/decode interface as hrm_edge.runtime.decoders."""
from __future__ import annotations

import numpy as np
import torch

from hrm_edge.model.lm import (CachedDraftForm, CachedVerifyForm, DecodeForm, FunctionalDecodeForm, HaltingRule,
                               check_adaptive, empty_cache)


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


class EagerStepModel:
    """The eager model as a step model of hrm_edge.runtime.suggest (the *.kv.onnx graph's contract, numpy in and
    out): run(tokens [B, S], past_k, past_v [T, B, H, P, hd]) -> (logits [B, S, V], present_k, present_v)."""

    def __init__(self, model, threads: int = 0):
        if threads:
            torch.set_num_threads(threads)
        self.form = FunctionalDecodeForm(model.eval())
        self.form.form = "loop"  # the same block applications; eager while_loop is traced anew for each shape
        self.cfg, self.max_seq_len = model.cfg, model.cfg.max_seq_len

    def empty_past(self) -> tuple[np.ndarray, np.ndarray]:  # [T, 1, H, 0, hd] each
        return tuple(t.numpy() for t in empty_cache(self.cfg))

    def run(self, tokens: np.ndarray, past_k: np.ndarray, past_v: np.ndarray):
        with torch.no_grad():
            out = self.form(torch.from_numpy(np.asarray(tokens, dtype=np.int64)), torch.from_numpy(past_k),
                            torch.from_numpy(past_v))
        return tuple(t.numpy() for t in out)


class EagerSpeculativeDecoder(EagerDecoder):
    """EagerDecoder plus draft / verify / commit (hrm_edge.runtime.speculative) over the same KV cache: a draft
    runs the first outer cycle (CachedDraftForm: applications 0..L, their cache slots) on one token; verify runs
    applications L + 1 .. T - 1 on every pending position at once, from the drafts' cycle-1 states (CachedVerifyForm,
    the ExecuTorch program's two methods run eagerly)."""

    def __init__(self, model, threads: int = 0):
        super().__init__(model, threads)
        self.draft_form = CachedDraftForm(self.form.model, self.form.cache)
        self.verify_form = CachedVerifyForm(self.form.model, self.form.cache)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (token, state [2, 1, 1, D]) per drafted position

    def reset(self):
        super().reset()
        self.pending = []

    def draft(self, token: int) -> np.ndarray:  # -> cycle-1 logits [V]
        with torch.no_grad():
            logits, state = self.draft_form(torch.tensor([[token]]), torch.tensor([self.pos + len(self.pending)]))
        self.pending.append((token, state))
        return logits[0, -1].numpy()

    def verify(self) -> np.ndarray:  # -> full logits [n, V] at the pending positions
        tokens = torch.tensor([[token for token, _ in self.pending]])  # [1, n]
        states = torch.cat([s for _, s in self.pending], dim=2)  # [2, 1, n, D]
        with torch.no_grad():
            return self.verify_form(tokens, states, torch.tensor([self.pos]))[0].numpy()

    def commit(self, n: int) -> None:
        self.pos += n
        self.pending = []


class EagerAdaptiveDecoder(EagerDecoder):
    """EagerDecoder with adaptive depth: the prefill runs every cycle; a decode step runs the first outer cycle
    (CachedDraftForm), then, when `rule` says so, exits with that cycle's readout and fills the skipped applications'
    cache slots from the same role's first-cycle ones (KVCache.copy_first_cycle), else runs the rest
    (CachedVerifyForm). depths: the outer cycles each decoded token ran."""

    def __init__(self, model, rule: HaltingRule, threads: int = 0):
        check_adaptive(model.cfg)
        super().__init__(model, threads)
        self.rule = rule
        self.first_cycle = CachedDraftForm(self.form.model, self.form.cache)
        self.rest = CachedVerifyForm(self.form.model, self.form.cache)
        self.depths: list[int] = []

    def reset(self):
        super().reset()
        self.depths = []

    def decode(self, token: int) -> np.ndarray:  # -> [V]
        m, tokens, pos = self.form.model, torch.tensor([[token]]), torch.tensor([self.pos])
        with torch.no_grad():
            logits, state = self.first_cycle(tokens, pos)  # [1, 1, V], [2, 1, 1, D]
            if self.rule.exits(m, m.final_state(state[0], state[1]), logits).item():
                self.form.cache.copy_first_cycle(pos, self.rest.steps, m.cfg.L_cycles + 1)
                self.depths.append(1)
            else:
                logits = self.rest(tokens, state, pos)
                self.depths.append(m.cfg.H_cycles)
        self.pos += 1
        return logits[0, -1].numpy()
