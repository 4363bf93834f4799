"""Adaptive depth over a self-speculative decoder: a decoded token may exit after the first outer cycle.

A decode step drafts the token (the first outer cycle: its readout and its cache slots, applications 0..L); when
the rule says so the token exits with that readout, and skip() fills the slots of the applications it skipped
(L + 1 .. T - 1) with the same role's first-cycle keys/values, slot t <- slot t mod (L + 1) (what later tokens
attend to there: hrm_edge.model.lm.KVCache.copy_first_cycle); otherwise verify() runs the rest of the depth. The
prefill runs every cycle. Any decoder with draft / verify / commit (hrm_edge.runtime.speculative) and skip() serves:
the ONNX draft + verify graphs, the ExecuTorch program's draft / verify / skip methods, the eager model.

The exported artifacts use the top-probability rule (TopProbRule); the eager model can also use its halting head
(hrm_edge.model.eager.EagerAdaptiveDecoder). AdaptiveDecoder has the plain decoders' prefill/decode, so
hrm_edge.runtime.decoders.generate drives it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from hrm_edge.runtime.decoders import Generation, Sampling, decode_logits, generate

# top probability of the first cycle's readout at which a token exits: the most-exiting threshold of
# `python -m hrm_edge.evaluate hrm_edge/default_model --depth-curve` whose held-out bits per byte stay within 1.005x
# of full depth's (26.3% of tokens exit at 1.0042x; docs/measurements.md)
DEFAULT_EXIT_THRESHOLD = 0.8


# a speculative set's branch graph is checked on BRANCH_WINDOWS validation windows, BRANCH_TOKENS tokens after the
# prefill (hrm_edge.verify.parity.branch_logits): its eager reference, <name>/first_cycle, holds only those
BRANCH_WINDOWS = 2
BRANCH_TOKENS = 64


def reference_name(reference: str) -> str:
    """The parity bundle's name (under "reference/") of the eager adaptive reference of the artifacts whose eager
    reference is `reference` ("fp32" for fp32 ones): <name>/logits [N, S, V] and <name>/exited [N, S] bool, and
    <name>/first_cycle [BRANCH_WINDOWS, BRANCH_TOKENS, V] (the first outer cycle's logits, for the branch graph)."""
    return f"adaptive/{reference}"


def top_prob(logits: np.ndarray) -> float:
    """logits [V] -> the largest softmax probability, max p = 1 / sum(exp(z - max z))."""
    z = logits.astype(np.float64)
    return float(1.0 / np.exp(z - z.max()).sum())


@dataclass(frozen=True)
class TopProbRule:
    """A token exits when the first cycle's top probability is >= threshold (above 1: nothing exits)."""

    threshold: float = DEFAULT_EXIT_THRESHOLD

    def __call__(self, logits: np.ndarray) -> bool:
        return top_prob(logits) >= self.threshold


class AdaptiveDecoder:
    """prefill(tokens [S]) -> logits [S, V] at full depth; decode(token) -> logits [V] after one outer cycle or all
    `full_depth` of them, as `exits` (first-cycle logits [V] -> bool) decides. depths: each decoded token's outer
    cycles; exited: whether it exited."""

    def __init__(self, decoder, full_depth: int, exits: Callable[[np.ndarray], bool] = TopProbRule()):
        self.decoder, self.full_depth, self.exits = decoder, full_depth, exits
        self.max_seq_len = decoder.max_seq_len
        self.depths: list[int] = []

    @property
    def pos(self) -> int:
        return self.decoder.pos

    @property
    def exited(self) -> list[bool]:
        return [d == 1 for d in self.depths]

    def reset(self):
        self.decoder.reset()
        self.depths = []

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        return self.decoder.prefill(tokens)

    def decode(self, token: int) -> np.ndarray:
        logits = self.decoder.draft(token)
        if self.exits(logits):
            self.decoder.skip()
            self.depths.append(1)
        else:
            logits = self.decoder.verify()[0]
            self.depths.append(self.full_depth)
        self.decoder.commit(1)
        return logits


def adaptive_decode_logits(decoder: AdaptiveDecoder, tokens: np.ndarray, prefill_len: int):
    """tokens [N, S]: prefill the first prefill_len tokens, then decode the rest one at a time with adaptive depth.
    Returns (logits [N, S, V], exited [N, S] bool; the prefilled positions never exit)."""
    logits, exited = [], []
    for row in tokens:
        logits.append(decode_logits(decoder, row[None, :], prefill_len)[0])
        exited.append([False] * prefill_len + decoder.exited)
    return np.stack(logits), np.array(exited, dtype=bool)


@dataclass
class AdaptiveGeneration(Generation):
    exit_rate: float = 0.0  # decoded tokens that exited after the first outer cycle


def generate_adaptive(decoder: AdaptiveDecoder, prompt: list[int], max_new_tokens: int,
                      sampling: Sampling = Sampling(), **options) -> AdaptiveGeneration:
    """hrm_edge.runtime.decoders.generate with adaptive depth, and the share of decode steps that exited."""
    g = generate(decoder, prompt, max_new_tokens, sampling, **options)
    exit_rate = float(np.mean(decoder.exited)) if decoder.depths else 0.0
    return AdaptiveGeneration(**{f.name: getattr(g, f.name) for f in fields(g)}, exit_rate=exit_rate)
