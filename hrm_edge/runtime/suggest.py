"""Next-word suggestions for a phone keyboard: the algorithm of docs/keyboard.md, in numpy.

The page (hrm_edge/app/web/js/suggest.mjs) and the Android core (WordSuggester.java) implement the same
specification; tests/test_keyboard.py checks that the three give identical words on a fixture model.

    context = TypedContext(OnnxStepModel("export/hrm.int8-static-perstep.kv.onnx"))
    suggest_words(context, tokenizer, "import o").words   # [Word(label="os", insert="s", ...), ...]

A step model is the *.kv.onnx graph's contract: run(tokens int64 [B, S], past_k, past_v [T, B, H, P, hd]) ->
(logits [B, S, V], present_k, present_v [T, B, H, P + S, hd]); empty_past() -> (k, v) [T, 1, H, 0, hd];
max_seq_len; slots (T). OnnxStepModel runs the graph; hrm_edge.model.eager.EagerStepModel runs a checkpoint.
The chains after the first token run on the draft model where there is one: the first outer cycle (the
*.branch.onnx graph beside the KV graph, whose rows share the context's cache, OnnxBranchModel; the *.draft.onnx
graph; EagerStepModel(model, n_cycles=1)), fed the first `slots` of the cache (draft_beside picks it).
"""
from __future__ import annotations

import re
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hrm_edge.runtime.decoders import OnnxBranchModel, OnnxStepModel
from hrm_edge.runtime.healing import byte_decoder

CANDIDATES = 4  # first tokens tried: 3, 4 and 6 within 0.6 points of top-3 on the calib split (2026-12-05)
MAX_EXTRA_TOKENS = 4  # greedy decode steps after the first token: a word must be seen to end within them
CONTEXT_TOKENS = 128  # the most context a suggestion reads: as accurate as 256 on held-out code, at half the cost
MAX_SPELLING_TOKENS = 3  # tokens after the first that may finish spelling the taken-back text (bounds a keystroke)
BRANCHES = 2  # where a chain's word has not started, it forks into this many chains (docs/keyboard.md step 6)
RECENT_CONTEXTS = 4  # earlier contexts whose logits and chains are kept, for a keystroke that goes back to one
HEAL_CHARS = 2  # token healing takes back tokens until it holds this many characters of the partial word
TYPED_SHARE = 0.1  # the words already typed: their share of a chip's score (step 11), chosen on the calib split
TYPED_LINES = 200  # the words already typed are read from the text's last this many lines (bounds a keystroke)
FOLLOW_SHARE = 0.25  # the typed words that followed the same word and link as the cursor's: their share (step 11)
SPACE_RUN = re.compile(r"[ \t\n\r\f\v]+")
WORD_RUN = re.compile(r"\w+")  # a word: Python's \w on str is is_word_char's class (checked on every code point)
BYTE_OF = byte_decoder()  # a byte-level BPE piece's character -> its byte (token healing)
KEEP_BACK_CHARS = 64  # KeptStartEncoder keeps the ids of a start of the text at least this far before its end
SPACES = " \t\n\r\f\v"
# training puts this token after every file, so before the next: the text typed is read as one file from its start
DOCUMENT_START = "<|eos|>"


@dataclass
class Word:
    label: str  # what the chip shows: the whole word
    insert: str  # what a tap inserts at the cursor
    probability: float
    ending: str = ""  # the text that followed the word in its extension (the evidence that the word ended)


@dataclass
class Suggestions:
    words: list[Word]
    ms: float


@dataclass
class Chain:
    """A first token and its greedy continuation: tokens [k], the probability of each under its step's softmax."""
    tokens: list[int]
    probs: list[float]
    cut_short: bool = False  # left open once the shown words no longer depended on it: computed again if asked for
    forks: list["Chain"] = field(default_factory=list)  # its copies that took the 2nd.. best token (step 6)
    forked: bool = False  # it has chosen a token where its word had not started (a chain forks once, a fork never)

    def family(self) -> list["Chain"]:
        return [self, *self.forks]


class KeptStartEncoder:
    """tokenizer.encode(text, add_special_tokens=False).ids for a text typed a key at a time, without encoding all of
    it at every keystroke (the page's keptStartEncoder, Java's WordSuggester.KeptStartEncoder): the ids of a start of
    the text that ends at a line break after a visible ASCII character do not depend on what follows (the ByteLevel
    pre-tokenizer's regex, which looks only forward, begins a new piece at that line break, and BPE and the added
    tokens stay within pieces), so the ids of the latest such start at least KEEP_BACK_CHARS before the end are kept
    and a keystroke encodes the rest. A text that does not go on from the kept start with its line break (an edit
    before it, or text typed where the line break was) starts over."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text, self.ids = "", []  # the kept start and its ids

    def __call__(self, text: str) -> list[int]:
        if not text.startswith(self.text) or text[len(self.text):len(self.text) + 1] not in ("", "\n"):
            self.text, self.ids = "", []
        cut = piece_start(text, len(text) - KEEP_BACK_CHARS)
        if cut > len(self.text):
            self.ids = self.ids + self.encode_all(text[len(self.text):cut])
            self.text = text[:cut]
        return self.ids + self.encode_all(text[len(self.text):])

    def encode_all(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def piece_start(text: str, at: int) -> int:
    """The last index i <= at where text[i] is a line break after a visible ASCII character; 0 if none."""
    for i in range(min(at, len(text) - 1), 0, -1):
        if text[i] == "\n" and " " < text[i - 1] < "\x7f":
            return i
    return 0


class TypedContext:
    """The KV cache of the text typed so far (a keystroke costs the changed tokens, not a prefill), and the greedy
    chains already computed from it (typing on inside a word often keeps the context and asks for them again)."""

    def __init__(self, step_model, draft_model=None):
        self.model = step_model
        self.draft = draft_model  # extends the chains: cycle 1, half a step's work (None: the full depth)
        self.ids: list[int] = []
        self.past_k, self.past_v = step_model.empty_past()
        self.logits = None  # [V] of the last position
        self.chains: dict[tuple, Chain] = {}  # (first token, text still to spell) -> its chain, for self.ids
        # (ids) -> (logits, chains) of earlier contexts that are shorter prefixes of self.ids, newest last: healing
        # takes back a token that typing had committed ("evaluatio" -> "evaluation"), and the keystroke after
        # goes back to the context of two keystrokes before, whose cache is the first positions of this one
        self.recent: dict[tuple, tuple] = {}
        self._texts, self._by_first = (None, []), {}
        self.encoder = None  # the KeptStartEncoder of the tokenizer last used

    def encode(self, tokenizer, text: str) -> list[int]:
        """The ids of `text` (no special tokens added), keeping those of its start from keystroke to keystroke."""
        if self.encoder is None or self.encoder.tokenizer is not tokenizer:
            self.encoder = KeptStartEncoder(tokenizer)
        return self.encoder(text)

    def update(self, ids: list[int]) -> np.ndarray:
        """Bring the cache to `ids`, reusing the longest common prefix; returns the last position's logits [V]."""
        common = 0
        while common < min(len(ids), len(self.ids)) and ids[common] == self.ids[common]:
            common += 1
        if common == len(ids) == len(self.ids) and self.logits is not None:
            return self.logits
        earlier = self.recent.pop(tuple(ids), None) if common == len(ids) else None
        if self.logits is not None:
            self.recent[tuple(self.ids)] = (self.logits, self.chains)
        if earlier is not None:  # back to a recent context: its cache is the first positions of this one
            self.past_k = np.ascontiguousarray(self.past_k[:, :, :, :len(ids)])
            self.past_v = np.ascontiguousarray(self.past_v[:, :, :, :len(ids)])
            self.ids, (self.logits, self.chains) = list(ids), earlier
        else:
            common = min(common, len(ids) - 1)  # the last token runs again to give its logits
            k, v = self.past_k[:, :, :, :common], self.past_v[:, :, :, :common]
            logits, self.past_k, self.past_v = self.model.run(np.array([ids[common:]], np.int64),
                                                              np.ascontiguousarray(k), np.ascontiguousarray(v))
            self.ids, self.logits, self.chains = list(ids), logits[0, -1], {}
        kept = [key for key in self.recent if len(key) < len(ids) and list(key) == self.ids[:len(key)]]
        self.recent = {key: self.recent[key] for key in kept[max(0, len(kept) - RECENT_CONTEXTS):]}
        return self.logits

    def token_texts(self, tokenizer, vocab: int) -> list[str]:
        """The decoded text of every token id < vocab ("" for special tokens), computed once per tokenizer."""
        if self._texts[0] is not tokenizer:
            self._texts = (tokenizer, tokenizer.decode_batch([[i] for i in range(vocab)]))
            self._by_first = {}  # first character -> the ids whose text starts with it, ascending
            for i, text in enumerate(self._texts[1]):
                self._by_first.setdefault(text[:1], []).append(i)
            self._by_first = {c: np.array(ids) for c, ids in self._by_first.items()}
        return self._texts[1]

    def tokens_starting(self, prefix: str) -> np.ndarray | None:
        """The ids that may fit `prefix` (those whose text starts with its first character); None: all."""
        return self._by_first.get(prefix[:1], np.zeros(0, np.int64)) if prefix else None


def document_start(tokenizer) -> list[int]:
    """Step 1: the id that goes before the text's (none where the tokenizer lacks it)."""
    start = tokenizer.token_to_id(DOCUMENT_START)
    return [start] if start is not None else []


def graphs_beside(kv_graph: Path) -> tuple[Path, Path] | None:
    """The branch and draft graphs exported beside a KV graph (hrm.X.kv.onnx: hrm.X.branch.onnx, hrm.X.draft.onnx),
    present or not; None for another file (a .ort one has neither)."""
    name = kv_graph.name
    if not name.endswith(".kv.onnx"):
        return None
    stem = name[: -len(".kv.onnx")]
    return kv_graph.with_name(stem + ".branch.onnx"), kv_graph.with_name(stem + ".draft.onnx")


def draft_beside(kv_graph: Path, threads: int = 0):
    """The model that extends the chains, from the graphs exported beside a KV graph (hrm.X.kv.onnx): its branch graph
    (hrm.X.branch.onnx, an OnnxBranchModel: the rows share the context's cache), else its draft graph (hrm.X.draft.onnx,
    an OnnxStepModel: the context's cache tiled per row); None if neither is there (a .ort file, an older export)."""
    beside = graphs_beside(kv_graph)
    if beside is None:
        return None
    branch, draft = beside
    if branch.is_file():
        return OnnxBranchModel(branch, threads)
    return OnnxStepModel(draft, threads) if draft.is_file() else None


def is_word_char(ch: str) -> bool:
    return ch == "_" or unicodedata.category(ch)[0] in "LN"


def is_spaces(text: str) -> bool:
    """Whether text is non-empty and only SPACES."""
    return text != "" and not text.strip(SPACES)


def has_word_char(text: str) -> bool:
    return any(is_word_char(ch) for ch in text)


def trailing_word(text: str) -> str:
    """The word characters at the end of `text` (the word being typed; "" after a space or a symbol)."""
    i = len(text)
    while i > 0 and is_word_char(text[i - 1]):
        i -= 1
    return text[i:]


def typed_window(text: str) -> int:
    """Where the words already typed are read from: after the text's TYPED_LINES-th last line break (0 if fewer)."""
    start = len(text)
    for _ in range(TYPED_LINES):
        start = text.rfind("\n", 0, start) if start > 0 else -1
        if start < 0:
            break
    return start + 1


def typed_words(text: str) -> dict[str, tuple[int, str]]:
    """{word: (times it occurs, the character after its last occurrence)} in the text's window (typed_window), in
    order of first occurrence. `text` ends before the word being typed."""
    seen: dict[str, tuple[int, str]] = {}
    for m in WORD_RUN.finditer(text, typed_window(text)):
        seen[m.group()] = (seen.get(m.group(), (0, ""))[0] + 1, text[m.end():m.end() + 1])
    return seen


def link(between: str) -> str:
    """The symbols between two words, each run of spaces as one " " (one "\\n" if it holds a line break)."""
    return SPACE_RUN.sub(lambda m: "\n" if "\n" in m.group() else " ", between)


def typed_followers(text: str) -> dict[str, int]:
    """{word: times it was typed right after the word and link that end `text`} in the text's window (its first
    word: after "" and the link from the window's start): after `self.` the attributes typed after `self.` before."""
    start = end = typed_window(text)
    before, pairs = "", []
    for m in WORD_RUN.finditer(text, start):
        pairs.append((before, link(text[end:m.start()]), m.group()))
        before, end = m.group(), m.end()
    now, seen = (before, link(text[end:])), {}
    for word_before, between, word in pairs:
        if (word_before, between) == now:
            seen[word] = seen.get(word, 0) + 1
    return seen


def with_typed_words(words: list[Word], text: str, partial: str, n: int) -> list[Word]:
    """Step 11: the model's words (its n best) and the words already typed that go on from the partial word, each
    scored (1 - TYPED_SHARE - f) p + TYPED_SHARE c / C + f a / A (p: the model's probability, 0 for a word it did not
    show; c: the word's occurrences among the C words typed; a: those right after the word and link before the
    cursor, among A; f: FOLLOW_SHARE, 0 if A is 0); the n best, ties in that order (the model's, then by first
    occurrence). A chip inserts what the larger of its two parts inserts: the model's word, or the typed word
    (typed_insert; its ending: what followed it). A counts every follower, whether it goes on from the partial word
    or not."""
    before = text[: len(text) - len(partial)]
    seen, follows = typed_words(before), typed_followers(before)
    total, after_total = sum(count for count, _ in seen.values()), sum(follows.values())
    follow_share = FOLLOW_SHARE if after_total else 0.0
    keep = 1 - TYPED_SHARE - follow_share
    out = {w.label: Word(w.label, w.insert, keep * w.probability, w.ending) for w in words}
    for word, (count, after) in seen.items():
        if len(word) > len(partial) and word.startswith(partial):
            share = TYPED_SHARE * count / total + (follow_share * follows[word] / after_total if word in follows else 0)
            known = out.setdefault(word, Word(word, "", 0.0))
            if share > known.probability:  # a tap inserts what the larger part of the score inserts (as in step 9)
                known.insert, known.ending = typed_insert(word, partial, text, words), after
            known.probability += share
    return sorted(out.values(), key=lambda w: -w.probability)[:n]  # stable


def typed_insert(word: str, partial: str, text: str, model_words: list[Word]) -> str:
    """What a tap on a typed word inserts: the rest of it; at a word start after a symbol (`x =`, `):`) first the
    spaces the model's chip of that word, else its first chip, puts before its word (` y`, `\n    return`)."""
    if partial or not text or text[-1] in SPACES:
        return word[len(partial):]
    same = next((w for w in model_words if w.label == word), model_words[0] if model_words else None)
    return (same.insert[: len(same.insert) - len(same.label)] if same else "") + word


def read_word(continuation: str, mid_word: bool):
    """What a continuation of the typed text says: None while the word may go on (open), "" when no word can
    come out of it (dead), else (insert, word, ending)."""
    c = continuation.rstrip("\ufffd")  # a trailing U+FFFD is a character whose bytes are still coming
    i = 0
    if not mid_word:
        while i < len(c) and c[i] in SPACES:
            i += 1
    j = i
    while j < len(c) and is_word_char(c[j]):
        j += 1
    if j == len(c):
        return None
    if j == i:
        return ""
    return c[:j], c[i:j], c[j:]


def context_window(ids: list[int], max_seq_len: int) -> list[int]:
    """The end of a long text: when the ids do not leave room for the extension within CONTEXT_TOKENS, whole
    blocks of a quarter of that are dropped from the start (so the window, and its cache, stays the same for
    many keys). Within max_seq_len a chain's tokens always fit: up to 1 + MAX_SPELLING_TOKENS + MAX_EXTRA_TOKENS
    of them (the last never run) after a context at least one id shorter than the window."""
    span = min(max_seq_len, CONTEXT_TOKENS)
    limit = min(span - MAX_EXTRA_TOKENS, max_seq_len - MAX_SPELLING_TOKENS - MAX_EXTRA_TOKENS + 1)
    if len(ids) <= limit:
        return ids
    block = span // 4
    return ids[-(-(len(ids) - limit) // block) * block:]


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits.astype(np.float64) - float(logits.max()))
    return z / z.sum()


def healed_start(tokenizer, ids: list[int], partial: str) -> int:
    """Token healing: the index of the first id taken back. The last id, and earlier ones until the taken-back
    text holds HEAL_CHARS characters of the partial word (a context ending in a 1-character piece of a word is one
    the model rarely saw), earlier ones while both it and the token before are whitespace, and earlier ones while it
    would start inside a character; at least one id stays."""
    j = len(ids) - 1
    while j > 1 and len(tokenizer.decode(ids[j:])) < min(len(partial), HEAL_CHARS):
        j -= 1
    # a run of whitespace at the end is taken back whole: "\n\n    " typed is "\n" "\n    ", a split training never
    # shows before a word ("\n\n    def" is "\n\n   " " def"), and after "\n" alone the model expects the file's end
    if is_spaces(tokenizer.decode(ids[j:])):  # (whitespace tokens are ASCII: their texts join as their bytes do)
        while j > 1 and is_spaces(tokenizer.decode(ids[j - 1:j])):
            j -= 1
    while j > 1 and inside_a_character(tokenizer, ids[j]):  # its text would start with U+FFFD, which any bytes match
        j -= 1
    return j


def inside_a_character(tokenizer, token: int) -> bool:
    """Whether the token's bytes start with a UTF-8 continuation byte (0x80-0xBF): a character begun by the token
    before it."""
    piece = tokenizer.id_to_token(token)
    return bool(piece) and 0x80 <= BYTE_OF.get(piece[0], 0) <= 0xBF


def healed(tokenizer, text: str, ids: list[int]) -> tuple[str, int, str]:
    """(partial word, cut, prefix) of the text before the cursor and its window's ids: token healing takes back
    the last token, and earlier ones until HEAL_CHARS characters of the partial word; the chains spell the
    taken-back text `prefix` = decode(ids[cut:]) again."""
    partial = trailing_word(text)
    cut = healed_start(tokenizer, ids, partial) if len(ids) > 1 else len(ids)
    return partial, cut, tokenizer.decode(ids[cut:])


def prefix_probability(p: np.ndarray, texts: list[str], prefix: str, ids=None) -> float:
    """Step 11's Z: the probability that the next token fits the taken-back text (its non-empty text starts with
    `prefix` or is a proper prefix of it), summed in id order over `ids` (all if None); 1 with no taken-back text."""
    if not prefix:
        return 1.0
    z = 0.0
    for t in range(len(texts)) if ids is None else ids:
        if texts[t] and (texts[t].startswith(prefix) or prefix.startswith(texts[t])):
            z += float(p[t])  # one by one, in id order, as the page and Java add them
    return z


def first_tokens(logits: np.ndarray, texts: list[str], prefix: str, count: int = CANDIDATES,
                 pool: np.ndarray | None = None, mid_word: bool | None = None) -> list[int]:
    """The `count` highest-logit tokens whose text starts with `prefix`; in the slots left, the highest-logit
    tokens whose text is a (non-empty) proper prefix of it (the following tokens then spell the rest); ties: lower
    id. At a word start (mid_word False) both kinds rank together by logit. mid_word (True/False): skip the covering
    tokens from which no word can come (read_word is dead: `" ="` where a word should start). pool: the ascending ids
    to look at (all if None), a speed-up only."""
    covering, shorter = [], []
    order = np.argsort(-logits, kind="stable") if pool is None else pool[np.argsort(-logits[pool], kind="stable")]
    for t in order:
        text = texts[t]
        if text and text.startswith(prefix):
            if mid_word is not None and read_word(text[len(prefix):], mid_word) == "":
                continue
            covering.append(int(t))
            if len(covering) == count:
                break
        elif text and len(shorter) < count and prefix.startswith(text):
            shorter.append(int(t))
    if mid_word is False:  # a word start: "\n       " " self" spells "\n        self" (docs/keyboard.md step 5)
        return sorted(covering + shorter, key=lambda t: (-logits[t], t))[:count]
    return (covering + shorter)[:count]


def word_tokens(logits: np.ndarray, texts: list[str], c: str, mid_word: bool, count: int) -> list[int]:
    """The `count` highest-logit tokens (ties: lower id) after which a word can still come from a chain whose text
    past the taken-back one is c (no word character in it yet): read_word(c + text) is not dead."""
    out = []
    for t in np.argsort(-logits, kind="stable"):
        if texts[t] and read_word(c + texts[t], mid_word) != "":
            out.append(int(t))
            if len(out) == count:
                break
    return out


def decide(tokens: list[int], probs: list[float], tokenizer, texts: list[str], prefix: str, mid_word: bool):
    """None while the word of a chain's tokens is open, "" if no word comes out (dead), else
    (insert, word, ending, probability)."""
    if not texts[tokens[-1]]:
        return ""  # a special token (end of text): no word follows
    text = tokenizer.decode(tokens)
    if len(text) < len(prefix) and prefix.startswith(text):
        return None  # still spelling the taken-back text
    if not text.startswith(prefix):
        return ""
    read = read_word(text[len(prefix):], mid_word)
    if not read:
        return read
    insert, word, ending = read
    end = len(prefix) + len(insert)
    probability = probs[0]
    for i in range(1, len(tokens)):  # the tokens that spell part of the word (not those of the ending alone)
        if len(whole_characters(tokenizer, tokens[:i])) >= end:
            break
        probability *= probs[i]
    return insert, word, ending, probability


def whole_characters(tokenizer, tokens: list[int]) -> str:
    """The text of tokens without trailing U+FFFD: only the characters they complete (the bytes of the last one may
    still be coming: its U+FFFD would count as a character already spelled)."""
    return tokenizer.decode(tokens).rstrip("\ufffd")


def first_decision(chain: Chain, decide_tokens):
    """decide() on the chain's shortest prefix that decides; None if the whole chain is still open."""
    for k in range(1, len(chain.tokens) + 1):
        found = decide_tokens(chain.tokens[:k], chain.probs[:k])
        if found is not None:
            return found
    return None


def batch_runner(model, context_k: np.ndarray, context_v: np.ndarray, rows: int):
    """(run(tokens [B, S], past_k, past_v) -> (logits, present_k, present_v), the rows' first pasts) for `rows` branches
    of the context whose cache (its slots the model reads) is context_k, context_v [T', 1, H, P, hd]: a branch graph
    reads that cache once for all rows and the pasts are the rows' own (none yet); another step model gets it tiled."""
    if isinstance(model, OnnxBranchModel):
        return (lambda tokens, k, v: model.run(tokens, context_k, context_v, k, v)), *model.empty_rows(rows)
    return model.run, np.repeat(context_k, rows, axis=1), np.repeat(context_v, rows, axis=1)


def extend(context: TypedContext, chains: list[Chain], still_open, next_tokens, settled) -> None:
    """Grow every chain whose word is still open by greedy tokens (next_tokens(chain, logits [V]) -> ids: one, or
    several where it forks, each fork a new chain in chain.forks), all of them as one batch per decode step, until
    each has ended or is out of budget (still_open false), or until settled(open chains) says no end of them can
    change the words shown (those are then cut short)."""
    rows = [chain for chain in chains if still_open(chain)]  # the chain of each batch row
    if not rows or cut_short(rows, settled):
        return
    model = context.draft or context.model
    run, past_k, past_v = batch_runner(model, context.past_k[: model.slots], context.past_v[: model.slots], len(rows))
    while True:
        tokens = np.array([[chain.tokens[-1]] for chain in rows], np.int64)  # [B, 1]
        logits, past_k, past_v = run(tokens, past_k, past_v)
        grown, parents = [], []  # the chains after this step (forks after their chain), the row each came from
        for b, chain in enumerate(rows):
            row = logits[b, 0].astype(np.float64)
            tokens, probs = list(chain.tokens), list(chain.probs)  # before this step
            for k, t in enumerate(next_tokens(chain, row)):
                target = chain
                if k > 0:  # a fork: a copy of the chain that takes the k-th token instead
                    target = Chain(list(tokens), list(probs), forked=True)
                    chain.forks.append(target)
                target.tokens.append(t)
                target.probs.append(float(1.0 / np.exp(row - row[t]).sum()))
                grown.append(target)
                parents.append(b)
        keep = [j for j, chain in enumerate(grown) if still_open(chain)]
        if not keep or cut_short([grown[j] for j in keep], settled):
            return
        pick = [parents[j] for j in keep]
        if pick != list(range(len(rows))):  # rows left or forked: their pasts follow
            past_k, past_v = np.ascontiguousarray(past_k[:, pick]), np.ascontiguousarray(past_v[:, pick])
        rows = [grown[j] for j in keep]


def cut_short(open_chains: list[Chain], settled) -> bool:
    """Marks the open chains cut short and returns True if settled(open_chains) (no end of them changes the words
    shown)."""
    if not settled(open_chains):
        return False
    for chain in open_chains:
        chain.cut_short = True
    return True


def reach(chain: Chain, tokenizer, prefix: str, partial: str) -> tuple[str, float]:
    """(start, bound) of an open chain: the label of any word it may still end in starts with `start` (its text past
    the taken-back one, c, without leading spaces, after the partial word; "" while it still spells the taken-back
    text), with a probability of at most bound, the product over its tokens that spell part of c (they count in the
    word's product, step 8; a later token's probability is at most 1)."""
    text = tokenizer.decode(chain.tokens)
    c = text[len(prefix):].rstrip("\ufffd") if len(text) >= len(prefix) else ""
    end = len(prefix) + len(c)
    bound = chain.probs[0]
    for i in range(1, len(chain.tokens)):
        if len(whole_characters(tokenizer, chain.tokens[:i])) >= end:
            break
        bound *= chain.probs[i]
    return partial + c.lstrip(SPACES), bound


def words_settled(words: list[Word], reaches: list[tuple[str, float]], n: int) -> bool:
    """Whether the first n of `words` (the decided chains' words, merged, in candidate order) stay the words shown,
    in the same order with the same probabilities and inserts, however the open chains (reaches: their (start, bound))
    end: n words are there, no open chain can end in one of them (its probability would grow), and the n-th one is
    more likely than the next one and every open chain together could be (a word that grows into a new one or joins
    a lower one)."""
    ranked = sorted(words, key=lambda w: -w.probability)
    if len(ranked) < n or any(w.label.startswith(start) for w in ranked[:n] for start, _ in reaches):
        return False
    spare = sum(bound for _, bound in reaches) + (ranked[n].probability if len(ranked) > n else 0.0)
    return ranked[n - 1].probability > spare * (1 + 1e-9)  # margin: float sums in another order


def stale(chain: Chain, decide_tokens) -> bool:
    """Whether a chain computed for an earlier keystroke is computed again: it or a fork was cut short, or is too
    short to decide."""
    return any(member.cut_short or (first_decision(member, decide_tokens) is None
                                    and len(member.tokens) <= MAX_EXTRA_TOKENS) for member in chain.family())


def merge(chains: list[Chain], decide_tokens, partial: str) -> list[Word]:
    """The words of the decided chains, in candidate order (each chain, then its forks); chains with the same label
    are one word, their probabilities added up, inserting what the most probable of them inserts (step 9)."""
    merged: dict[str, Word] = {}
    best: dict[str, float] = {}  # label -> the probability of its most probable chain
    for chain in [member for chain in chains for member in chain.family()]:
        found = first_decision(chain, decide_tokens)
        if not found:
            continue  # open, dead, or no word ended within MAX_EXTRA_TOKENS
        insert, word, ending, probability = found
        label = partial + word if partial else word
        if label not in merged:
            merged[label], best[label] = Word(label, insert, probability, ending), probability
            continue
        merged[label].probability += probability
        if probability > best[label]:
            merged[label].insert, merged[label].ending, best[label] = insert, ending, probability
    return list(merged.values())


def suggest_words(context: TypedContext, tokenizer, text: str, n: int = 3) -> Suggestions:
    """The n most likely whole next words after `text` (the text before the cursor); see docs/keyboard.md.
    tokenizer: a tokenizers.Tokenizer (hrm_edge.train.tokenizer.load_tokenizer)."""
    start = time.perf_counter()
    ids = context_window(document_start(tokenizer) + context.encode(tokenizer, text), context.model.max_seq_len)
    if not ids:
        return Suggestions([], 0.0)
    partial, cut, prefix = healed(tokenizer, text, ids)
    logits = context.update(ids[:cut])
    texts = context.token_texts(tokenizer, len(logits))
    p = softmax64(logits)

    def decide_tokens(tokens, probs):
        return decide(tokens, probs, tokenizer, texts, prefix, partial != "")

    def next_tokens(chain, row):  # greedy; where the word has not started, viable tokens, and the chain forks once
        spelled = tokenizer.decode(chain.tokens)
        if len(spelled) < len(prefix):  # among the tokens that fit the taken-back text still unspelled
            rest = prefix[len(spelled):]
            return (first_tokens(row, texts, rest, 1, context.tokens_starting(rest)) or [int(np.argmax(row))])[:1]
        c = spelled[len(prefix):].rstrip("\ufffd")
        if has_word_char(c):
            return [int(np.argmax(row))]
        count, chain.forked = 1 if chain.forked else BRANCHES, True
        return word_tokens(row, texts, c, partial != "", count) or [int(np.argmax(row))]

    chains, fresh = [], []
    for t in first_tokens(logits, texts, prefix, CANDIDATES, context.tokens_starting(prefix), partial != ""):
        # a chain depends on its first token, the text it must spell and whether its word has started (where it forks)
        key = (t, prefix[len(texts[t]):], has_word_char(texts[t][len(prefix):]))
        chain = context.chains.get(key)
        if chain is None or stale(chain, decide_tokens):
            chain = context.chains[key] = Chain([t], [float(p[t])])  # not computed yet, or too short to decide
            fresh.append(chain)
        chains.append(chain)

    def still_open(chain):  # MAX_EXTRA_TOKENS after the token that completes the taken-back text
        spelling = next(k for k in range(1, len(chain.tokens) + 1)
                        if k == len(chain.tokens) or len(tokenizer.decode(chain.tokens[:k])) >= len(prefix))
        if len(chain.tokens) > MAX_SPELLING_TOKENS and len(tokenizer.decode(chain.tokens)) < len(prefix):
            return False  # not spelled within MAX_SPELLING_TOKENS after the first: dropped
        return len(chain.tokens) - spelling < MAX_EXTRA_TOKENS and decide_tokens(chain.tokens, chain.probs) is None

    def settled(open_chains):  # the words shown can no longer change: stop extending (docs/keyboard.md step 6)
        reaches = [reach(chain, tokenizer, prefix, partial) for chain in open_chains]
        return words_settled(merge(chains, decide_tokens, partial), reaches, n)

    extend(context, fresh, still_open, next_tokens, settled)
    words = sorted(merge(chains, decide_tokens, partial), key=lambda w: -w.probability)[:n]  # stable: ties keep order
    if not partial and words:  # at a word start: the model's chance of each word given the typed text (step 11)
        z = prefix_probability(p, texts, prefix, context.tokens_starting(prefix))
        words = [Word(w.label, w.insert, w.probability / z, w.ending) for w in words] if z > 0 else words
    return Suggestions(with_typed_words(words, text, partial, n), (time.perf_counter() - start) * 1000)


def read_typed_word(context: TypedContext, tokenizer, text: str, following: str):
    """A diagnosis of a missed word: the text the user typed next (`following`: the word and at least one character
    after it) in its own tokens, read as a chain of suggest_words would be (docs/keyboard.md steps 7-8): (insert,
    word, ending, probability), "" (dead) or None (still open, or the tokens of text + following do not start with
    the context's). A word whose probability beats the bar's last chip, or that had a free slot, was missed by the
    search (first tokens, greedy chains), not ranked below the chips by the model."""
    start = document_start(tokenizer)
    encoded = start + context.encode(tokenizer, text)  # the ids suggest_words read for this text
    ids = context_window(encoded, context.model.max_seq_len)
    if not ids:
        return None
    partial, cut, prefix = healed(tokenizer, text, ids)
    typed = (start + tokenizer.encode(text + following, add_special_tokens=False).ids)[len(encoded) - len(ids):]
    rest = typed[cut:context.model.max_seq_len]
    if typed[:cut] != ids[:cut] or not rest:
        return None
    logits = context.update(ids[:cut])
    texts = context.token_texts(tokenizer, len(logits))
    model = context.draft or context.model  # the model that extends chains
    after, _, _ = model.run(np.array([rest], np.int64), context.past_k[: model.slots], context.past_v[: model.slots])
    rows = [logits] + list(after[0, :-1])  # the logits each token of rest is drawn from
    chain = Chain(rest, [float(softmax64(row)[t]) for row, t in zip(rows, rest)])
    return first_decision(chain, lambda tokens, probs: decide(tokens, probs, tokenizer, texts, prefix, partial != ""))


def keyboard_metrics(text: str, chips: list[list]) -> dict:
    """chips[i]: the words shown after typing text[:i], each [label, insert, probability, ending] (or an object
    with those attributes). top3_word_accuracy: at word starts (a word character after a non-word one), the share
    where a chip inserts exactly the next word. keystroke_savings: 1 - keys / characters when a typist taps a chip
    whenever one inserts the text's next characters up to the end of a word (the longest such chip), else types one
    character. partial_chips: chips that are not a whole word (must be 0)."""
    def fields(w):
        return w if isinstance(w, (list, tuple)) else [w.label, w.insert, w.probability, w.ending]

    def word_end(i):
        while i < len(text) and is_word_char(text[i]):
            i += 1
        return i

    starts = [i for i in range(1, len(text)) if is_word_char(text[i]) and not is_word_char(text[i - 1])]
    hits = sum(any(fields(w)[1] == text[i:word_end(i)] for w in chips[i]) for i in starts)
    pos = keys = 0
    while pos < len(text):
        taps = [len(ins) for _, ins, _, _ in map(fields, chips[pos]) if ins and text.startswith(ins, pos)
                and (pos + len(ins) == len(text) or not is_word_char(text[pos + len(ins)]))]
        pos += max(taps, default=1)
        keys += 1
    partial = [w for ws in chips for w in map(fields, ws)
               if not (w[0] and all(map(is_word_char, w[0])) and w[3] and not is_word_char(w[3][0]))]
    return {"characters": len(text), "word_starts": len(starts), "top3_word_accuracy": hits / max(len(starts), 1),
            "keystroke_savings": 1 - keys / max(len(text), 1), "partial_chips": len(partial)}
