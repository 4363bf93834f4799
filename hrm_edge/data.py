"""Corpus, deterministic splits, token streams and batches.

Default corpus: the Python standard library source of the running interpreter (present on every machine,
no download). A user corpus (--corpus) is a text file or a folder of text files, all UTF-8.

Splits are by hash of the document name, so they do not move when files are added or removed:
bucket = sha256(name) % 100; bucket < val_percent -> validation, next calib_percent -> calibration
(never validation), the rest -> train. A corpus of few files is cut into line-aligned chunks first so
that every split gets text.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hrm_edge.config import DataConfig
from hrm_edge.errors import UserError

MIN_DOCUMENTS = 200  # fewer files than this: cut them into ~400 line-aligned pieces so every split gets text


@dataclass
class Corpus:
    source: str  # "python-stdlib <version>" or the user path
    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    calib: list[str] = field(default_factory=list)
    names_sha256: str = ""  # fingerprint of the document list and the split

    def split(self, name: str) -> list[str]:
        return {"train": self.train, "val": self.val, "calib": self.calib}[name]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[str, Path]]:
    root = stdlib_root()
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or not p.is_file():
            continue
        files.append((rel, p))
    return files


def _user_files(corpus: Path) -> list[tuple[str, Path]]:
    if not corpus.exists():
        raise UserError(f"corpus not found: {corpus}")
    if corpus.is_file():
        return [(corpus.name, corpus)]
    files = []
    for p in corpus.rglob("*"):
        rel = p.relative_to(corpus)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            files.append((rel.as_posix(), p))
    if not files:
        raise UserError(f"corpus folder {corpus} contains no files")
    return files


def _bucket(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100


def _chunks(text: str, size: int) -> list[str]:
    """Line-aligned pieces of about `size` characters."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return out


def load_corpus(cfg: DataConfig, required_splits: tuple[str, ...] = ("train", "val")) -> Corpus:
    """Read, validate and split the corpus. User mistakes raise UserError."""
    import sys

    if cfg.corpus:
        root = Path(cfg.corpus).expanduser()
        files, strict = _user_files(root), True
        source = str(root)
    else:
        files, strict = _stdlib_files(), False
        source = f"python-stdlib {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    # deterministic order that does not favour one corner of the tree when max_corpus_bytes cuts it
    files.sort(key=lambda f: (hashlib.sha256(f[0].encode()).hexdigest(), f[0]))

    docs: list[tuple[str, str]] = []
    total = 0
    for name, path in files:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start})") from None
            continue  # a few stdlib test files are deliberately not UTF-8
        if not text.strip():
            continue
        if cfg.max_corpus_bytes and total + len(raw) > cfg.max_corpus_bytes and docs:
            continue
        docs.append((name, text))
        total += len(raw)
    if not docs:
        raise UserError(f"corpus {source} is empty (no non-blank text)")
    if len(docs) < MIN_DOCUMENTS:
        size = max(512, sum(len(t) for _, t in docs) // (2 * MIN_DOCUMENTS))
        docs = [(f"{name}#{i}", piece) for name, text in docs for i, piece in enumerate(_chunks(text, size))]

    corpus = Corpus(source=source)
    h = hashlib.sha256()
    for name, text in docs:
        b = _bucket(name)
        split = "val" if b < cfg.val_percent else "calib" if b < cfg.val_percent + cfg.calib_percent else "train"
        corpus.split(split).append(text)
        h.update(f"{split}\t{name}\t{len(text)}\n".encode())
    corpus.names_sha256 = h.hexdigest()
    for split in required_splits:
        if not corpus.split(split):
            raise UserError(
                f"corpus {source} is too small: its {split} split is empty "
                f"({len(docs)} documents, {total} bytes); give it more text"
            )
    return corpus


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """Concatenate documents into one int32 token stream, each followed by EOS."""
    from hrm_edge.tokenizer import eos_id

    eos = eos_id(tok)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def bytes_per_token(texts: list[str], n_tokens: int) -> float:
    """For bits per byte: bpb = (loss in nats / ln 2) * tokens / bytes."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return n_bytes / max(n_tokens, 1)


def random_batch(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int):
    """Batch for one training step, a pure function of (seed, step): resume replays it exactly."""
    rng = np.random.default_rng([seed, step])
    if len(stream) < seq_len + 2:
        raise UserError(f"training split has {len(stream)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    window = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)  # [B, S + 1]
    return window[:, :-1], window[:, 1:]


def fixed_windows(stream: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """Up to n non-overlapping windows of seq_len + 1 tokens from the start of a stream, [n, S + 1]."""
    n = min(n, (len(stream) - 1) // seq_len)
    if n < 1:
        raise UserError(f"validation split has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
