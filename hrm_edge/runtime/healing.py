"""Token healing and the repetition penalty: what every client (complete, the page, the Android core) does to the
logits before sampling; and the cut of a prompt longer than the context (prompt_end). numpy only.

Token healing. A byte-level BPE tokenizer merges a line end with the next line's indentation ("\\n" + "   " is one
token after a colon), so a prompt that ends in a lone "\\n" token is, in training, nearly always followed by a new
top-level statement or EOS. Healing takes the prompt's last token back and lets the first new token be only one
whose bytes start with the removed token's bytes ("\\n" may become "\\n   "). It works in bytes: a byte-level
token can be part of a UTF-8 character. The first new token re-spells the removed bytes; a client shows the text
after them (heal.prefix).

Repetition penalty (Hugging Face's RepetitionPenaltyLogitsProcessor): for every token id in the context
(the prefilled prompt and the tokens generated so far), a positive logit is divided by the penalty and a
negative one multiplied by it; applied before temperature, top-k and top-p, and before greedy argmax. Computed in
float64 so that the page (JavaScript numbers) and the Android core (Java doubles) get the same values bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_REPETITION_PENALTY = 1.2  # complete's and the clients' default (measured: docs/demo.md)


def byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, reversed: printable Latin-1 bytes map to themselves,
    the others to U+0100, U+0101, ... in byte order (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [b for b in range(256) if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


def token_bytes(tok) -> list[bytes]:
    """The bytes of every token id of a byte-level BPE tokenizers.Tokenizer; special tokens have none (they
    decode to no text)."""
    decode = byte_decoder()
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = [b""] * tok.get_vocab_size()
    for text, i in tok.get_vocab().items():
        if text not in special:
            out[i] = bytes(decode[c] for c in text)
    return out


@dataclass
class Heal:
    prefix: bytes  # the removed token's bytes: the first new token starts with them
    allowed: np.ndarray  # [V] bool: the tokens the first new token may be


def prompt_end(prompt: list[int], max_len: int, max_new_tokens: int) -> list[int]:
    """The prompt, or where it leaves no room for one new token, its end: room for max_new_tokens (at least one),
    half the context kept at least. complete --truncate, the page's Complete and the Android core cut alike."""
    if len(prompt) <= max_len - 1:
        return list(prompt)
    return list(prompt[len(prompt) - (max_len - min(max(max_new_tokens, 1), max_len // 2)):])


def heal_prompt(prompt: list[int], vocab_bytes: list[bytes]) -> tuple[list[int], Heal | None]:
    """(the prompt without its last token, the constraint on the first new token); the prompt unchanged and None
    when it has fewer than 2 tokens or ends in a special token."""
    if len(prompt) < 2 or not vocab_bytes[prompt[-1]]:
        return list(prompt), None
    prefix = vocab_bytes[prompt[-1]]
    allowed = np.fromiter((b.startswith(prefix) for b in vocab_bytes), dtype=bool, count=len(vocab_bytes))
    return list(prompt[:-1]), Heal(prefix, allowed)


def penalize_repetition(logits: np.ndarray, context: list[int], penalty: float) -> np.ndarray:
    """logits [V] -> float64 [V]: every id in context made less likely by `penalty` (> 1; 1 = off)."""
    z = logits.astype(np.float64)  # a copy
    if penalty != 1.0 and len(context):
        ids = np.unique(np.asarray(context, dtype=np.int64))
        x = z[ids]
        z[ids] = np.where(x > 0, x / penalty, x * penalty)
    return z


def shape_logits(logits: np.ndarray, context: list[int], penalty: float, heal: Heal | None = None) -> np.ndarray:
    """The logits [V] a token is sampled from (float64): the repetition penalty, then with heal the healing mask
    (the first new token only)."""
    z = penalize_repetition(logits, context, penalty)
    return z if heal is None else np.where(heal.allowed, z, -np.inf)
