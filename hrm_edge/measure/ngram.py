"""A word n-gram keyboard: the baseline a phone keyboard ships (an n-gram LM of a few MB), trained on the corpus.

Tokens: runs of word characters [\\p{L}\\p{N}_]+ (identifiers, keywords, numbers: what the keyboard suggests),
runs of other visible characters ("(", "):", "=="), and one "\\n" token for each line break (with the
indentation around it); spaces and tabs inside a line are not tokens. Python's `\\w` on str is the class
[\\p{L}\\p{N}_] of the demo page (letters, numbers, underscore; combining marks are neither).

The LM is interpolated Kneser-Ney (Chen & Goodman 1998, one discount per order, D = n1 / (n1 + 2 n2) of the
order's adjusted counts):

    P_k(w | h) = max(a(h w) - D_k, 0) / sum_v a(h v)  +  gamma(h) P_{k-1}(w | h')     (h' = h less its first word)
    P_0(w) = 1 / |predictable tokens|

with a = the raw count at the highest order and the continuation count (distinct left neighbours) below it;
n-grams that begin at a document's start (<s>) keep their raw count. Pruning drops n-grams of order >= 2 whose
raw count is under a threshold; gamma(h) = 1 - sum of h's kept discounted terms, so every context's
distribution still sums to 1 (the dropped mass goes to the lower order).

Suggestions: the 3 identifier words of highest P(w | last order-1 tokens); mid-word, the vocabulary's words
that go on from the typed part (start with it and are longer), ranked the same way.
"""
from __future__ import annotations

import bisect
import io
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hrm_edge.io import atomic_write_bytes
from hrm_edge.runtime.suggest import typed_followers

TOKEN = re.compile(r"\w+|[^\w\s]+|[^\S\n]*\n\s*")
WORD = re.compile(r"\w+")  # an identifier word: the page's [\p{L}\p{N}_]+
NEWLINE, UNK, BOS = "\n", "<unk>", "<s>"
WORD_BITS = 21  # a key packs (context index << WORD_BITS) | token id
TAIL_CHARS = 400  # text before the cursor that a suggestion reads (enough for order - 1 tokens)
FORMAT = "hrm-edge-ngram-keyboard/1"
CACHE_WEIGHT = 0.3  # the cache's share in CachedKeyboard, chosen on the calibration split (docs/keyboard-evaluation.md)
FOLLOW_WEIGHT = 0.25  # its share of the words typed after the same word and link (the same split)
MIN_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)  # pruning thresholds tried


def tokens(text: str) -> list[str]:
    """The LM's tokens of a text: words, runs of other visible characters, "\\n" per line break."""
    return [NEWLINE if t[-1].isspace() or t[0].isspace() else t for t in TOKEN.findall(text)]


def make_vocab(docs: list[list[str]], size: int) -> list[str]:
    """The `size` most frequent tokens, identifier words first (sorted, so a typed prefix is one slice), then
    the other tokens (sorted), then <unk> and <s>."""
    counts = Counter()
    for d in docs:
        counts.update(d)
    kept = [t for t, _ in sorted(counts.items(), key=lambda tc: (-tc[1], tc[0])) if "\0" not in t][:size]
    words = sorted(t for t in kept if WORD.fullmatch(t))
    return words + sorted(t for t in kept if not WORD.fullmatch(t)) + [UNK, BOS]


def encode(docs: list[list[str]], vocab: list[str]) -> np.ndarray:
    """[N] int64 token ids, each document preceded by <s>; tokens out of the vocabulary are <unk>."""
    index = {t: i for i, t in enumerate(vocab)}
    unk, bos = len(vocab) - 2, len(vocab) - 1
    ids = []
    for d in docs:
        ids.append(bos)
        ids.extend(index.get(t, unk) for t in d)
    return np.asarray(ids, dtype=np.int64)


@dataclass
class OrderCounts:
    """The distinct n-grams of one order k: n-gram i is (the (k-1)-gram context[i], token word[i])."""
    context: np.ndarray  # [U] int64 index into order k-1's n-grams (order 1: 0)
    word: np.ndarray  # [U] int64 token id
    count: np.ndarray  # [U] raw counts
    adjusted: np.ndarray  # [U] continuation counts (raw for n-grams that start with <s>); order 1 for <s>: 0


def count_ngrams(ids: np.ndarray, bos: int, max_order: int) -> list[OrderCounts]:
    """Counts of every order 1..max_order; order-1 n-gram i is token i. An n-gram never spans a document's
    start (<s> only as its first token) and never ends in <s>."""
    n, vocab = len(ids), bos + 1
    pos = np.arange(n)
    is_bos = ids == bos
    doc_start = np.maximum.accumulate(np.where(is_bos, pos, 0))  # [N] where each position's document begins
    unigram = np.bincount(ids[~is_bos], minlength=vocab)
    orders = [OrderCounts(np.zeros(vocab, np.int64), np.arange(vocab), unigram, np.zeros(vocab, np.int64))]
    first = np.arange(vocab)  # [U] first token of each n-gram of the last order
    gid = ids.copy()  # [N] index of the n-gram of the last order that ends at each position, -1: none
    for k in range(2, max_order + 1):
        at = pos[(pos - (k - 1) >= doc_start) & ~is_bos]
        at = at[gid[at - 1] >= 0]
        keys = (gid[at - 1] << WORD_BITS) | ids[at]
        uniq, inverse, count = np.unique(keys, return_inverse=True, return_counts=True)
        suffix = np.empty(len(uniq), np.int64)
        suffix[inverse] = gid[at]  # the (k-1)-gram that ends where the n-gram ends
        prev = orders[-1]
        prev.adjusted = np.bincount(suffix, minlength=len(prev.count))
        starts_bos = first == bos
        prev.adjusted[starts_bos] = prev.count[starts_bos]
        context = uniq >> WORD_BITS
        orders.append(OrderCounts(context, uniq & ((1 << WORD_BITS) - 1), count, count.copy()))
        first = first[context]
        gid = np.full(n, -1, np.int64)
        gid[at] = inverse
    last = orders[-1]
    starts_bos = first == bos
    last.adjusted[starts_bos] = last.count[starts_bos]  # continuation counts of the top order are unused
    return orders


def discount(adjusted: np.ndarray) -> float:
    n1, n2 = int(np.sum(adjusted == 1)), int(np.sum(adjusted == 2))
    return n1 / (n1 + 2 * n2) if n1 and n2 else 0.5


@dataclass
class Level:
    """Order k >= 2 after pruning: kept n-grams sorted by (context, word); gamma per kept (k-1)-gram."""
    context: np.ndarray  # [K] int32 index into order k-1's kept n-grams
    word: np.ndarray  # [K] int32
    alpha: np.ndarray  # [K] float32 max(a - D, 0) / sum of the context's a
    gamma: np.ndarray  # [K_{k-1}] float32 the context's weight on order k-1 (1: no kept continuation)

    def __post_init__(self):
        self.keys = (self.context.astype(np.int64) << WORD_BITS) | self.word


def build_levels(counts: list[OrderCounts], order: int, min_count: int, bos: int) -> tuple[np.ndarray, list[Level]]:
    """(unigram distribution P_1 [V], levels of orders 2..order) of an order-`order` KN model whose n-grams of
    order >= 2 are kept when their raw count is >= min_count (their contexts then are too: a context's count
    is at least its n-gram's)."""
    c1 = counts[0]
    a1 = (c1.count if order == 1 else c1.adjusted).astype(np.float64)
    d1 = discount(a1[a1 > 0])
    alpha1 = np.maximum(a1 - d1, 0) / a1.sum()
    base = np.full(len(a1), 1 / (len(a1) - 1))
    base[bos] = 0  # <s> is only ever a context
    unigram = alpha1 + (1 - alpha1.sum()) * base
    levels, index = [], np.arange(len(a1))  # index: old -> new index of order k-1's kept n-grams (-1 dropped)
    for k in range(2, order + 1):
        c = counts[k - 1]
        a = (c.count if k == order else c.adjusted).astype(np.float64)
        d = discount(a[a > 0])
        total = np.bincount(c.context, weights=a, minlength=len(index))
        alpha = np.maximum(a - d, 0) / np.maximum(total[c.context], 1e-30)
        keep = (c.count >= min_count) & (alpha > 0) & (index[c.context] >= 0)
        ctx = index[c.context[keep]]
        n_prev = int(index.max()) + 1
        gamma = 1 - np.bincount(ctx, weights=alpha[keep], minlength=n_prev)
        levels.append(Level(ctx.astype(np.int32), c.word[keep].astype(np.int32), alpha[keep].astype(np.float32),
                            gamma.astype(np.float32)))
        index = np.full(len(c.count), -1, np.int64)
        index[keep] = np.arange(int(keep.sum()))
    return unigram.astype(np.float32), levels


class NgramKeyboard:
    """A pruned KN model and its vocabulary; `suggest(text)` is a keyboard suggester."""

    def __init__(self, vocab: list[str], unigram: np.ndarray, levels: list[Level], info: dict | None = None):
        self.vocab, self.unigram, self.levels, self.info = vocab, unigram, levels, dict(info or {})
        self.index = {t: i for i, t in enumerate(vocab)}
        self.n_words = sum(1 for t in vocab if WORD.fullmatch(t))  # words are ids [0, n_words), sorted
        self.words = vocab[: self.n_words]
        self.unk, self.bos = len(vocab) - 2, len(vocab) - 1

    @property
    def order(self) -> int:
        return len(self.levels) + 1

    @property
    def ngrams(self) -> int:
        return len(self.vocab) + sum(len(lv.word) for lv in self.levels)

    def _find(self, ids: list[int]) -> int:
        """Index of the n-gram `ids` among the kept n-grams of its order, -1 when absent."""
        node = ids[0]
        for k, t in enumerate(ids[1:]):
            keys = self.levels[k].keys
            key = (node << WORD_BITS) | t
            i = int(np.searchsorted(keys, key))
            if i == len(keys) or keys[i] != key:
                return -1
            node = i
        return node

    def distribution(self, context: list[int]) -> np.ndarray:
        """[V] P(next token | the last order-1 token ids of `context`), summing to 1."""
        p = self.unigram.astype(np.float64)
        context = context[len(context) - (self.order - 1):] if self.order > 1 else []
        for j in range(1, len(context) + 1):
            node = self._find(context[-j:])
            if node < 0:
                break  # a longer context holding this one is absent too
            level = self.levels[j - 1]
            lo, hi = np.searchsorted(level.keys, [node << WORD_BITS, (node + 1) << WORD_BITS])
            p *= level.gamma[node]
            p[level.word[lo:hi]] += level.alpha[lo:hi]
        return p

    def context_ids(self, text: str) -> tuple[list[int], str]:
        """(token ids before the word being typed, its typed part) of the text before the cursor."""
        tail = text[-TAIL_CHARS:]
        toks = tokens(tail)
        if len(tail) < len(text):
            toks = toks[1:]  # the first token may be cut
        typed = toks.pop() if toks and WORD.fullmatch(tail[-1:]) else ""
        ids = [self.bos] if len(tail) == len(text) else []
        return ids + [self.index.get(t, self.unk) for t in toks], typed

    def suggest(self, text: str, n: int = 3) -> list[str]:
        """The n most probable identifier words after `text`; mid-word, the words completing the typed part."""
        context, typed = self.context_ids(text)
        lo, hi = self.word_range(typed)
        if hi <= lo:
            return []
        p = self.distribution(context)[lo:hi]
        return [self.words[lo + i] for i in top_words(p, n)]

    def __call__(self, text: str) -> list[str]:
        return self.suggest(text)

    def word_range(self, typed: str) -> tuple[int, int]:
        """[lo, hi): the ids of the vocabulary's words that go on from `typed` (start with it and are longer: the
        typed part itself is never the word being typed; all words for "")."""
        lo = bisect.bisect_right(self.words, typed)
        return lo, bisect.bisect_left(self.words, typed + "\U0010ffff") if typed else self.n_words

    def to_bytes(self) -> bytes:
        """The model as a file: numpy .npz, deflated."""
        arrays = {"unigram": self.unigram,
                  "meta": np.frombuffer(json.dumps({"format": FORMAT, "vocab": self.vocab, "info": self.info})
                                        .encode(), np.uint8)}
        for k, lv in enumerate(self.levels, start=2):
            arrays |= {f"context{k}": lv.context, f"word{k}": lv.word, f"alpha{k}": lv.alpha, f"gamma{k}": lv.gamma}
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    def save(self, path: Path) -> int:
        """Write the model's file; its size in bytes."""
        data = self.to_bytes()
        atomic_write_bytes(path, data)
        return len(data)

    @classmethod
    def load(cls, path: Path) -> "NgramKeyboard":
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes())
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not an n-gram keyboard ({FORMAT})")
            levels, k = [], 2
            while f"word{k}" in z:
                levels.append(Level(z[f"context{k}"], z[f"word{k}"], z[f"alpha{k}"], z[f"gamma{k}"]))
                k += 1
            return cls(meta["vocab"], z["unigram"], levels, meta["info"])


def top_words(p: np.ndarray, n: int) -> np.ndarray:
    """The indices of the n largest values of p, largest first, ties by index (the alphabet, for a word range): every
    value tied with the n-th largest is looked at."""
    idx = np.flatnonzero(p >= np.partition(p, len(p) - n)[len(p) - n]) if len(p) > n else np.arange(len(p))
    return idx[np.lexsort((idx, -p[idx]))][:n]


def fit(counts: list[OrderCounts], vocab: list[str], order: int, max_bytes: int,
        info: dict | None = None) -> tuple[NgramKeyboard, int]:
    """(the order-`order` model with the lowest count threshold (for orders >= 2) whose file fits in max_bytes,
    its file's bytes)."""
    grams = [sum(int(np.sum(counts[k].count >= t)) for k in range(1, order)) for t in MIN_COUNTS]
    # skip thresholds that cannot fit at 2 bytes per n-gram (a deflated n-gram takes 2.5 to 4 here)
    start = next((i for i, g in enumerate(grams) if 2 * g <= max_bytes), len(MIN_COUNTS) - 1)
    for min_count in MIN_COUNTS[start:]:
        model = NgramKeyboard(vocab, *build_levels(counts, order, min_count, len(vocab) - 1),
                              dict(info or {}, order=order, min_count=min_count))
        size = len(model.to_bytes())
        if size <= max_bytes:
            return model, size
    raise ValueError(f"no order-{order} model fits in {max_bytes} bytes (the unigrams alone are too large)")


class CachedKeyboard:
    """The n-gram keyboard with a cache of the words already typed in the text, as phone keyboards learn the words
    their user types (a cache LM, Kuhn & De Mori 1990): score(w) = (1 - weight - f) P(w | h) + weight c(w) / C +
    f a(w) / A, c(w) the times w was typed before the word at the cursor, C all words typed there, a(w) the times it
    was typed right after the word and link before the cursor (the model's typed_followers: the last 200 lines), A
    their total, f = follow_weight (0 if A is 0); mid-word, the words that go on from the typed part. A typed word
    outside the vocabulary (a project's own identifier) is scored by the cache alone. Ties: the alphabet."""

    def __init__(self, model: NgramKeyboard, weight: float = CACHE_WEIGHT, follow_weight: float = FOLLOW_WEIGHT):
        if not (0 <= weight and 0 <= follow_weight and weight + follow_weight <= 1):
            raise ValueError(f"cache weights {weight} and {follow_weight}: each >= 0, their sum <= 1")
        self.model, self.weight, self.follow_weight = model, weight, follow_weight

    def suggest(self, text: str, n: int = 3) -> list[str]:
        context, typed = self.model.context_ids(text)
        before = text[: len(text) - len(typed)]
        seen, follows = Counter(WORD.findall(before)), typed_followers(before)  # the words typed before this one
        after_total = sum(follows.values())
        follow = self.follow_weight if after_total else 0.0
        lo, hi = self.model.word_range(typed)
        p = (1 - self.weight - follow) * self.model.distribution(context)[lo:hi]  # [hi - lo]
        scores = {self.model.words[lo + i]: float(p[i]) for i in top_words(p, n)}  # the cache adds to these, or its own
        total = sum(seen.values())
        for word, count in seen.items():
            if len(word) > len(typed) and word.startswith(typed):
                i = self.model.index.get(word, hi)
                scores[word] = ((float(p[i - lo]) if lo <= i < hi else 0.0) + self.weight * count / total
                                + follow * follows.get(word, 0) / (after_total or 1))
        return sorted(scores, key=lambda w: (-scores[w], w))[:n]

    def __call__(self, text: str) -> list[str]:
        return self.suggest(text)
