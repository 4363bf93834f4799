"""Next-word suggestions (docs/keyboard.md): hrm_edge.runtime.suggest on a fixture model, and the same words from
the page's suggest.mjs (under node) and the Android core's WordSuggester.java.

The fixture's logits are integer arithmetic on (token ids, position), so Python, JS and Java compute bit-identical
floats and must agree on every chip (probabilities within 1e-9 relative: softmax sums in a different order)."""
import json
import os
import random
import shutil
import subprocess
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from test_adaptive import onnx_model
from test_android_core import classes, java, typed_code  # noqa: F401  (classes: the compiled Java core, a fixture)
from test_demo import DemoServer
from test_model import make
from hrm_edge.app.demo import WEB_DIR, web_packages
from hrm_edge.app.keyboard import (PROFILE_PARTS, BenchSettings, browser_keyboard_bench, call_costs, combined_metrics,
                                   heldout_text, profile_parts, renderer_memory, runs_of, time_split)
from hrm_edge.app.shared_weights import page_form
from hrm_edge.errors import UserError
from hrm_edge.export.onnx import export_onnx_branch, export_onnx_draft
from hrm_edge.model.checkpoint import load_model
from hrm_edge.model.eager import EagerStepModel
from hrm_edge.model.lm import BranchForm, DraftForm
from hrm_edge.runtime import suggest
from hrm_edge.runtime.decoders import OnnxBranchModel, OnnxStepModel
from hrm_edge.runtime.suggest import (BRANCHES, CANDIDATES, FOLLOW_SHARE, MAX_EXTRA_TOKENS, TYPED_LINES, TYPED_SHARE,
                                      Chain, TypedContext, Word, batch_runner, context_window, decide, document_start,
                                      draft_beside, first_decision, first_tokens, healed, healed_start, is_word_char,
                                      keyboard_metrics, link, merge, prefix_probability, read_typed_word, read_word,
                                      softmax64, suggest_words, trailing_word, typed_followers, typed_words,
                                      with_typed_words, words_settled)
from hrm_edge.train.tokenizer import load_tokenizer

TOKENIZER = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
M32 = 0xFFFFFFFF
FIXTURE_MAX_SEQ_LEN = 40  # small, so the long sequence below crosses the context window
DRAFT_SEED = 0x2468ACE0  # the draft fixture's hash seed: other logits over the same past
LONG = ("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = make_parser()\n    args = parser.parse_args(argv)\n"
        "    for name in sorted(args.names):\n        print(name, os.path.getsize(name))\n    return 0\n")
# (text before typing, typed one character at a time): each keystroke is one suggestion call on one cache
SESSIONS = [("import o", "s.pa"), ("import os\ndef ", "get_na"), ("class Foo(", "obj"), ("x = 1\n", "ret"),
            ("", "for i in ra"), ("print(", "self.v"), (LONG, "    re"), ("a = [1, 2]\n# ", "café é"),
            ("from .", "astutils import valid_sym"), ("x = 1\nfr", "obnicate_xq"),  # partial words of 2+ tokens
            ("a " * 35, "expected"),  # a window near FIXTURE_MAX_SEQ_LEN whose longest chains must still fit
            ("s = '", "añ 𝑥y 中文 naï"),  # characters of several byte tokens; one outside the BMP
            ("zq_1 = 1\n" + "x\n" * 199, "zq"),  # zq_1 is one line before the typed words' window (step 11)
            ("qq qq qq qq qq qq qq qq\nqq", "(qq) ="),  # a typed word after a symbol takes a model chip's spaces
            ("qq qq\r\nqq", "qq:\r\n"),  # ... not after a space: after its "\r" the typed qq inserts "qq", not " qq"
            ("a  =  b\na = c\na =\td\na =\n    e\n", "a = "),  # followers: b c d after "a" " = " (a link), not e
            ("old\n" + "new\n" * 198 + "old\n", "ne")]  # the window starts after "old\n": its first word follows ""


def mix(x):
    """lowbias32 on a Python int or a uint32 array (wrapping uint32 arithmetic)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32 if isinstance(x, int) else x * np.uint32(0x7FEB352D)
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32 if isinstance(x, int) else x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


class HashStepModel:
    """The step-model contract with hash logits: logit[v] = (mix(h ^ v * 0x85ebca6b) >> 24) / 16 for allowed ids,
    -16 for the others, h a hash of the ids so far and the position, started at `seed` (a draft fixture: another
    seed). past_k [1, B, 1, P, 1] holds the ids, so a wrongly sliced, tiled or selected cache changes the logits.
    Same function: keyboard_fixture.mjs, HashStepModel.java."""

    def __init__(self, allowed: list[int], vocab: int, max_seq_len: int = FIXTURE_MAX_SEQ_LEN, seed: int = 0x12345678):
        self.allowed = np.zeros(vocab, bool)
        self.allowed[allowed] = True
        self.salts = np.arange(vocab, dtype=np.uint32) * np.uint32(0x85EBCA6B)
        self.max_seq_len, self.calls, self.seed, self.slots = max_seq_len, [], seed, 1

    def empty_past(self):
        return np.zeros((1, 1, 1, 0, 1), np.float32), np.zeros((1, 1, 1, 0, 1), np.float32)

    def run(self, tokens, past_k, past_v):
        (batch, seq), past = tokens.shape, past_k.shape[3]
        assert past_k.shape[1] == batch and np.array_equal(past_k, past_v) and past + seq <= self.max_seq_len
        self.calls.append((batch, seq))
        ids = np.concatenate([past_k[0, :, 0, :, 0].astype(np.int64), tokens], axis=1)  # [B, P + S]
        logits = np.zeros((batch, seq, len(self.allowed)), np.float32)
        for b in range(batch):
            h = self.seed
            for i, t in enumerate(ids[b].tolist()):
                h = mix(h ^ ((t * 0x9E3779B1 + i) & M32))
                if i >= past:
                    logits[b, i - past] = np.where(self.allowed, (mix(np.uint32(h) ^ self.salts) >> 24) / 16, -16)
        present = ids.astype(np.float32)[None, :, None, :, None]
        return logits, present, present.copy()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def printable_ids(tokenizer) -> list[int]:
    """Token ids whose text is printable ASCII (or tab / newline): decoding never meets a broken UTF-8 sequence,
    where each language's decoder may place U+FFFD differently."""
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())])
    return [i for i, t in enumerate(texts) if t and all(c in "\t\n" or " " <= c <= "~" for c in t)]


@pytest.fixture(scope="module")
def allowed(tokenizer) -> list[int]:
    return printable_ids(tokenizer)


def typed(start: str, keys: str) -> list[str]:
    """The text after each key (a key "\\b" takes the last character back, as a backspace does)."""
    texts = [start]
    for key in keys:
        texts.append(texts[-1][:-1] if key == "\b" else texts[-1] + key)
    return texts


def code_sessions(seed: int, count: int = 14) -> list[tuple[str, str]]:
    """Typing sessions cut from the standard library's modules (random places, seeded): a context of up to 750
    characters, then 10-40 keys of the text that follows, some sessions with CRLF line ends, tabs for indents,
    non-ASCII characters among the keys (one outside the BMP) or backspaces."""
    rng, stdlib = random.Random(seed), Path(sysconfig.get_paths()["stdlib"])
    modules = [p for p in sorted(stdlib.glob("*.py")) if p.stat().st_size > 4000]
    out = []
    for _ in range(count):
        text = rng.choice(modules).read_text(encoding="utf-8", errors="replace")
        at = rng.randrange(0, len(text) - 2000)
        start, keys = text[at + rng.randrange(750, 1500):at + 1500], text[at + 1500:at + 1500 + rng.randrange(10, 40)]
        variant = rng.randrange(4)
        if variant == 1:
            start, keys = start.replace("\n", "\r\n"), keys.replace("\n", "\r\n")
        elif variant == 2:
            start, keys = start.replace("    ", "\t"), keys.replace("    ", "\t")
        elif variant == 3:
            keys = keys[:5] + "é中𝑥ß" + keys[5:]
        if rng.random() < 0.5:
            keys = "".join(k + "\b" * rng.randrange(1, 4) if rng.random() < 0.15 else k for k in keys)
        out.append((start, keys))
    return out


def python_words(tokenizer, allowed, draft_calls: list | None = None, model_calls: list | None = None,
                 sessions: list = SESSIONS) -> list:
    """The words at every keystroke of the sessions, the chains extended by the draft fixture (as the page does);
    draft_calls / model_calls, if given, receive each of the draft's / the model's calls (batch, seq)."""
    out = []
    for start, keys in sessions:
        vocab = tokenizer.get_vocab_size()
        model, draft = HashStepModel(allowed, vocab), HashStepModel(allowed, vocab, seed=DRAFT_SEED)
        context = TypedContext(model, draft)
        out.append([[[w.label, w.insert, w.probability, w.ending] for w in suggest_words(context, tokenizer, text).words]
                    for text in typed(start, keys)])
        if draft_calls is not None:
            draft_calls += draft.calls
        if model_calls is not None:
            model_calls += model.calls
    return out


# ---- the algorithm, in Python ----
def test_read_word():
    assert read_word("ort os", True) == ("ort", "ort", " os")  # mid-word: completes the typed word
    assert read_word("ort", True) is None  # open: the word may go on
    assert read_word(" os", True) == ""  # the typed word was already complete: no completion
    assert read_word("  os(", False) == ("  os", "os", "(")  # after a space: the next word, leading spaces inserted
    assert read_word("   ", False) is None and read_word("", False) is None
    assert read_word("(x", False) == ""  # a symbol where the word should be
    assert read_word("caf\ufffd", True) is None  # the bytes of a character are still coming
    assert read_word("é\ufffd(", True) == ("é", "é", "\ufffd(")  # a U+FFFD inside the text is a character
    assert trailing_word("x = foo_1") == "foo_1" and trailing_word("x = ") == "" and trailing_word("") == ""
    assert is_word_char("é") and is_word_char("_") and is_word_char("²") and not is_word_char("-")


def test_keyboard_metrics():
    text = "a foo bar"  # word starts at 2 and 6
    chips = [[] for _ in text]
    chips[2] = [["foo", "foo", 0.5, " "]]  # the next word: a hit, and a tap for 3 characters
    chips[6] = [["baz", "baz", 0.1, " "]]
    chips[7] = [["bar", "r", 0.1, "x"]]  # would not end the text's word "bar" there; a partial word (ending "x")
    m = keyboard_metrics(text, chips)
    assert m["word_starts"] == 2 and m["top3_word_accuracy"] == 0.5 and m["partial_chips"] == 1
    assert m["keystroke_savings"] == pytest.approx(1 - 7 / 9)  # 6 characters typed + 1 tap


def test_context_window_drops_whole_blocks():
    ids = list(range(100))
    assert context_window(ids[:58], 64) == ids[:58]
    # 64 - MAX_SPELLING_TOKENS - MAX_EXTRA_TOKENS + 1 = 58 at most (the longest chain's tokens fit in 64); a block is
    # 16 ids: 59..74 ids drop 16, 75..90 drop 32
    assert context_window(ids[:59], 64) == ids[16:59] and context_window(ids[:74], 64) == ids[16:74]
    assert context_window(ids[:75], 64) == ids[32:75]
    # a longer context is read up to CONTEXT_TOKENS (128): limit 124, blocks of 32
    assert context_window(ids, 256) == ids[:100] and context_window(list(range(200)), 256) == list(range(96, 200))


def test_only_whole_words_ranked_by_probability(tokenizer, allowed):
    sessions, n_words, multi_token = python_words(tokenizer, allowed), 0, 0
    for (start, keys), steps in zip(SESSIONS, sessions):
        for text, words in zip(typed(start, keys), steps):
            partial = trailing_word(text)
            probs = [p for _, _, p, _ in words]
            assert probs == sorted(probs, reverse=True) and len({w[0] for w in words}) == len(words)
            for label, insert, p, ending in words:
                n_words += 1
                assert label and all(is_word_char(c) for c in label), (text, label)
                assert ending and not is_word_char(ending[0]), (text, label, ending)  # the word ended
                if partial:
                    assert label == partial + insert
                else:
                    assert insert.endswith(label) and not insert[: -len(label)].strip(" \t\n\r\f\v")
                multi_token += len(tokenizer.encode(insert, add_special_tokens=False).ids) > 1
    assert n_words > 40 and multi_token > 3, (n_words, multi_token)  # the fixture exercises real cases


def test_batched_steps_and_reused_chains(tokenizer, allowed):
    model = HashStepModel(allowed, tokenizer.get_vocab_size())
    context = TypedContext(model)
    first = suggest_words(context, tokenizer, "import os\ndef get")
    # one context run, then at most MAX_EXTRA_TOKENS one-token steps with every open chain (and fork) in the batch
    assert model.calls[0] == (1, 1 + len(tokenizer.encode("import os\ndef", add_special_tokens=False).ids))
    # (a first token shorter than " get" spends steps spelling the rest before its MAX_EXTRA_TOKENS)
    assert 1 <= len(model.calls) - 1 <= MAX_EXTRA_TOKENS + len(" get") - 1
    assert all(s == 1 and b <= CANDIDATES * BRANCHES for b, s in model.calls[1:])
    model.calls.clear()
    again = suggest_words(context, tokenizer, "import os\ndef get")
    assert model.calls == [] and again.words == first.words  # same context: cache and chains reused
    # the same chains without reuse (a fresh context) give the same words
    assert suggest_words(TypedContext(model), tokenizer, "import os\ndef get").words == first.words


def test_a_context_gone_back_to_is_not_run_again(tokenizer, allowed):
    vocab = tokenizer.get_vocab_size()
    texts = ["import os\ndef g", "import os\ndef ge", "import os\ndef get"]
    contexts = [tuple(ids[:healed(tokenizer, t, ids)[1]]) for t in texts
                for ids in [document_start(tokenizer) + tokenizer.encode(t, add_special_tokens=False).ids]]
    assert contexts[2] == contexts[0] and len(contexts[1]) > len(contexts[0])  # healing takes back " ge"'s token
    model, draft = HashStepModel(allowed, vocab), HashStepModel(allowed, vocab, seed=DRAFT_SEED)
    context = TypedContext(model, draft)
    for text in texts[:2]:
        suggest_words(context, tokenizer, text)
    model.calls.clear()
    words = suggest_words(context, tokenizer, texts[2]).words
    assert model.calls == [] and context.ids == list(contexts[2])  # its logits and chains were kept
    fresh = TypedContext(HashStepModel(allowed, vocab), HashStepModel(allowed, vocab, seed=DRAFT_SEED))
    assert words == suggest_words(fresh, tokenizer, texts[2]).words  # the cache cut back right
    assert not context.recent  # the longer context is not kept: its cache is cut off


def test_the_draft_model_extends_the_chains(tokenizer, allowed):
    """With a draft model the context runs on the model and every extension step on the draft, fed the past's first
    `slots` (here the draft reads the same ids through another hash, so its words differ)."""
    vocab = tokenizer.get_vocab_size()
    model, draft = HashStepModel(allowed, vocab), HashStepModel(allowed, vocab, seed=DRAFT_SEED)
    texts = ("import os\ndef get", "x = ", "print(se", "class Foo(")
    drafted = [TypedContext(model, draft) for _ in texts]
    drafted_words = [suggest_words(c, tokenizer, t).words for c, t in zip(drafted, texts)]
    assert len(model.calls) == len(texts) and all(b == 1 for b, _ in model.calls)  # the context runs only
    assert draft.calls and all(s == 1 and b <= CANDIDATES * BRANCHES for b, s in draft.calls)
    plain = [TypedContext(model) for _ in texts]
    assert [suggest_words(c, tokenizer, t).words for c, t in zip(plain, texts)] != drafted_words
    for a, b in zip(drafted, plain):  # the first tokens (candidates) are the model's, the rest the draft's
        assert a.chains.keys() == b.chains.keys()
        assert [c.probs[0] for c in a.chains.values()] == [c.probs[0] for c in b.chains.values()]
    assert any(x.tokens[1:] != y.tokens[1:] for a, b in zip(drafted, plain)
               for x, y in zip(a.chains.values(), b.chains.values()))


def test_a_partial_word_of_several_tokens_is_healed(tokenizer, allowed):
    """Token healing takes back tokens until it holds HEAL_CHARS characters of the word being typed; first tokens
    that are a proper prefix of the taken-back text (when fewer than CANDIDATES start with it) spell the rest."""
    model = HashStepModel(allowed, tokenizer.get_vocab_size())
    context, text = TypedContext(model), "x = 1\nfrob"
    ids = document_start(tokenizer) + tokenizer.encode(text, add_special_tokens=False).ids  # ... "\n" "f" "ro" "b"
    cut = healed_start(tokenizer, ids, "frob")
    assert cut == len(ids) - 2 and tokenizer.decode(ids[cut:]) == "rob"  # "b" alone holds 1 character
    words = suggest_words(context, tokenizer, text).words
    assert model.calls[0] == (1, cut) and context.ids == ids[:cut]
    assert words and all(w.label.startswith("frob") for w in words), words
    spelled = [tokenizer.decode(c.tokens) for (_, rest, _), c in context.chains.items() if rest]  # shorter first token
    assert spelled and all(d.startswith("rob") or "rob".startswith(d) for d in spelled), spelled
    assert any(d.startswith("rob") for d in spelled), spelled  # spelled the rest, then went on
    shorter = document_start(tokenizer) + tokenizer.encode("x = 1\nfr", add_special_tokens=False).ids
    assert healed_start(tokenizer, shorter, "fr") == cut - 1


def test_a_run_of_whitespace_is_taken_back_whole(tokenizer):
    """Step 3: typed, a blank line and an indent are the tokens "\n" "\n    " (training shows "\n\n   " " def"):
    healing takes back the whole run, and no more; mid-word, nothing changes."""
    def ids(text):
        return document_start(tokenizer) + tokenizer.encode(text, add_special_tokens=False).ids

    typed = ids("class A:\n    def f(self):\n        return data\n\n    ")
    assert [tokenizer.decode([i]) for i in typed[-3:]] == [" data", "\n", "\n    "]
    assert healed_start(tokenizer, typed, "") == len(typed) - 2
    one = ids("x = 1\n    ")  # a single whitespace token: only it
    assert tokenizer.decode(one[-1:]) == "\n    " and healed_start(tokenizer, one, "") == len(one) - 1
    word = ids("x = 1\n\n    frob")  # mid-word: the word's tokens only, not the run before them
    cut = healed_start(tokenizer, word, "frob")
    assert "frob".endswith(tokenizer.decode(word[cut:]).strip()) and "\n" not in tokenizer.decode(word[cut:])


def test_first_tokens_at_a_word_start_rank_the_shorter_ones_with_the_rest(tokenizer):
    """docs/keyboard.md step 5. "\n        self" is the tokens "\n       " " self": after a typed "\n        " the
    first token that the text is spelled with is a proper prefix of the taken-back text. Put after the tokens that
    start with it, the chip `self` came from "\n           " " self" and inserted 4 spaces too many."""
    assert [tokenizer.decode([i]) for i in tokenizer.encode("x\n        self").ids][1:] == ["\n       ", " self"]
    texts = ["\n        ", "\n           ", "\n       ", "\n", "\n            ", "ab", "abc", "a", "abd"]
    logits = np.array([1, 2, 5, 3, 0, 1, 2, 4, 2], np.float32)  # ties (2, 2): the lower id first
    assert first_tokens(logits, texts, "\n        ", 3, mid_word=False) == [2, 3, 1]
    assert first_tokens(logits, texts, "ab", 3, mid_word=True) == [6, 8, 5]  # mid-word: the covering ones first
    assert first_tokens(logits, texts, "ab", 4, mid_word=True) == [6, 8, 5, 7]


def test_the_words_already_typed_join_the_models():
    """Step 11: score (1 - TYPED_SHARE - f) p + TYPED_SHARE c / C + f a / A; a chip inserts what its larger part
    inserts; the words are read after the TYPED_LINES-th last line break; ties: the model's order, then first
    occurrence."""
    assert typed_words("a b\nc a(\n  d_1 = a\n") == {"a": (3, "\n"), "b": (1, "\n"), "c": (1, " "), "d_1": (1, " ")}
    assert TYPED_LINES == 200 and "old" not in typed_words("old\n" + "x\n" * 199)
    assert typed_words("old\n" + "x\n" * 198)["old"] == (1, "\n")
    model = [Word("if", "    if", 0.5, " "), Word("self", "self", 0.05, ".")]
    text = "self.a = 1\nself.b(x)\nx "  # typed before: self 2, a 1, 1 1 (a number is a word), b 1, x 2 (C = 7)
    words = with_typed_words(model, text, "", 3)
    share = TYPED_SHARE / 7
    # self: the model's part 0.045 is larger than the typed 0.029: its insert and ending (".", not "(")
    assert [(w.label, w.insert, w.ending) for w in words] == [("if", "    if", " "), ("self", "self", "."),
                                                               ("x", "x", " ")]
    assert words[0].probability == (1 - TYPED_SHARE) * 0.5
    assert words[1].probability == (1 - TYPED_SHARE) * 0.05 + TYPED_SHARE * 2 / 7 and words[2].probability == 2 * share
    # mid-word: the typed words that go on from the partial word (not the partial word itself)
    assert [(w.label, w.insert) for w in with_typed_words([], "self.a = 1\nse", "se", 3)] == [("self", "lf")]
    assert with_typed_words([], "self.a = 1\nself", "self", 3) == []
    cut = with_typed_words([Word("if", "    if", 0.01, " ")], "if x:\n    ", "", 3)  # the typed "if" is larger
    assert [(w.label, w.insert, w.ending) for w in cut][:1] == [("if", "if", " ")]  # after spaces: the word alone
    # after a symbol, a typed word takes the spaces of the model's chip of that word, else of its first chip
    after = with_typed_words([Word("None", "\tNone", 0.01, "\n"), Word("y", " y", 0.001, "\n")], "y = z\nx =", "", 3)
    assert [(w.label, w.insert) for w in after] == [("y", " y"), ("z", "\tz"), ("x", "\tx")]  # 0.034, 0.033, 0.033
    nothing = with_typed_words([], "y = z\nx(", "", 3)
    assert [(w.label, w.insert) for w in nothing] == [("y", "y"), ("z", "z"), ("x", "x")]
    # the words typed right after the word and link before the cursor (self and "."), their share FOLLOW_SHARE
    assert link(" \t=  \n    ") == " =\n" and link("):\r\n\t") == "):\n"
    text = "self.a = 1\nself.b = 2\nself.a\nx = self."  # self 4, a 2, 1 1, b 1, 2 1, x 1 (C = 10)
    assert typed_followers(text) == {"a": 2, "b": 1}  # after "self" "." (A = 3)
    # the window (after the TYPED_LINES-th last line break): its first word follows "", not the word before it
    assert typed_followers("old\n" + "new\n" * 198 + "old\n") == {}
    assert typed_followers("old\n" + "new\n" * 197 + "old\n") == {"new": 1}  # 199 line breaks: all in the window
    words = with_typed_words([Word("y", "y", 0.5, " ")], text, "", 3)
    assert [w.label for w in words] == ["y", "a", "b"]
    assert words[0].probability == (1 - TYPED_SHARE - FOLLOW_SHARE) * 0.5
    assert words[1].probability == TYPED_SHARE * 2 / 10 + FOLLOW_SHARE * 2 / 3


def test_the_context_starts_a_document(tokenizer, allowed):
    """Step 1: the ids start with <|eos|>, which training puts after every file: an empty text gets the words a file
    starts with, and the first token can be healed; a window that drops the text's start drops it too."""
    eos = tokenizer.token_to_id("<|eos|>")
    assert document_start(tokenizer) == [eos]
    model = HashStepModel(allowed, tokenizer.get_vocab_size())
    context = TypedContext(model)
    empty = suggest_words(context, tokenizer, "").words
    assert model.calls[0] == (1, 1) and context.ids == [eos] and len(empty) == 3
    suggest_words(context, tokenizer, "im")  # one token, taken back: the chains spell it after <|eos|> alone
    assert context.ids == [eos]
    text = "import os\n" * 60
    suggest_words(context, tokenizer, text)
    ids = context_window([eos] + tokenizer.encode(text, add_special_tokens=False).ids, model.max_seq_len)
    assert eos not in ids and context.ids == ids[:len(context.ids)] and len(context.ids) >= len(ids) - 2


def test_at_a_word_start_the_models_words_are_given_the_typed_text(tokenizer, allowed, monkeypatch):
    """Step 11: at a word start the model's probabilities are divided by Z, the probability that the next token fits
    the taken-back text (its non-empty text starts with it or is a proper prefix of it); mid-word they are kept."""
    texts, p = ["", " a", " ", "a", " ab", "x", " b"], np.array([0.1, 0.2, 0.3, 0.1, 0.1, 0.1, 0.1])
    assert prefix_probability(p, texts, " a") == 0.2 + 0.3 + 0.1 and prefix_probability(p, texts, "") == 1
    assert prefix_probability(p, texts, " a", [1, 2]) == 0.2 + 0.3  # only the ids given (those of its first character)
    monkeypatch.setattr(suggest, "with_typed_words", lambda words, *args: words)  # the model's words alone

    def words(text, z=None):  # z: what prefix_probability gives (a function), else the code's own
        with monkeypatch.context() as patch:
            if z is not None:
                patch.setattr(suggest, "prefix_probability", z)
            context = TypedContext(HashStepModel(allowed, tokenizer.get_vocab_size()))
            return context, suggest_words(context, tokenizer, text).words

    text = "import os\ndef "
    context, given = words(text)
    ids = document_start(tokenizer) + tokenizer.encode(text, add_special_tokens=False).ids
    partial, cut, prefix = healed(tokenizer, text, ids)
    row = softmax64(context.update(ids[:cut]))
    vocab = context.token_texts(tokenizer, len(row))
    z = sum(row[t] for t, s in enumerate(vocab) if s and (s.startswith(prefix) or prefix.startswith(s)))
    joint = words(text, lambda *args: 1.0)[1]
    assert partial == "" and z < 0.9 and len(given) == 3 and [w.label for w in given] == [w.label for w in joint]
    for w, j in zip(given, joint):  # the word start: divided by z
        assert w.probability == pytest.approx(j.probability / z, rel=1e-12)

    def never(*args):
        raise AssertionError("mid-word the model's probabilities are kept")

    assert len(words("x = 1\nfr", never)[1]) == 3  # mid-word: no division


def test_shipped_checkpoint_suggests_self_at_the_lines_indentation(tokenizer):
    """Held-out httpcore, where the chip `self` inserted "    self" (docs/keyboard.md step 5): a tap types the word."""
    model = load_model(REPO / "hrm_edge" / "default_model")
    text = ("class Connection:\n    def __init__(self, origin, stream):\n        self._origin = origin\n"
            "        self._network_stream = stream\n        ")
    words = suggest_words(TypedContext(EagerStepModel(model), EagerStepModel(model, n_cycles=1)), tokenizer, text).words
    assert (words[0].label, words[0].insert) == ("self", "self") and words[0].probability > 0.1, words


def test_healing_never_takes_back_part_of_a_character(tokenizer):
    """A character of several byte tokens is taken back whole: a taken-back text starting with U+FFFD would be
    spelled by any bytes, and the chips would show a character the model did not write. HEAL_CHARS counts code
    points (a letter outside the BMP is one, as in the page's and Java's healing)."""
    for text, want in (("x = ñ", "ñ"), ("x = 中文", "文"), ("x = naï", "aï"), ("s = 𝑥y", "𝑥y")):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        partial, cut, prefix = healed(tokenizer, text, ids)
        assert prefix == want and tokenizer.decode(ids[:cut]) + prefix == text, (text, prefix)
    every = list(range(tokenizer.get_vocab_size()))  # the fixture may write any token, byte pieces included
    for text in ("x = ñ", "x = 中文", "x = naï", "# café é"):
        words = suggest_words(TypedContext(HashStepModel(every, len(every))), tokenizer, text).words
        assert all("\ufffd" not in w.label and w.label.startswith(trailing_word(text)) for w in words), (text, words)


def test_a_words_probability_counts_the_bytes_of_its_last_character(tokenizer):
    """Step 8: the tokens that finish the word's last character count, though the text before them already looks
    as long as the word (its U+FFFD)."""
    ids = [tokenizer.token_to_id(piece) for piece in ("Ġa", "Ã", "±", "(")]  # " a", then "ñ" as two bytes, "("
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())])
    insert, word, ending, p = decide(ids, [0.5, 0.1, 0.2, 0.3], tokenizer, texts, "", False)
    assert (insert, word, ending) == (" añ", "añ", "(") and p == pytest.approx(0.5 * 0.1 * 0.2, rel=1e-12)


def test_a_typed_word_reads_like_the_chain_that_spells_it(tokenizer, allowed):
    """read_typed_word (the diagnosis of a missed word) gives a chip's own reading when the chip's chain is the
    tokenization of the typed text, and reads any other continuation by the same rules."""
    model, same = HashStepModel(allowed, tokenizer.get_vocab_size()), 0
    for text in ("import o", "x = ", "def f(", "import os\ndef ", "print(se"):
        context = TypedContext(model)
        words = suggest_words(context, tokenizer, text).words
        ids = context_window(tokenizer.encode(text, add_special_tokens=False).ids, model.max_seq_len)
        partial, cut, prefix = healed(tokenizer, text, ids)
        texts = context.token_texts(tokenizer, tokenizer.get_vocab_size())
        for chain in list(context.chains.values()):
            found = first_decision(chain, lambda t, p: decide(t, p, tokenizer, texts, prefix, partial != ""))
            if not found or found[0] not in [w.insert for w in words]:
                continue
            following = tokenizer.decode(chain.tokens)[len(prefix):]
            if tokenizer.encode(text + following, add_special_tokens=False).ids[cut:] != chain.tokens:
                continue  # the typed text would be other tokens
            read = read_typed_word(context, tokenizer, text, following)
            assert read[:3] == found[:3] and read[3] == pytest.approx(found[3], rel=1e-9), (text, read, found)
            same += 1
        assert suggest_words(context, tokenizer, text).words == words  # the diagnosis leaves the cache usable
    assert same >= 3, same
    context = TypedContext(model)
    insert, word, ending, p = read_typed_word(context, tokenizer, "import os\n", "frobnicate(x)")
    assert (insert, word, ending[:1]) == ("frobnicate", "frobnicate", "(") and 0 < p < 1e-3
    assert read_typed_word(context, tokenizer, "import os\n", "(x)") == ""  # a symbol where a word should be
    assert read_typed_word(context, tokenizer, "import os\n", "frob") is None  # not seen to end


def test_a_word_not_ended_within_the_budget_is_dropped(tokenizer, allowed, monkeypatch):
    """With no extra tokens allowed, a word comes only from a first token that holds its own ending (" os(")."""
    texts = set(tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())]))
    model = HashStepModel(allowed, tokenizer.get_vocab_size())
    monkeypatch.setattr(suggest, "with_typed_words", lambda words, *args: words)  # the model's words alone
    with_budget = [suggest_words(TypedContext(model), tokenizer, t).words for t in ("import o", "x = ", "def f(")]
    monkeypatch.setattr(suggest, "MAX_EXTRA_TOKENS", 0)
    model.calls.clear()
    found = 0
    for text, wider in zip(("import o", "x = ", "def f("), with_budget):
        prefix = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids[-1:])
        words = suggest_words(TypedContext(model), tokenizer, text).words
        assert all(prefix + w.insert + w.ending in texts for w in words), (text, words)  # one token each
        found += len(words) < len(wider) or words != wider
    assert all(b == 1 for b, _ in model.calls) and found  # no extension steps ran; the budget mattered


def test_spelling_the_taken_back_text_is_bounded(tokenizer, allowed, monkeypatch):
    """A chain must finish spelling the taken-back text within MAX_SPELLING_TOKENS tokens after its first, or it is
    dropped: with none allowed, the shorter first tokens are never extended and the words come from those that
    cover it."""
    monkeypatch.setattr(suggest, "MAX_SPELLING_TOKENS", 0)
    context = TypedContext(HashStepModel(allowed, tokenizer.get_vocab_size()))
    words = suggest_words(context, tokenizer, "x = 1\nfrob").words  # taken back: "rob"
    shorter = [c for (_, rest, _), c in context.chains.items() if rest]
    assert shorter and all(len(c.tokens) == 1 for c in shorter), shorter
    assert all(w.label.startswith("frob") for w in words), words


def test_a_chain_whose_word_has_not_started_forks_once(tokenizer, allowed):
    """Where a chain's text past the taken-back one has no word character yet (after a newline or a typed-out
    token), the next token picks the word: the chain takes the best token after which a word can still come and
    BRANCHES - 1 copies (forks) take the next ones; a fork never forks, a chain only once."""
    forks = 0
    for text in ("import os\n", "x = 1\n\n", "def f(x):\n    return x\n", "print(se", "a = b"):
        context = TypedContext(HashStepModel(allowed, tokenizer.get_vocab_size()))
        suggest_words(context, tokenizer, text)
        prefix = healed(tokenizer, text, tokenizer.encode(text, add_special_tokens=False).ids)[2]
        for chain in context.chains.values():
            assert len(chain.family()) <= BRANCHES and all(not f.forks and f.forked for f in chain.forks)
            for fork in chain.forks:
                k = next(i for i, (a, b) in enumerate(zip(chain.tokens, fork.tokens)) if a != b)  # where they part
                assert fork.tokens[:k] == chain.tokens[:k] and fork.probs[:k] == chain.probs[:k]
                c = tokenizer.decode(chain.tokens[:k])[len(prefix):]
                assert not any(is_word_char(ch) for ch in c), (text, c)  # no word started before the fork
                forks += 1
    assert forks >= 3, forks  # the fixture forks


def test_chains_cut_short_never_change_the_words(tokenizer, allowed, monkeypatch):
    """Step 6's early stop (once no end of the open chains can change the words shown) saves decode steps and
    changes nothing: the same words, order and probabilities, bit for bit, as extending every chain to its end."""
    cut, full = [], []
    words = python_words(tokenizer, allowed, cut)
    monkeypatch.setattr(suggest, "words_settled", lambda *_: False)
    assert python_words(tokenizer, allowed, full) == words
    assert sum(b for b, _ in cut) < sum(b for b, _ in full) and len(cut) < len(full), (cut, full)


def test_words_settled():
    # typed "o": the reaches are (start of the label an open chain may still end in, its bound)
    words = [Word("os", "s", 0.5), Word("open", "pen", 0.3), Word("or", "r", 0.1), Word("ord", "rd", 0.05)]
    assert words_settled(words, [("oab", 0.04)], 3)  # 0.1 > 0.05 + 0.04
    assert not words_settled(words, [("oab", 0.04), ("oxy", 0.02)], 3)  # together they could pass "or"
    assert not words_settled(words, [("op", 0.001)], 3)  # it may still end as "open", which would grow
    assert not words_settled(words, [("o", 0.001)], 3)  # still spelling the typed text: it may end as any word
    assert words_settled(words, [("ord", 0.01)], 3)  # it may only join "ord", which stays below "or"
    assert not words_settled(words[:2], [("oab", 1e-6)], 3)  # a free place on the bar
    assert words_settled(words[:3], [("oab", 0.099)], 3) and not words_settled(words[:3], [("oab", 0.1)], 3)
    # at a word start a chain of spaces and "b" may still end in "be" with other spaces before it: the same chip
    starts = [Word("be", "\n    be", 0.5), Word("is", " is", 0.3), Word("as", " as", 0.1)]
    assert not words_settled(starts, [("b", 0.001)], 3) and words_settled(starts, [("c", 0.001)], 3)


def test_chains_with_the_same_word_are_one_chip(tokenizer):
    """Chains that end in the same word after other spaces are one chip: their probabilities add up and a tap
    inserts what the most probable of them inserts (step 9)."""
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())])
    ids = {s: tokenizer.encode(s, add_special_tokens=False).ids for s in ("\n be(", "\n    be(", "\n is(")}
    chains = [Chain(ids["\n be("], [0.1] * 9), Chain(ids["\n    be("], [0.5] * 9), Chain(ids["\n is("], [0.3] * 9)]

    def decide_tokens(tokens, probs):
        return decide(tokens, probs, tokenizer, texts, "\n", False)

    alone = [decide_tokens(c.tokens, c.probs)[3] for c in chains]
    words = merge(chains, decide_tokens, "")
    assert [(w.label, w.insert) for w in words] == [("be", "    be"), ("is", " is")], words
    assert words[0].probability == pytest.approx(alone[0] + alone[1]) and alone[1] > alone[0]


# ---- the same words from JS (node) and Java ----
def page_modules(tmp_path) -> str:
    """node's path, with the page's js/ folder, keyboard_fixture.mjs and a node_modules of the page's pinned packages
    in tmp_path."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not found (apt-get install nodejs npm)")
    shutil.copytree(WEB_DIR / "js", tmp_path / "js")
    shutil.copyfile(REPO / "tests" / "keyboard_fixture.mjs", tmp_path / "keyboard_fixture.mjs")
    (tmp_path / "node_modules").symlink_to(web_packages(log=lambda *_: None))
    return node


def node_words(tokenizer, allowed, tmp_path, lookahead: bool = False, call_off_at: int | None = None,
               sessions: list = SESSIONS) -> list:
    """The page's words at every keystroke of the sessions (keyboard_fixture.mjs); with the lookahead, its work ahead
    called off at every other key at a graph call that varies, or with call_off_at at every key at that call."""
    node = page_modules(tmp_path)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"tokenizer": str(TOKENIZER), "vocab": tokenizer.get_vocab_size(), "allowed": allowed,
                               "max_seq_len": FIXTURE_MAX_SEQ_LEN, "draft_seed": DRAFT_SEED, "lookahead": lookahead,
                               "callOffAt": call_off_at,
                               "sequences": [typed(start, keys) for start, keys in sessions]}))
    proc = subprocess.run([node, str(tmp_path / "keyboard_fixture.mjs"), str(job)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_same_words(got: list, want: list, who: str, sessions: list = SESSIONS):
    for (start, keys), got_steps, want_steps in zip(sessions, got, want, strict=True):
        for text, g, w in zip(typed(start, keys), got_steps, want_steps, strict=True):
            assert [x[:2] + x[3:] for x in g] == [x[:2] + x[3:] for x in w], (who, text, g, w)
            for x, y in zip(g, w):
                assert abs(x[2] - y[2]) <= 1e-9 * abs(y[2]), (who, text, x, y)


def test_javascript_gives_the_same_words(tokenizer, allowed, tmp_path):
    draft_calls, model_calls = [], []
    want = python_words(tokenizer, allowed, draft_calls, model_calls)
    sessions = node_words(tokenizer, allowed, tmp_path)
    assert_same_words([[step["words"] for step in steps] for steps in sessions], want, "suggest.mjs")
    # the page's tokenizer kept the start of the long text and encoded its end only, to the same ids
    assert all(step["sameIds"] for steps in sessions for step in steps)
    assert max(step["keptChars"] for steps in sessions for step in steps) > 0
    # the same batches: the same chains cut short at the same step (the words would be the same either way), and
    # the same context runs (none where a keystroke goes back to a recent context)
    assert [tuple(c) for steps in sessions for step in steps for c in step["draftCalls"]] == draft_calls
    assert [tuple(c) for steps in sessions for step in steps for c in step["calls"]] == model_calls



def test_the_page_lookahead_gives_the_same_words(tokenizer, allowed, tmp_path):
    """The page's lookahead (lookahead.mjs) typing the same sessions, computing ahead after each key the chips of
    the key that comes and of a wrong one, on forks of the typed context, and called off in the middle at every other
    key: the same words as Python at every keystroke; a key computed ahead makes no graph call. Then called off at
    every key at its k-th graph call, for each k from 1 to 7: the same words (at k = 5 a chain of the called-off
    extension that spelled the taken-back text in 2 tokens and is open after 3 more is reused by the next key: unless
    it is marked cut short, it is read as dropped instead of grown)."""
    want = python_words(tokenizer, allowed)
    sessions = node_words(tokenizer, allowed, tmp_path, lookahead=True)
    assert_same_words([[step["words"] for step in steps] for steps in sessions], want, "lookahead.mjs")
    steps = [step for steps in sessions for step in steps]
    ahead = [step for step in steps if step["ahead"]]
    assert len(ahead) > len(steps) // 4, (len(ahead), len(steps))  # the keys whose work ahead ran to its end
    assert all(not step["calls"] and not step["draftCalls"] for step in ahead)
    for k in range(1, 8):
        sessions = node_words(tokenizer, allowed, tmp_path / f"k{k}", lookahead=True, call_off_at=k)
        assert_same_words([[step["words"] for step in steps] for steps in sessions], want,
                          f"lookahead.mjs called off at graph call {k}")


ENCODE_JOB = """import { readFileSync } from "node:fs";
import { Tokenizer } from "@huggingface/tokenizers";
globalThis.location = { search: "" }; // model.mjs reads the page's URL
const { keptStartEncoder } = await import("./js/model.mjs");
const [tokenizerPath, textsPath] = process.argv.slice(2);
const hf = new Tokenizer(JSON.parse(readFileSync(tokenizerPath, "utf8")), { clean_up_tokenization_spaces: false });
const encodeAll = (text) => hf.encode(text, { add_special_tokens: false }).ids;
let encoded = 0, same = 0;
const encode = keptStartEncoder((text) => { encoded += text.length; return encodeAll(text); });
const texts = JSON.parse(readFileSync(textsPath, "utf8"));
for (const text of texts) same += JSON.stringify(encode(text)) === JSON.stringify(encodeAll(text));
console.log(JSON.stringify({ same, encoded }));
"""


def test_the_page_encodes_the_end_of_a_typed_text(tmp_path):
    """The page's tokenizer (keptStartEncoder, model.mjs) typing code a key at a time, deleting and typing again:
    encodeAll's ids at every keystroke, while it encodes a small part of the text."""
    node = page_modules(tmp_path)
    _, typed = typed_code(1500, 199)
    (tmp_path / "texts.json").write_text(json.dumps(typed))
    (tmp_path / "encode.mjs").write_text(ENCODE_JOB)
    proc = subprocess.run([node, str(tmp_path / "encode.mjs"), str(TOKENIZER), str(tmp_path / "texts.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["same"] == len(typed)
    assert out["encoded"] < 0.15 * sum(len(t) for t in typed)  # not the whole text at every keystroke


def test_python_encodes_the_end_of_a_typed_text(tokenizer, allowed):
    """TypedContext.encode (KeptStartEncoder, the page's keptStartEncoder): code typed a key at a time, deleted and
    edited gives the ids of encoding each whole text, while it keeps a start of the text."""
    code, typed = typed_code(1500, 199)
    context, kept = TypedContext(HashStepModel(allowed, tokenizer.get_vocab_size())), []
    for text in typed:
        assert context.encode(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False).ids, text[-60:]
        kept.append(len(context.encoder.text))
    assert max(kept) > len(code) - 200  # it kept most of the text (and its ids were right after the edit too)


def java_words(tokenizer, allowed, classes, tmp_path, lookahead: bool = False, call_off_at: int | None = None,
               sessions: list = SESSIONS) -> dict:
    """The Android core's words at every keystroke of the sessions (CoreCli suggest): WordSuggester's, or with the
    lookahead typed as keyboard_fixture.mjs types them through the page's."""
    job = tmp_path / f"job-{lookahead}-{call_off_at}.json"
    job.write_text(json.dumps({"vocab": tokenizer.get_vocab_size(), "allowed": allowed,
                               "max_seq_len": FIXTURE_MAX_SEQ_LEN, "draft_seed": DRAFT_SEED,
                               "lookahead": lookahead, "call_off_at": call_off_at,
                               "sequences": [typed(start, keys) for start, keys in sessions]}))
    proc = java(classes, "org.hrmedge.core.CoreCli", "suggest", TOKENIZER, job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_java_gives_the_same_words(tokenizer, allowed, classes, tmp_path, monkeypatch):
    out = java_words(tokenizer, allowed, classes, tmp_path)
    model_calls = []
    assert_same_words(out["sequences"], python_words(tokenizer, allowed, model_calls=model_calls), "WordSuggester.java")
    assert out["model_calls"] == len(model_calls)  # the same context runs (none back to a recent context)
    # Java runs the chains one after another, a call per row and step: fewer calls than the rows of the batches
    # that extend every chain to its end means chains were cut short there too
    monkeypatch.setattr(suggest, "words_settled", lambda *_: False)
    full = []
    python_words(tokenizer, allowed, full)
    assert 0 < out["draft_calls"] < sum(b for b, _ in full), (out["draft_calls"], full)


def test_the_three_languages_agree_on_sessions_cut_from_real_code(tokenizer, allowed, classes, tmp_path):
    """Beside SESSIONS' chosen cases, 14 sessions cut from the standard library at random places (seeded): CRLF line
    ends, tabs, non-ASCII keys and backspaces, in contexts of up to 750 characters; Python, the page and Java give
    the same chips at every keystroke, and the page's kept-start encoder the same ids."""
    sessions = code_sessions(seed=7)
    assert any("\r\n" in start for start, _ in sessions) and any("\b" in keys for _, keys in sessions)
    want = python_words(tokenizer, allowed, sessions=sessions)
    page = node_words(tokenizer, allowed, tmp_path, sessions=sessions)
    assert_same_words([[step["words"] for step in steps] for steps in page], want, "suggest.mjs", sessions)
    assert all(step["sameIds"] for steps in page for step in steps)
    android = java_words(tokenizer, allowed, classes, tmp_path, sessions=sessions)
    assert_same_words(android["sequences"], want, "WordSuggester.java", sessions)


def test_the_android_lookahead_gives_the_same_words(tokenizer, allowed, classes, tmp_path):
    """The Android core's Lookahead typing the sessions as the page's test does (the work ahead guessing the key
    that comes and a wrong one, called off at a graph call that varies at every other key), on its one cache: the
    same words as Python at every keystroke, and a key computed ahead makes no model call. Then called off at every
    key at its k-th call, for each k from 1 to 7: the same words (the chains of an extension called off are marked
    cut short, or a reused one open after 5 tokens is read as dropped)."""
    want = python_words(tokenizer, allowed)
    out = java_words(tokenizer, allowed, classes, tmp_path, lookahead=True)
    assert_same_words(out["sequences"], want, "Lookahead.java")
    ahead = [calls for flags, key_calls in zip(out["ahead"], out["key_calls"], strict=True)
             for flag, calls in zip(flags, key_calls, strict=True) if flag]
    assert len(ahead) > sum(map(len, out["ahead"])) // 4, (len(ahead), out["ahead"])
    assert ahead == [0] * len(ahead)
    for k in range(1, 8):
        out = java_words(tokenizer, allowed, classes, tmp_path, lookahead=True, call_off_at=k)
        assert_same_words(out["sequences"], want, f"Lookahead.java called off at call {k}")


def test_java_and_the_page_guess_the_same_next_keys(tokenizer, allowed, classes, tmp_path):
    """likelyKeys (the keys the lookahead computes ahead) in Java and the page's JS: the same 3 keys after every
    keystroke of the sessions, where the chips' first characters and where the tokens' summed probability give them."""
    java_keys = java_words(tokenizer, allowed, classes, tmp_path)["likely"]
    page_keys = [[step["likely"] for step in steps] for steps in node_words(tokenizer, allowed, tmp_path / "node")]
    assert java_keys == page_keys
    keys = [k for steps in java_keys for k in steps]
    assert sum(len(k) == 3 for k in keys) > len(keys) // 2 and [] in keys  # mostly 3; none where nothing goes on
    # and some keys came from the tokens (fewer than 3 different first characters among the chips)
    words = python_words(tokenizer, allowed)
    firsts = [len({w[1][0] for w in step if w[1]}) for steps in words for step in steps]
    assert any(f < len(k) for f, k in zip(firsts, keys)), (firsts, keys)


# ---- the eager step model (a checkpoint behind the KV graph's contract) ----
def test_eager_step_model_batches_like_separate_rows():
    model = make()
    step = EagerStepModel(model)
    prompt = np.array([[5, 17, 3, 44, 9]])
    logits, k, v = step.run(prompt, *step.empty_past())
    with torch.no_grad():
        full = model(torch.from_numpy(prompt)).numpy()
    np.testing.assert_allclose(logits, full, atol=1e-5)  # the cached form = the full-sequence model
    batched, k2, _ = step.run(np.array([[7], [11]]), np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1))
    assert k2.shape[1] == 2 and k2.shape[3] == 6
    for b, t in enumerate((7, 11)):
        np.testing.assert_allclose(batched[b], step.run(np.array([[t]]), k, v)[0][0], atol=1e-5)


def test_shipped_checkpoint_completes_range(tokenizer):
    model = load_model(REPO / "hrm_edge" / "default_model")
    for draft in (None, EagerStepModel(model, n_cycles=1)):  # the chains by the full depth, and by cycle 1
        words = suggest_words(TypedContext(EagerStepModel(model), draft), tokenizer, "for i in ra").words
        assert words[0].label == "range" and words[0].insert == "nge" and words[0].probability > 0.1, words


def test_eager_draft_step_model_is_the_draft_graphs_contract():
    """EagerStepModel(n_cycles=1) reads and writes the first L + 1 slots of the full model's cache and gives the
    first outer cycle's logits: DraftForm, which exports as *.draft.onnx."""
    model = make()
    full, draft = EagerStepModel(model), EagerStepModel(model, n_cycles=1)
    _, k, v = full.run(np.array([[5, 17, 3, 44, 9]]), *full.empty_past())
    slots = model.cfg.L_cycles + 1
    assert draft.slots == slots and draft.empty_past()[0].shape[0] == slots and k.shape[0] == full.slots > slots
    logits, k1, v1 = draft.run(np.array([[7], [11]]), np.repeat(k[:slots], 2, 1), np.repeat(v[:slots], 2, 1))
    pasts = [torch.from_numpy(np.repeat(x[:slots], 2, 1)) for x in (k, v)]
    with torch.no_grad():
        want = DraftForm(model)(torch.tensor([[7], [11]]), *pasts)
    np.testing.assert_allclose(logits, want[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(k1, want[2].numpy(), atol=1e-5)
    assert k1.shape == (slots, 2, k.shape[2], 6, k.shape[4])


def test_keyboard_bench_time_split():
    ms = np.array([10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 100.0])
    runs = np.array([[1, 2.0, 2, 4.0]] * 9 + [[1, 20.0, 4, 60.0]])  # [KV calls, KV ms, draft calls, draft ms]
    t = time_split(ms, runs)
    assert t["all"]["kv_share"] == pytest.approx(38 / 190) and t["all"]["draft_share"] == pytest.approx(96 / 190)
    assert t["all"]["calls_mean"] == pytest.approx(3.2) and t["calls_p90"] == pytest.approx(3.2)
    slow = t["slowest_tenth"]  # the 100 ms keystroke alone
    assert slow["ms_mean"] == 100 and slow["calls_mean"] == 5 and slow["draft_share"] == pytest.approx(0.6)


def test_keyboard_bench_combines_texts():
    # "ab cd": one word start (c), hit by a chip after "ab "; "xy z": none hit; savings: 4 keys for 5 chars, 4 for 4
    first = keyboard_metrics("ab cd", [[], [], [], [["cd", "cd", 0.5, " "]], [], []])
    second = keyboard_metrics("xy z", [[]] * 5)
    assert (first["top3_word_accuracy"], first["keystroke_savings"]) == (1.0, pytest.approx(0.2))
    assert combined_metrics([first, second]) == {"characters": 9, "word_starts": 2, "top3_word_accuracy": 0.5,
                                                 "keystroke_savings": pytest.approx(1 / 9), "partial_chips": 0}


def test_keyboard_bench_call_costs():
    # [graph (0: KV, 1: branch), rows, tokens a row, ms]: keystrokes of a one-token KV call and branch steps, one
    # whose context ran again from its start (a window that dropped a block), one that reused everything
    calls = [[[0, 1, 1, 5.0], [1, 4, 1, 4.0], [1, 2, 1, 3.0]], [[0, 1, 96, 90.0], [1, 4, 1, 6.0]], [],
             [[0, 1, 2, 7.0], [0, 1, 1, 6.0], [1, 1, 1, 2.0]]]
    assert runs_of(calls[0]) == [1, 5.0, 2, 7.0] and runs_of(calls[2]) == [0, 0, 0, 0]
    assert call_costs(calls) == {"kv": {"1": [2, 5.5], "2-8": [1, 7.0], ">8": [1, 90.0]},
                                 "draft": {1: [1, 2.0], 2: [1, 3.0], 4: [2, 5.0]}}


# ---- the page in a real browser (slow) ----
# typed when no corpus is built (python -m hrm_edge.corpus gives the validation split): code the model never saw
FALLBACK_TEXT = (
    "import json\nimport logging\nfrom pathlib import Path\n\nlogger = logging.getLogger(__name__)\n\n\n"
    "class Settings:\n    def __init__(self, path):\n        self.path = Path(path)\n        self.values = {}\n\n"
    "    def load(self):\n        if not self.path.exists():\n            logger.warning(\"no settings file: %s\", self.path)\n"
    "            return self.values\n        with open(self.path) as f:\n            self.values = json.load(f)\n"
    "        return self.values\n\n    def get(self, name, default=None):\n        return self.values.get(name, default)\n\n"
    "    def save(self):\n        with open(self.path, \"w\") as f:\n            json.dump(self.values, f, indent=2)\n")


ASTRAL_TEXT = "s = '\U0001F600 ok'\nimport os\nimport sy"  # an emoji: two UTF-16 units, one code point


def python_chips(path, tokenizer, text: str, every: int) -> dict:
    """Python onnxruntime's chips for every `every`-th prefix of text: {i: [[label, insert, probability], ...]}."""
    # as the page: the chains on the branch graph
    context = TypedContext(OnnxStepModel(path, threads=1), draft_beside(path, threads=1))
    return {i: [[w.label, w.insert, w.probability] for w in suggest_words(context, tokenizer, text[:i]).words]
            for i in range(every, len(text), every)}


def test_renderer_memory_is_the_largest_renderers_from_proc():
    """Of the renderer processes CDP lists, the one with the largest resident set (here: this process, beside its
    parent), read from /proc in MB; other types, and processes gone, are left out."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    ballast = np.ones(256 << 20, np.uint8)  # 256 MB of private pages: this process is the larger one
    listed = [{"type": "renderer", "id": os.getppid()}, {"type": "renderer", "id": os.getpid()},
              {"type": "GPU", "id": 1}, {"type": "renderer", "id": 2 ** 22 + 1}]
    m = renderer_memory(listed)
    assert ballast.sum() == 256 << 20 and m["anon_mb"] >= 256 and m["rss_mb"] >= m["anon_mb"]
    assert m["peak_mb"] >= m["rss_mb"] > int(status["VmRSS"].split()[0]) / 1024
    assert renderer_memory([{"type": "GPU", "id": os.getpid()}]) is None


def test_profile_parts_sum_the_samples_by_function_and_wasm_as_one():
    """A made-up Chromium profile: each sample lasts until the next (timeDeltas in us), idle time is left out,
    onnxruntime's unnamed WASM functions are one part, a JS function is named with its file and line (1-based), and
    past PROFILE_PARTS parts the rest is one."""
    def node(i, name, url, line=0):
        return {"id": i, "callFrame": {"functionName": name, "url": url, "lineNumber": line}}

    nodes = [node(1, "(idle)", ""), node(2, "wasm-function[7]", "http://x/ort-wasm-simd-threaded.wasm"),
             node(3, "wasm-function[9]", "http://x/ort-wasm-simd-threaded.wasm"),
             node(4, "probabilities", "http://x/app/js/suggest.mjs", 161), node(5, "(garbage collector)", "")]
    profile = {"nodes": nodes, "samples": [1, 2, 3, 4, 2, 5], "timeDeltas": [0, 5000, 2000, 1000, 500, 3000]}
    # sample k lasts timeDeltas[k + 1]: idle 5 ms, WASM 2 + 1 + 3 ms, probabilities 0.5 ms, the last sample 0
    assert profile_parts(profile) == [("onnxruntime-web's WASM (its kernels)", 6.0), ("probabilities (suggest.mjs:162)",
                                                                                      0.5)]
    many = {"nodes": [node(i, f"f{i}", "http://x/a.mjs", i) for i in range(1, PROFILE_PARTS + 3)],
            "samples": list(range(1, PROFILE_PARTS + 3)) + [1], "timeDeltas": [0] + [1000] * (PROFILE_PARTS + 2)}
    parts = profile_parts(many)
    assert len(parts) == PROFILE_PARTS + 1 and parts[-1] == ("the rest", 2.0) and sum(ms for _, ms in parts) == 14.0


@pytest.mark.slow
def test_browser_keyboard_bench(default_export, tokenizer, tmp_path):
    """The page's suggestWords typing code at a phone viewport: whole words only, Python onnxruntime's chips on the
    same graphs, and the figures (printed; speed goals are not asserted here, only that Chromium's CPU throttling
    takes effect: 8x must slow the typing more than 2x)."""
    try:
        text = heldout_text(600)
    except UserError:
        text = FALLBACK_TEXT
    server, on_fp32 = DemoServer(default_export), BenchSettings(model="hrm.fp32.kv.onnx")
    try:
        r = browser_keyboard_bench(server.url, [text])  # the page's default program: int8-nbits
        int8 = browser_keyboard_bench(server.url, [text], BenchSettings(model="hrm.int8-static-perstep.kv.onnx"))
        fp32 = browser_keyboard_bench(server.url, [text[:60], text[60:100]], replace(on_fp32, profile=True))
        # a key every 100 ms, the page's lookahead computing the likeliest next keys' chips in between
        ahead = browser_keyboard_bench(server.url, [text[:60]], replace(on_fp32, interval_ms=100))
        # a key is a code point, as Python's keyboard_metrics counts them (the bench typed UTF-16 units: a letter
        # outside the BMP was two keys, half of it a lone surrogate, and every chip after it was one place off)
        astral = browser_keyboard_bench(server.url, [ASTRAL_TEXT], on_fp32)
        # Chromium's CPU throttling, 8x, against the same typing unslowed
        quick = browser_keyboard_bench(server.url, [text[:60]], on_fp32)
        slowed = browser_keyboard_bench(server.url, [text[:60]], replace(on_fp32, cpu_slowdown=8))
    finally:
        server.close()
    print({k: r[k] for k in ("model", "characters", "median_ms", "p90_ms", "top3_word_accuracy", "keystroke_savings")})
    assert r["model"] == "hrm.int8-nbits.kv.onnx" and r["partial_chips"] == int8["partial_chips"] == 0
    # ?model= made the page load the static int8 program itself: its status line gave the load's time
    assert int8["model"] == "hrm.int8-static-perstep.kv.onnx" and r["load_ms"] > 0 and int8["load_ms"] > 0
    for m in (r["memory"], int8["memory"]):  # the page's renderer, a few hundred MB (Chromium itself over 100)
        assert 10 < m["blank_anon_mb"] < m["anon_mb"] < m["rss_mb"] <= m["peak_mb"] < 2000, m
        assert 0 < m["js_heap_mb"] < m["anon_mb"] - m["blank_anon_mb"], m  # onnxruntime's memory is not V8's objects
    assert fp32["partial_chips"] == 0 and r["word_starts"] > 40
    # the page extends words with the export's branch graph
    assert r["extender"] == int8["extender"] == fp32["extender"] == "branch" and r["threads"] == 1
    assert r["top3_word_accuracy"] > 0.1 and r["keystroke_savings"] > 0.05, r
    # fp32: the same chips as Python (probabilities within 1e-4: the same graph, other kernels and batch shapes), the
    # second text typed from an empty context as Python's own; and with the lookahead, whose keys guessed (over a
    # fifth of them) showed the chips computed ahead on a fork
    assert ahead["ahead"] > 0.2 and ahead["interval_ms"] == 100, ahead["ahead"]
    for piece, chips in zip([text[:60], text[60:100], text[:60]], fp32["chips"] + ahead["chips"]):
        for i, words in python_chips(default_export / "hrm.fp32.kv.onnx", tokenizer, piece, 5).items():
            page = chips[i]
            assert [w[:2] for w in page] == [w[:2] for w in words], (piece[:i], page, words)
            assert all(abs(a[2] - b[2]) <= 1e-4 * b[2] for a, b in zip(page, words)), (piece[:i], page, words)
    assert fp32["texts"] == 2 and fp32["characters"] == 100
    # the profiled run: the page's own functions and onnxruntime's kernels among the parts, the rest unprofiled
    parts = dict(fp32["profile"])
    assert "onnxruntime-web's WASM (its kernels)" in parts and any("suggest.mjs:" in part for part in parts), parts
    assert all(r["profile"] is None for r in (r, int8, ahead, astral, quick, slowed))
    assert len(astral["chips"][0]) == len(ASTRAL_TEXT) == astral["characters"]
    # the same chips, each keystroke slower: 8x gave 9-10x on a quiet machine (2026-12-06), but under the suite's
    # parallel load the unslowed run is the one another test's work slows (3.7x seen in CI: 24.5 ms against 9 quiet),
    # so only 2x is asserted; throttling that did not take effect gives about 1x
    assert slowed["chips"] == quick["chips"] and (slowed["cpu_slowdown"], quick["cpu_slowdown"]) == (8, 1)
    assert slowed["median_ms"] > 2 * quick["median_ms"], (slowed["median_ms"], quick["median_ms"])
    for i, words in python_chips(default_export / "hrm.fp32.kv.onnx", tokenizer, ASTRAL_TEXT, 1).items():
        assert [w[:2] for w in astral["chips"][0][i]] == [w[:2] for w in words], (ASTRAL_TEXT[:i], words)
    # the default: float MatMuls over 8-bit weights (the demo's page form), the same chips as Python on that form
    served = page_form(default_export / r["model"], tmp_path)
    for i, words in python_chips(served, tokenizer, text, 20).items():
        page = r["chips"][0][i]
        assert [w[:2] for w in page] == [w[:2] for w in words], (text[:i], page, words)
        assert all(abs(a[2] - b[2]) <= 1e-4 * b[2] for a, b in zip(page, words)), (text[:i], page, words)
    # static int8: the two runtimes' int8 kernels differ (probabilities by up to ~7% on 2026-12-01): near-ties swap
    python, chips = python_chips(default_export / int8["model"], tokenizer, text, 20), int8["chips"][0]
    same = sum([w[:2] for w in chips[i]] == [w[:2] for w in words] for i, words in python.items())
    top1 = sum(bool(words and chips[i]) and chips[i][0][:2] == words[0][:2] for i, words in python.items())
    print(f"int8, page vs Python: the same chips at {same} of {len(python)} prefixes, the same first chip at {top1}")
    assert same >= 0.75 * len(python) and top1 >= 0.9 * sum(bool(w) for w in python.values()), (same, top1)


@pytest.mark.slow  # two ONNX exports
def test_the_branch_graph_is_the_draft_graph_on_a_tiled_context(tmp_path):
    """The branch graph's rows share one context's cache: its logits are DraftForm's on that cache tiled per row and
    concatenated with each row's own past, and its presents are the rows' own part (eager BranchForm and the exported
    graph, rows of different tokens); batch_runner (suggest_words' extension) feeds either graph its way."""
    model = onnx_model(4, 2, 2)
    slots, rng = model.cfg.L_cycles + 1, np.random.default_rng(0)
    draft = OnnxStepModel(export_onnx_draft(model, tmp_path / "m.draft.onnx"))
    branch = OnnxBranchModel(export_onnx_branch(model, tmp_path / "m.branch.onnx"))
    _, ck, cv = draft.run(rng.integers(2, 512, (1, 9)), *draft.empty_past())  # the context: 9 positions
    first, second = rng.integers(2, 512, (3, 2)), rng.integers(2, 512, (3, 1))  # 3 rows, each its own tokens
    with torch.no_grad():
        want1, _, tk, tv = (x.numpy() for x in DraftForm(model)(torch.from_numpy(first), *(torch.from_numpy(
            np.repeat(x, 3, axis=1)) for x in (ck, cv))))
        want2 = DraftForm(model)(torch.from_numpy(second), torch.from_numpy(tk), torch.from_numpy(tv))[0].numpy()

    def eager(*inputs):
        with torch.no_grad():
            return tuple(x.numpy() for x in BranchForm(model)(*(torch.from_numpy(np.asarray(y)) for y in inputs)))

    for run in (branch.run, eager):
        got1, pk, pv = run(first, ck, cv, *branch.empty_rows(3))
        assert pk.shape == (slots, 3, ck.shape[2], 2, ck.shape[4])  # the rows' own 2 positions, not the context's
        np.testing.assert_allclose(pk, tk[:, :, :, 9:], atol=1e-5)
        np.testing.assert_allclose(got1, want1, atol=1e-4)
        np.testing.assert_allclose(run(second, ck, cv, pk, pv)[0], want2, atol=1e-4)
    for model_ in (branch, draft):
        run, k, v = batch_runner(model_, ck, cv, 3)
        np.testing.assert_allclose(run(first, k, v)[0], want1, atol=1e-4)
