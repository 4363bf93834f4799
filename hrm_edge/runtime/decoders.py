"""Prefill + decode with a KV cache, in each runtime, and sampling. numpy in, numpy out.

A Decoder has prefill(tokens [S]) -> logits [S, V] and decode(token) -> logits [V]; reset() starts a
new sequence. The ONNX decoder needs numpy and onnxruntime alone (so a device can run it; ort_session makes
the package's onnxruntime sessions), the .pte decoder executorch (whose pybindings need torch; imported when
one is made). The eager model's decoder, which has the same two methods, is hrm_edge.model.eager.EagerDecoder.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort

from hrm_edge.errors import UserError, first_line
from hrm_edge.runtime.healing import Heal, shape_logits
from hrm_edge.runtime.xnnpack_options import set_weight_cache


def ort_session(path: Path, threads: int = 0, profile: bool = False) -> ort.InferenceSession:
    """The one way an onnxruntime session is made: the CPU provider, warnings and below not logged,
    `threads` intra-op threads and one inter-op thread (0: onnxruntime's default pool), and with profile its
    per-node JSON profile (session.end_profiling() writes it)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.enable_profiling = profile
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # a file cut short or not ONNX, loaded unverified (--no-verify): one line naming it
        raise UserError(f"onnxruntime cannot load {Path(path).name}: {first_line(e)}") from None


def load_pte(runtime, path: Path, method: str = "forward"):
    """(program, its `method`) of an ExecuTorch file, from `runtime` (executorch.runtime.Runtime.get()); a file cut
    short or not a program, loaded unverified (--no-verify), is one line naming it."""
    try:
        program = runtime.load_program(str(path))
        return program, program.load_method(method)
    except Exception as e:
        raise UserError(f"executorch cannot load {Path(path).name}: {first_line(e)}") from None


class Decoder:
    """prefill(tokens [S]) -> logits [S, V]; decode(token) -> logits [V]. Subclasses implement _run."""

    pos = 0  # position of the next token

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        return self._run(tokens)

    def decode(self, token: int) -> np.ndarray:
        return self._run(np.array([token]))[0]


class OnnxStepModel:
    """A *.kv.onnx / *.kv.ort graph: run(tokens [B, S], past_k, past_v) -> (logits [B, S, V], present_k,
    present_v), pasts [T, B, H, P, hd]; batch and past length are dynamic. A *.draft.onnx graph is one too (T = L + 1
    slots, the full cache's first; its `state` output, for the verify graph, is left out)."""

    def __init__(self, path: Path, threads: int = 0, profile: bool = False):
        self.session = ort_session(path, threads, profile)
        shape = next(i.shape for i in self.session.get_inputs() if i.name == "past_k")  # [T, B, H, P, hd]
        self.past_shape, self.slots = (shape[0], 1, shape[2], 0, shape[4]), shape[0]  # slots: T
        self.max_seq_len = int(self.session.get_modelmeta().custom_metadata_map["max_seq_len"])

    def empty_past(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self.past_shape, np.float32), np.zeros(self.past_shape, np.float32)

    def run(self, tokens: np.ndarray, past_k: np.ndarray, past_v: np.ndarray):
        out = self.session.run(None, {"tokens": np.ascontiguousarray(tokens, dtype=np.int64),
                                      "past_k": past_k, "past_v": past_v})
        return out[0], out[-2], out[-1]  # logits, present_k, present_v (a draft graph's state in between)


class OnnxBranchModel:
    """A *.branch.onnx graph: the draft graph's work (the first outer cycle, T = L + 1 slots) for B rows that share
    one context. run(tokens [B, S], context_k, context_v [T, 1, H, P, hd], past_k, past_v [T, B, H, Q, hd]) ->
    (logits [B, S, V], present_k, present_v [T, B, H, Q + S, hd]): each row's own past grows, the context's is
    read and never copied (a KV graph's first T slots are one: the keys of the context's positions)."""

    def __init__(self, path: Path, threads: int = 0, profile: bool = False):
        self.session = ort_session(path, threads, profile)
        shape = next(i.shape for i in self.session.get_inputs() if i.name == "past_k")  # [T, B, H, Q, hd]
        self.slots, self.heads, self.head_dim = shape[0], shape[2], shape[4]
        self.max_seq_len = int(self.session.get_modelmeta().custom_metadata_map["max_seq_len"])

    def empty_rows(self, rows: int) -> tuple[np.ndarray, np.ndarray]:  # [T, rows, H, 0, hd] each
        shape = (self.slots, rows, self.heads, 0, self.head_dim)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def run(self, tokens: np.ndarray, context_k: np.ndarray, context_v: np.ndarray, past_k: np.ndarray,
            past_v: np.ndarray):
        return tuple(self.session.run(None, {"tokens": np.ascontiguousarray(tokens, dtype=np.int64),
                                             "context_k": context_k, "context_v": context_v,
                                             "past_k": past_k, "past_v": past_v}))


class StepDecoder(Decoder):
    """A step model (OnnxStepModel's run / empty_past / max_seq_len) one sequence at a time: the presents of one call
    are the pasts of the next (the cache grows by the call's tokens, up to max_seq_len)."""

    def __init__(self, step):
        self.step, self.max_seq_len = step, step.max_seq_len
        self.empty_cache = step.empty_past()[0]
        self.reset()

    def reset(self):
        self.k = self.v = self.empty_cache
        self.pos = 0

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        logits, self.k, self.v = self.step.run(tokens[None, :], self.k, self.v)
        self.pos += len(tokens)
        return logits[0]


class OnnxDecoder(StepDecoder):
    """The *.kv.onnx graph (or its .ort form) one sequence at a time."""

    def __init__(self, path: Path, threads: int = 0, profile: bool = False):
        super().__init__(OnnxStepModel(path, threads, profile))
        self.session = self.step.session


def set_pte_threads(threads: int) -> None:
    """ExecuTorch's threads in this process: XNNPACK's pool, which ignores torch's setting, and the OpenMP threads of
    the BLAS the optimized kernels call (libtorch's MKL): llama::custom_sdpa's products over several positions
    (prefill, verify) ran on every core whatever `threads` said."""
    import torch
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(threads)
    torch.set_num_threads(threads)


class PteDecoder(Decoder):
    """The *.kv.pte program (ExecuTorch LLM-runner contract): caches live in the program's buffers.

    weight_cache: XNNPACK's weight cache on or off for this load (hrm_edge.runtime.xnnpack_options; on is how
    ExecuTorch's Android and iOS builds run); None leaves the runtime's setting (the pip wheel: off)."""

    def __init__(self, path: Path, threads: int = 0, weight_cache: bool | None = None):
        import torch
        import executorch.kernels.quantized  # noqa: F401  quantized_decomposed kernels for int8 programs
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  llama::update_cache, custom_sdpa
        from executorch.runtime import Runtime

        if threads:
            set_pte_threads(threads)
        if weight_cache is not None:
            set_weight_cache(weight_cache)  # read when the program's delegates are initialised, at load
        self.torch = torch
        self.program, self.method = load_pte(Runtime.get(), path)
        self.max_seq_len = int(self.program.load_method("get_max_seq_len").execute([])[0])
        self.pos = 0

    def reset(self):
        # Stale cache rows are harmless: a new sequence overwrites positions in order, and the attention
        # mask hides every key beyond the current position.
        self.pos = 0

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        t = self.torch
        # contiguous inputs: non-contiguous ones gave silently wrong outputs in ExecuTorch 1.4 (#18562)
        out = self.method.execute([t.from_numpy(np.ascontiguousarray(tokens[None, :], dtype=np.int64)).contiguous(),
                                   t.tensor([self.pos], dtype=t.int64)])[0]
        self.pos += len(tokens)
        return out.numpy()[0]


def decode_logits(decoder, tokens: np.ndarray, prefill_len: int) -> np.ndarray:
    """tokens [N, S]: prefill the first prefill_len tokens, then decode the rest one at a time;
    returns the logits of every position [N, S, V] (to compare with the full-sequence logits)."""
    out = []
    for row in tokens:
        decoder.reset()
        logits = [decoder.prefill(row[:prefill_len])]
        logits += [decoder.decode(int(tok))[None, :] for tok in row[prefill_len:]]
        out.append(np.concatenate(logits, axis=0))
    return np.stack(out)


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    repetition_penalty: float = 1.0  # 1 = off (hrm_edge.runtime.healing.penalize_repetition)


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    if s.temperature <= 0:
        return int(np.argmax(logits))
    p = sampling_probs(logits, s)
    return int(rng.choice(len(p), p=p))


def sampling_probs(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """logits [V] -> the distribution [V] (float64) that sample() draws from at temperature > 0."""
    z = logits.astype(np.float64) / s.temperature
    if s.top_k and s.top_k < len(z):
        kth = np.partition(z, -s.top_k)[-s.top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < s.top_p  # the smallest set whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


@dataclass
class Generation:
    tokens: list = field(default_factory=list)  # the new tokens
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_len: int = 0
    stopped_at_eos: bool = False

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_len / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first new token comes from the prefill logits; each later one costs one decode step
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def add(self, token: int, eos_id: int | None, on_token: Callable[[int], None] | None) -> bool:
        """Append a new token (and stream it); True when it is EOS, which ends the generation."""
        self.tokens.append(token)
        if on_token:
            on_token(token)
        self.stopped_at_eos = eos_id is not None and token == eos_id
        return self.stopped_at_eos


def prefill_prompt(decoder, prompt: list[int], g: Generation) -> tuple[np.ndarray, int]:
    """A new sequence: the prompt's prefill, timed into g. Returns the last position's logits [V] and the new
    tokens the context leaves room for."""
    decoder.reset()
    t = time.perf_counter()
    logits = decoder.prefill(np.asarray(prompt, dtype=np.int64))[-1]
    g.prefill_s = time.perf_counter() - t
    return logits, decoder.max_seq_len - len(prompt)


def generate(decoder, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             eos_id: int | None = None, on_token: Callable[[int], None] | None = None,
             heal: Heal | None = None) -> Generation:
    """Prefill the prompt, then sample up to max_new_tokens (stopping at EOS or the context length). With heal
    (hrm_edge.runtime.healing.heal_prompt; prompt is then the healed one) the first token is constrained."""
    rng = np.random.default_rng(sampling.seed)
    g = Generation(prompt_len=len(prompt))
    logits, room = prefill_prompt(decoder, prompt, g)
    t = time.perf_counter()
    budget = min(max_new_tokens, room)
    for i in range(budget):
        z = shape_logits(logits, list(prompt) + g.tokens, sampling.repetition_penalty, heal if i == 0 else None)
        token = sample(z, sampling, rng)
        if g.add(token, eos_id, on_token):
            break
        if i + 1 < budget:
            logits = decoder.decode(token)
    g.decode_s = time.perf_counter() - t
    return g
