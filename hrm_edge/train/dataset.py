"""Corpus, deterministic splits, token streams and batches.

Default corpus: the Python standard library source of the running interpreter (present on every machine,
no download). A user corpus (--corpus) is a text file or a folder of text files, all UTF-8.

Splits are by hash of the document name, so they do not move when files are added or removed:
bucket = sha256(name) % 100; bucket < val_percent -> validation, next calib_percent -> calibration
(never validation), the rest -> train. A corpus of few files is cut into line-aligned chunks first so
that every split gets text.

A built corpus (`python -m hrm_edge.corpus`, --corpus pypi or the folder it wrote) is a folder
`{split}/{project}/{path}` plus record.json; it is split by project when it is built, and that split is
used as it is: validation then measures code from projects the model has never seen.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hrm_edge.config import DataConfig
from hrm_edge.errors import UserError
from hrm_edge.train.tokenizer import SPECIAL_TOKENS, eos_id

MIN_DOCUMENTS = 200  # fewer files than this: cut them into ~400 line-aligned pieces so every split gets text
PYPI = "pypi"  # --corpus pypi: the corpus `python -m hrm_edge.corpus` builds in its default folder
RECORD = "record.json"  # a built corpus folder's record; its "format" says what it is
CORPUS_FORMAT = "hrm-edge-corpus/1"
SPLITS = ("train", "val", "calib")


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


def default_corpus_cache() -> Path:
    """Where `python -m hrm_edge.corpus` keeps sdists and builds: $XDG_CACHE_HOME/hrm-edge/corpus."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hrm-edge" / "corpus"


def default_built_corpus() -> Path:
    return default_corpus_cache() / PYPI


def is_built_corpus(root: Path) -> bool:
    try:
        return json.loads((Path(root) / RECORD).read_text()).get("format") == CORPUS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def document_order(name: str) -> tuple[str, str]:
    """Sort key of documents: by hash of the name, so a byte cap or a tokenizer sample is not one corner."""
    return hashlib.sha256(name.encode()).hexdigest(), name


def listing_sha256(entries) -> str:
    """sha256 of a built corpus: over sorted lines `split  project  path  sha256(content)`."""
    h = hashlib.sha256()
    for split, project, path, content_sha in sorted(entries):
        h.update(f"{split}\t{project}\t{path}\t{content_sha}\n".encode())
    return h.hexdigest()


def built_corpus_root(corpus: str) -> Path | None:
    """The built corpus folder that --corpus names ("pypi" or a folder holding a record), else None."""
    if corpus == PYPI:
        root = default_built_corpus()
        if not is_built_corpus(root):
            raise UserError(f"the pypi corpus is not built (no {root / RECORD}); run `python -m hrm_edge.corpus`")
        return root
    root = Path(corpus).expanduser()
    return root if root.is_dir() and is_built_corpus(root) else None


def check_corpus(corpus: str | None) -> None:
    """The user errors load_corpus would raise for a --corpus that is not there (an unbuilt pypi corpus, a missing
    path), raised in a moment: before an output folder is made or a long run starts."""
    if corpus and built_corpus_root(corpus) is None and not Path(corpus).expanduser().exists():
        raise UserError(f"corpus not found: {corpus}")


def read_built_corpus(root: Path) -> tuple[dict, list[tuple[str, str, str, str]]]:
    """(record, [(split, project, path, text)]) of a built corpus, checked against its record's sha256."""
    root = Path(root)
    record = json.loads((root / RECORD).read_text())
    files, entries = [], []
    for split in SPLITS:
        for p in sorted((root / split).rglob("*.py")) if (root / split).is_dir() else []:
            project, path = p.relative_to(root / split).as_posix().split("/", 1)
            raw = p.read_bytes()
            files.append((split, project, path, raw))
            entries.append((split, project, path, hashlib.sha256(raw).hexdigest()))
    if listing_sha256(entries) != record.get("sha256"):
        raise UserError(f"built corpus {root} does not match its {RECORD} (files changed?); "
                        "rebuild it with `python -m hrm_edge.corpus`")
    return record, [(split, project, path, raw.decode("utf-8")) for split, project, path, raw in files]


def heldout_projects(corpus: str = PYPI, split: str = "val") -> dict[str, list[tuple[str, str]]]:
    """A built corpus's held-out documents grouped by project: {project: [(path, text)]}, sorted."""
    root = built_corpus_root(corpus)
    if root is None:
        raise UserError(f"{corpus} is not a built corpus (no {RECORD}); build one with `python -m hrm_edge.corpus`")
    grouped: dict[str, list[tuple[str, str]]] = {}
    for s, project, path, text in read_built_corpus(root)[1]:
        if s == split:
            grouped.setdefault(project, []).append((path, text))
    return grouped


def xz_bits_per_byte(texts: list[str]) -> float:
    """The `xz -9` baseline: each text compressed on its own (lzma preset 9, .xz container); total
    compressed bits / total raw UTF-8 bytes."""
    raw = compressed = 0
    for text in texts:
        data = text.encode("utf-8")
        raw += len(data)
        compressed += len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=9))
    return 8 * compressed / max(raw, 1)


def _built_documents(root: Path) -> tuple[str, list[tuple[str, str, str]]]:
    """(source, [(name, text, split)]) of a built corpus; name = project/path."""
    record, docs = read_built_corpus(root)
    return (f"built corpus {root} sha256 {record['sha256']}",
            [(f"{project}/{path}", text, split) for split, project, path, text in docs])


def _read_files(files: list[tuple[str, Path]], strict: bool) -> list[tuple[str, str]]:
    """(name, text) of every non-blank file; non-UTF-8 is a user error when `strict`, else skipped."""
    docs = []
    for name, path in files:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start})") from None
            continue  # a few stdlib test files are deliberately not UTF-8
        if text.strip():
            docs.append((name, text))
    return docs


def _cap_bytes(docs: list, max_bytes: int) -> tuple[list, int]:
    """Documents (name, text, ...) in the given order while they fit in max_bytes (0 = all); total bytes."""
    kept, total = [], 0
    for doc in docs:
        n = len(doc[1].encode("utf-8"))
        if max_bytes and total + n > max_bytes and kept:
            continue
        kept.append(doc)
        total += n
    return kept, total


def _hash_split(name: str, cfg: DataConfig) -> str:
    b = _bucket(name)
    return "val" if b < cfg.val_percent else "calib" if b < cfg.val_percent + cfg.calib_percent else "train"


def load_corpus(cfg: DataConfig, required_splits: tuple[str, ...] = ("train", "val")) -> Corpus:
    """Read, validate and split the corpus. User mistakes raise UserError.

    A built corpus keeps its own by-project split (val_percent / calib_percent do not apply to it)."""
    built = built_corpus_root(cfg.corpus) if cfg.corpus else None
    if built is not None:
        source, labelled = _built_documents(built)
        labelled.sort(key=lambda d: document_order(d[0]))
        labelled, total = _cap_bytes(labelled, cfg.max_corpus_bytes)
    else:
        if cfg.corpus:
            root = Path(cfg.corpus).expanduser()
            files, strict, source = _user_files(root), True, str(root)
        else:
            files, strict = _stdlib_files(), False
            source = f"python-stdlib {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
        # deterministic order that does not favour one corner of the tree when max_corpus_bytes cuts it
        files.sort(key=lambda f: document_order(f[0]))
        docs, total = _cap_bytes(_read_files(files, strict), cfg.max_corpus_bytes)
        if not docs:
            raise UserError(f"corpus {source} is empty (no non-blank text)")
        if len(docs) < MIN_DOCUMENTS:
            size = max(512, sum(len(t) for _, t in docs) // (2 * MIN_DOCUMENTS))
            docs = [(f"{name}#{i}", piece) for name, text in docs for i, piece in enumerate(_chunks(text, size))]
        labelled = [(name, text, _hash_split(name, cfg)) for name, text in docs]

    corpus = Corpus(source=source)
    h = hashlib.sha256()
    for name, text, split in labelled:
        corpus.split(split).append(text)
        h.update(f"{split}\t{name}\t{len(text)}\n".encode())
    corpus.names_sha256 = h.hexdigest()
    for split in required_splits:
        if not corpus.split(split):
            raise UserError(
                f"corpus {source} is too small: its {split} split is empty "
                f"({len(labelled)} documents, {total} bytes); give it more text"
            )
    return corpus


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """Concatenate documents into one int32 token stream, each followed by EOS."""
    eos = eos_id(tok)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def token_byte_lengths(tok) -> np.ndarray:
    """The UTF-8 bytes each token id stands for [V]: a byte-level BPE token's string has one character per byte;
    special tokens (EOS between documents) stand for none. Summed over a stream: its texts' bytes."""
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for token, i in tok.get_vocab().items():
        lengths[i] = 0 if token in SPECIAL_TOKENS else len(token)
    return lengths


def random_batch(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int):
    """Batch for one training step, a pure function of (seed, step): resume replays it exactly."""
    rng = np.random.default_rng([seed, step])
    if len(stream) < seq_len + 2:
        raise UserError(f"the corpus is smaller than one training window: its training split has {len(stream)} tokens, "
                        f"a window needs seq_len + 2 = {seq_len + 2}; give it more text or lower train.seq_len")
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    window = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)  # [B, S + 1]
    return window[:, :-1], window[:, 1:]


def fixed_windows(stream: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """Up to n non-overlapping windows of seq_len + 1 tokens from the start of a stream, [n, S + 1]."""
    n = min(n, (len(stream) - 1) // seq_len)
    if n < 1:
        raise UserError(f"the corpus is smaller than one window: its validation split has {len(stream)} tokens, a "
                        f"window needs seq_len + 1 = {seq_len + 1}; give it more text or lower train.seq_len")
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
