"""Self-speculative decoding: the model's first outer cycle drafts, the full depth verifies, the output is the
full model's (token for token when greedy; the full model's distribution when sampling).

HRM-LM applies one block T = H * (L + 1) times. Its first outer cycle (applications 0..L) already ends in a
readout that training supervises (the auxiliary loss), and on the model's own continuations that readout's
argmax equals the full depth's most of the time. One round, starting at position p with the next input token x:

    draft   k + 1 calls of the first cycle alone, one position each (p .. p + k): x, then each call's own
            proposal; every call writes the caches of applications 0..L and keeps its cycle-1 states
    verify  ONE call of applications L + 1 .. T - 1 over those k + 1 positions, continuing from the kept
            cycle-1 states: the full model's logits at p .. p + k (the first L + 1 applications are not redone:
            their keys, values and states are exactly what the full model computes for those inputs)
    accept  the full model's token at each position while the draft's proposal agrees; the first disagreement
            (or the bonus token after the last position) ends the round: between 1 and k + 1 new tokens

Where the context already holds the round's text (code repeats names, calls and whole lines; a greedy
continuation repeats itself), the round's proposals come from the context instead (prompt lookup: the tokens that
followed the latest earlier occurrence of the last few tokens, context_guess), and the full depth runs over all of
them at once (verify_many: one call of the KV program where the runtime has one that shares the caches, else one
draft call for all of them and the verify). Verification is the same, so the output is still the full model's; a
guess costs about one batched full-depth call of its length and yields at least one token.

Positions after a disagreement were computed from a wrong input; they are dropped (commit) and rewritten by
the next round before anything attends to them. A decoder that supports this has, besides reset() and
prefill(tokens [S]) -> full logits [S, V]:
    draft(token) -> the first cycle's logits [V] at the next pending position
    verify_many(tokens) -> the full model's logits [n, V] at the next n positions (nothing pending before it), as
                the pending positions of one call (ONNX and eager: draft_many, the first cycle over all n, then verify)
    verify() -> the full model's logits [n, V] at the n positions drafted since the last commit
    commit(n)   keeps the first n pending positions and drops the rest
    skip()      instead of verify(), where can_skip: the pending positions exit after the first cycle
                (adaptive depth, hrm_edge.runtime.adaptive); the slots of applications L + 1 .. T - 1 take the
                first cycle's keys/values of the same role, slot t <- slot t mod (L + 1) (KVCache.copy_first_cycle)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hrm_edge.runtime.decoders import (Generation, OnnxDecoder, PteDecoder, Sampling, ort_session, prefill_prompt,
                                       sample, sampling_probs)
from hrm_edge.runtime.healing import Heal, penalize_repetition, shape_logits

DEFAULT_DRAFT_LEN = 4  # k: proposals verified per round (measured: see docs/measurements.md)
DEFAULT_LOOKUP_LEN = 8  # most proposals a round takes from the context (0: the first cycle drafts every round)
LOOKUP_NGRAMS = (3, 2)  # the context's last n tokens looked up, longest first
PROGRAMS = ("kv", "draft", "verify")  # the file-name word of each graph: hrm.fp32.kv.onnx, hrm.fp32.draft.onnx, ...


def speculative_set(path: str) -> list[str]:
    """The KV, draft and verify graphs' file names of the set `path` (any of the three) belongs to."""
    parts = path.split(".")
    word = next(i for i, p in enumerate(parts) if p in PROGRAMS)
    return [".".join(parts[:word] + [w] + parts[word + 1:]) for w in PROGRAMS]


@dataclass
class SpeculativeGeneration(Generation):
    draft_len: int = 0
    rounds: int = 0
    proposed: int = 0  # draft tokens offered to verification
    accepted: int = 0  # of those, the ones the full model kept
    round_tokens: list = field(default_factory=list)
    lookup_rounds: int = 0  # rounds whose proposals came from the context (context_guess)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        return float(np.mean(self.round_tokens)) if self.round_tokens else 0.0


@dataclass(frozen=True)
class RoundPlan:
    """How a self-speculative round gets its proposals: from the context where it holds a guess (context_guess, at
    most lookup_len tokens, 0: never), else draft_len first-cycle drafts, one call each."""
    draft_len: int = DEFAULT_DRAFT_LEN
    lookup_len: int = DEFAULT_LOOKUP_LEN


def context_guess(context: list[int], max_len: int, ngrams: tuple = LOOKUP_NGRAMS) -> list[int]:
    """Prompt lookup: the (at most max_len) tokens that followed the latest earlier occurrence of the context's last
    n tokens, for the first n of `ngrams` that occurs; [] when none does (or max_len < 1)."""
    if max_len < 1:
        return []
    ids = np.asarray(context, dtype=np.int64)
    for n in ngrams:
        if len(ids) <= n:
            continue
        # windows[j] = ids[j : j + n], for the starts j whose continuation is inside the context
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [len - n, n]
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start: start + max_len].tolist()
    return []


def one_hot_probs(tokens: list[int], vocab: int) -> list[np.ndarray]:
    """A context guess as draft distributions q (a point mass on each guessed token): speculative sampling keeps
    guess d with probability p(d) and otherwise samples p with d removed, so the output stays the full model's."""
    probs = np.zeros((len(tokens), vocab))
    probs[np.arange(len(tokens)), tokens] = 1.0
    return list(probs)


def accept_greedy(full: np.ndarray, proposals: list[int], context: list[int] = (), penalty: float = 1.0) -> list[int]:
    """full [n, V] logits at the drafted positions, proposals [n - 1]: the input drafted after each position.
    Returns the full model's tokens, up to and including its first disagreement with a proposal. context: the
    tokens before the round (prompt and generated), whose repetition `penalty` applies at every position, with
    the proposals before that position (its own prefix: the same logits plain decoding would shape)."""
    out = []
    for i, logits in enumerate(full):
        token = int(np.argmax(penalize_repetition(logits, list(context) + proposals[:i], penalty)))
        out.append(token)
        if i == len(proposals) or token != proposals[i]:
            break
    return out


def accept_sampled(full: np.ndarray, draft_probs: list[np.ndarray], proposals: list[int], s: Sampling,
                   rng: np.random.Generator, context: list[int] = ()) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): proposal d drawn from q is kept with
    probability min(1, p(d) / q(d)); on rejection the token is drawn from max(0, p - q), renormalised. The
    kept tokens are distributed as the full model's own samples. draft_probs[i] is q at position i; the
    repetition penalty as in accept_greedy."""
    out = []
    for i, logits in enumerate(full):
        p = sampling_probs(penalize_repetition(logits, list(context) + proposals[:i], s.repetition_penalty), s)
        if i == len(proposals):
            out.append(int(rng.choice(len(p), p=p)))
            break
        d, q = proposals[i], draft_probs[i]
        if rng.random() < min(1.0, p[d] / q[d]):
            out.append(d)
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        out.append(int(rng.choice(len(p), p=residual / total)) if total > 0 else int(rng.choice(len(p), p=p)))
        break
    return out


def teacher_forced_logits(decoder, tokens: np.ndarray, prefill_len: int, draft_len: int) -> np.ndarray:
    """tokens [N, S]: prefill the first prefill_len tokens, then draft the given tokens and verify them in rounds of
    draft_len + 1 positions; the full model's logits at every position [N, S, V] (what the parity gate compares
    with the eager model: the verify graph's logits at every verified position, across rounds). Rounds alternate
    between one draft call per position + verify and one verify_many call (a context guess's round), so both
    ways of verifying are checked."""
    out = []
    for row in tokens:
        decoder.reset()
        logits = [decoder.prefill(row[:prefill_len])]
        for i, start in enumerate(range(prefill_len, len(row), draft_len + 1)):
            chunk = row[start: start + draft_len + 1]
            if i % 2:
                logits.append(decoder.verify_many([int(token) for token in chunk]))
                decoder.commit(len(chunk))
                continue
            for token in chunk:
                decoder.draft(int(token))
            logits.append(decoder.verify())
            decoder.commit(len(chunk))
        out.append(np.concatenate(logits, axis=0))
    return np.stack(out)


def draft_round(decoder, token: int, n: int, s: Sampling, rng: np.random.Generator,
                context: list[int] = ()) -> tuple[list, list]:
    """n draft calls from `token`: (proposals [n - 1] — the inputs of positions 2..n —, q of each position);
    the draft's logits shaped by the repetition penalty over context and the proposals so far."""
    proposals, probs = [], []
    for i in range(n):
        logits = decoder.draft(token)
        if i == n - 1:
            break  # the last position's proposal would only be verified by the next round
        logits = penalize_repetition(logits, list(context) + proposals, s.repetition_penalty)
        if s.temperature <= 0:
            token = int(np.argmax(logits))
        else:
            q = sampling_probs(logits, s)
            token = int(rng.choice(len(q), p=q))
            probs.append(q)
        proposals.append(token)
    return proposals, probs


def generate_speculative(decoder, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                         eos_id: int | None = None, on_token: Callable[[int], None] | None = None,
                         heal: Heal | None = None, plan: RoundPlan = RoundPlan()) -> SpeculativeGeneration:
    """hrm_edge.runtime.decoders.generate's contract, drafted by the first cycle and verified by the full depth. A
    round whose context holds a guess verifies it in one call; any other round drafts plan.draft_len proposals."""
    rng = np.random.default_rng(sampling.seed)
    g = SpeculativeGeneration(prompt_len=len(prompt), draft_len=plan.draft_len)
    logits, room = prefill_prompt(decoder, prompt, g)
    t = time.perf_counter()
    budget = min(max_new_tokens, room)
    penalty = sampling.repetition_penalty
    new = [sample(shape_logits(logits, prompt, penalty, heal), sampling, rng)]
    while True:
        for token in new[: budget - len(g.tokens)]:
            if g.add(token, eos_id, on_token):
                break
        if g.stopped_at_eos or len(g.tokens) >= budget:
            break
        # positions left in the context: the round drafts at most that many (its last input is g.tokens[-1])
        room_left = budget - len(g.tokens)
        context = list(prompt) + g.tokens
        guess = context_guess(context, min(plan.lookup_len, room_left - 1))
        if guess:
            full = decoder.verify_many([g.tokens[-1], *guess])  # [n, V]
            proposals, probs = guess, None
            g.lookup_rounds += 1
        else:
            n = min(plan.draft_len + 1, room_left)
            proposals, probs = draft_round(decoder, g.tokens[-1], n, sampling, rng, context)
            full = decoder.verify()  # [n, V]
        if sampling.temperature <= 0:
            new = accept_greedy(full, proposals, context, penalty)
        else:
            probs = one_hot_probs(proposals, full.shape[-1]) if probs is None else probs
            new = accept_sampled(full, probs, proposals, sampling, rng, context)
        decoder.commit(len(new))
        g.rounds += 1
        g.proposed += len(proposals)
        g.accepted += len(new) - 1
        g.round_tokens.append(len(new))
    g.decode_s = time.perf_counter() - t
    return g


class OnnxSpeculativeDecoder(OnnxDecoder):
    """The KV graph for prefill, plus the draft graph (first outer cycle) and the verify graph (the rest) of
    hrm_edge.export.onnx. The cache is kept in two halves: slots 0..L, which the drafts extend one position at a
    time, and slots L + 1 .. T - 1, which verification extends by every drafted position at once; commit cuts both
    back to the kept positions (past/present graphs: the caller owns the arrays)."""

    def __init__(self, kv_path: Path, draft_path: Path, verify_path: Path, threads: int = 0):
        super().__init__(kv_path, threads)
        self.draft_session = ort_session(draft_path, threads)
        self.verify_session = ort_session(verify_path, threads)
        self.split = next(i.shape[0] for i in self.draft_session.get_inputs() if i.name == "past_k")  # L + 1

    def reset(self):
        super().reset()
        self.first = self.rest = (self.k, self.v)  # [L + 1 | T - L - 1, 1, H, P, hd] each, once prefilled
        self.pending_tokens, self.pending_states = [], []

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        logits = super().prefill(tokens)
        self.first = (self.k[: self.split], self.v[: self.split])
        self.rest = (self.k[self.split:], self.v[self.split:])
        return logits

    def draft(self, token: int) -> np.ndarray:  # -> cycle-1 logits [V]
        logits, state, k, v = self.draft_session.run(None, {
            "tokens": np.array([[token]], dtype=np.int64), "past_k": self.first[0], "past_v": self.first[1]})
        self.first = (k, v)
        self.pending_tokens.append(token)
        self.pending_states.append(state)  # [2, 1, 1, D]
        return logits[0, -1]

    def draft_many(self, tokens: list[int]) -> np.ndarray:  # -> cycle-1 logits [n, V]
        logits, state, k, v = self.draft_session.run(None, {
            "tokens": np.array([tokens], dtype=np.int64), "past_k": self.first[0], "past_v": self.first[1]})
        self.first = (k, v)
        self.pending_tokens.extend(tokens)
        self.pending_states.append(state)  # [2, 1, n, D]
        return logits[0]

    def verify_many(self, tokens: list[int]) -> np.ndarray:  # -> full logits [n, V]
        self.draft_many(tokens)
        return self.verify()

    def verify(self) -> np.ndarray:  # -> full logits [n, V]
        logits, k, v = self.verify_session.run(None, {
            "tokens": np.array([self.pending_tokens], dtype=np.int64),
            "state": np.concatenate(self.pending_states, axis=2), "past_k": self.rest[0], "past_v": self.rest[1]})
        self.rest = (k, v)
        return logits[0]

    can_skip = True  # adaptive depth needs skip(); every ONNX set has it (no graph of its own)

    def skip(self) -> None:
        """The pending positions exit after the first cycle: rest slot i (application L + 1 + i) gets first-cycle slot
        (L + 1 + i) mod (L + 1) = i mod (L + 1)'s keys/values at those positions, appended as verify() would."""
        n = len(self.pending_tokens)
        slots = np.arange(self.rest[0].shape[0]) % self.split  # [T - L - 1]
        self.rest = tuple(np.concatenate([r, f[slots, :, :, -n:]], axis=3) for r, f in zip(self.rest, self.first))

    def commit(self, n: int) -> None:
        self.pos += n
        self.first = tuple(np.ascontiguousarray(c[:, :, :, : self.pos]) for c in self.first)
        self.rest = tuple(np.ascontiguousarray(c[:, :, :, : self.pos]) for c in self.rest)
        self.pending_tokens, self.pending_states = [], []


class PteSpeculativeDecoder(PteDecoder):
    """The ExecuTorch program of hrm_edge.export.executorch.export_pte_speculative: "forward" prefills, "draft"
    runs the first outer cycle on one token, "verify" the rest of the depth on every pending position, all over
    the program's one set of cache buffers (shared across its methods; the Runtime API's methods share the
    program's planned memory). Nothing is copied on commit: rows past the kept positions are stale, and the
    next round rewrites them before anything attends to them (the cache ops attend up to the call's last
    position)."""

    def __init__(self, path: Path, threads: int = 0, weight_cache: bool | None = None):
        super().__init__(path, threads, weight_cache)
        self.draft_method = self.program.load_method("draft")
        self.verify_method = self.program.load_method("verify")
        methods = self.program.method_names
        self.skip_method = self.program.load_method("skip") if "skip" in methods else None  # older programs lack it

    def reset(self):
        super().reset()
        self.pending_tokens, self.pending_states = [], []

    def draft(self, token: int) -> np.ndarray:  # -> cycle-1 logits [V]
        t = self.torch
        logits, state = self.draft_method.execute([
            t.tensor([[token]], dtype=t.int64), t.tensor([self.pos + len(self.pending_tokens)], dtype=t.int64)])
        self.pending_tokens.append(token)
        self.pending_states.append(state)  # [2, 1, 1, D]
        return logits.numpy()[0, -1]

    def verify_many(self, tokens: list[int]) -> np.ndarray:  # -> full logits [n, V]
        """The program's forward method over the n tokens at pos: it writes every application's slots there, as draft
        and verify would, in one call instead of two (hrm_edge.measure.profile.round_costs times it)."""
        t = self.torch
        logits = self.method.execute([t.tensor([tokens], dtype=t.int64), t.tensor([self.pos], dtype=t.int64)])[0]
        self.pending_tokens.extend(tokens)
        return logits.numpy()[0]

    def verify(self) -> np.ndarray:  # -> full logits [n, V]
        t = self.torch
        # contiguous inputs: see PteDecoder._run
        state = t.cat(self.pending_states, dim=2).contiguous()  # [2, 1, n, D]
        logits = self.verify_method.execute([
            t.tensor([self.pending_tokens], dtype=t.int64), state, t.tensor([self.pos], dtype=t.int64)])[0]
        return logits.numpy()[0]

    @property
    def can_skip(self) -> bool:  # a .spec.pte exported before adaptive depth has no skip method
        return self.skip_method is not None

    def skip(self) -> None:
        """The pending positions exit after the first cycle: the program's "skip" method fills their slots of
        applications L + 1 .. T - 1 from the first cycle's (ExecuTorchKVCache.copy_first_cycle), one position a call."""
        if self.skip_method is None:
            raise ValueError("this speculative program has no skip method (adaptive depth); re-export it")
        for i in range(len(self.pending_tokens)):
            self.skip_method.execute([self.torch.tensor([self.pos + i], dtype=self.torch.int64)])

    def commit(self, n: int) -> None:
        self.pos += n
        self.pending_tokens, self.pending_states = [], []
