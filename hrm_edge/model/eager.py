"""Eager decoding: the model behind the same prefill/decode interface as hrm_edge.runtime.decoders."""
from __future__ import annotations

import numpy as np
import torch

from hrm_edge.model.lm import (CachedDraftForm, CachedVerifyForm, DecodeForm, FunctionalDecodeForm, HaltingRule,
                               check_adaptive, empty_cache)
from hrm_edge.runtime.adaptive import AdaptiveDecoder


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
    out): run(tokens [B, S], past_k, past_v [T, B, H, P, hd]) -> (logits [B, S, V], present_k, present_v).
    n_cycles=1: the first outer cycle over the first L + 1 cache slots, the *.draft.onnx graph's contract (its
    extra `state` output left out)."""

    def __init__(self, model, threads: int = 0, n_cycles: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.form = FunctionalDecodeForm(model.eval(), n_cycles=n_cycles)
        self.form.form = "loop"  # the same block applications; eager while_loop is traced anew for each shape
        self.cfg, self.max_seq_len = model.cfg, model.cfg.max_seq_len
        self.slots = (n_cycles or model.cfg.H_cycles) * (model.cfg.L_cycles + 1)  # T: the cache slots it reads

    def empty_past(self) -> tuple[np.ndarray, np.ndarray]:  # [T, 1, H, 0, hd] each
        return tuple(t.numpy()[: self.slots] for t in empty_cache(self.cfg))

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

    def draft_many(self, tokens: list[int]) -> np.ndarray:  # -> cycle-1 logits [n, V]
        with torch.no_grad():
            logits, state = self.draft_form(torch.tensor([tokens]), torch.tensor([self.pos + len(self.pending)]))
        self.pending += [(token, state[:, :, i: i + 1]) for i, token in enumerate(tokens)]  # state [2, 1, n, D]
        return logits[0].numpy()

    def verify_many(self, tokens: list[int]) -> np.ndarray:  # -> full logits [n, V]
        self.draft_many(tokens)
        return self.verify()

    def verify(self) -> np.ndarray:  # -> full logits [n, V] at the pending positions
        tokens = torch.tensor([[token for token, _ in self.pending]])  # [1, n]
        states = torch.cat([s for _, s in self.pending], dim=2)  # [2, 1, n, D]
        with torch.no_grad():
            return self.verify_form(tokens, states, torch.tensor([self.pos]))[0].numpy()

    can_skip = True

    def skip(self) -> None:
        """The pending positions exit after the first cycle (adaptive depth): their slots of applications L + 1 ..
        T - 1 take the same role's first-cycle keys/values (KVCache.copy_first_cycle)."""
        positions = torch.arange(self.pos, self.pos + len(self.pending))
        self.form.cache.copy_first_cycle(positions, self.verify_form.steps, self.form.model.cfg.L_cycles + 1)

    def commit(self, n: int) -> None:
        self.pos += n
        self.pending = []


class EagerAdaptiveDecoder(AdaptiveDecoder):
    """The eager model with adaptive depth (hrm_edge.runtime.adaptive.AdaptiveDecoder over EagerSpeculativeDecoder):
    the prefill runs every cycle; a decode step runs the first outer cycle, then, when `rule` says so, exits with
    that cycle's readout and fills the skipped applications' cache slots from the same role's first-cycle ones, else
    runs the rest. The rule may be the top probability or the halting head (which reads the first cycle's state).
    depths: the outer cycles each decoded token ran."""

    def __init__(self, model, rule: HaltingRule, threads: int = 0):
        check_adaptive(model.cfg)
        inner = EagerSpeculativeDecoder(model, threads)

        def exits(logits: np.ndarray) -> bool:  # logits [V] of the pending position's first cycle
            state = inner.pending[-1][1]  # [2, 1, 1, D]
            with torch.no_grad():
                z = model.final_state(state[0], state[1])
                return bool(rule.exits(model, z, torch.from_numpy(logits)[None, None]).item())

        super().__init__(inner, model.cfg.H_cycles, exits)
        self.rule = rule
