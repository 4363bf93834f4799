"""Byte-level BPE (HF `tokenizers`), saved as tokenizer.json.

Byte level means every UTF-8 string encodes (no unknown token). The JSON is the format ExecuTorch's
runner loads through pytorch_tokenizers (BPE with merges, ByteLevel pre-tokenizer), and tests check that
it encodes identically there.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_text

BOS = "<|bos|>"  # pytorch_tokenizers finds BOS/EOS by these substrings in the special tokens
EOS = "<|eos|>"
SPECIAL_TOKENS = [BOS, EOS]  # ids 0 and 1


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise UserError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS) + 1} (256 bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    atomic_write_text(path, tok.to_str())


def load_tokenizer(path: Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"{path} is not a valid tokenizer.json: {e}") from None


def bos_id(tok: Tokenizer) -> int:
    return tok.token_to_id(BOS)


def eos_id(tok: Tokenizer) -> int:
    return tok.token_to_id(EOS)
