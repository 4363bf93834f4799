"""The keyboard evaluation: word splitting, the Kneser-Ney n-gram keyboard against hand-computed probabilities,
the metric arithmetic with a scripted suggester, and `evaluate --keyboard` end to end on a tiny built corpus."""
import hashlib
import itertools
import json
import shutil
from types import SimpleNamespace as Chip

import numpy as np
import pytest

from hrm_edge.errors import UserError
from hrm_edge.measure import keyboard as K
from hrm_edge.measure.evaluate import main as evaluate_main
from hrm_edge.measure.ngram import (WORD, CachedKeyboard, NgramKeyboard, build_levels, count_ngrams, encode, fit,
                                    make_vocab, tokens, top_words)
from hrm_edge.train.dataset import CORPUS_FORMAT, RECORD, listing_sha256
from test_demo import fake_export


def model_of(texts, order, min_count=1):
    docs = [tokens(t) for t in texts]
    vocab = make_vocab(docs, 1000)
    counts = count_ngrams(encode(docs, vocab), len(vocab) - 1, order)
    return NgramKeyboard(vocab, *build_levels(counts, order, min_count, len(vocab) - 1))


def test_words_and_tokens_follow_the_page():
    """Identifier words are runs of [\\p{L}\\p{N}_] (the page's class): letters of any script, numbers (² is No),
    underscore; runs of other visible characters are one token; a line break with its indentation is "\\n"."""
    assert WORD.findall("café = π² + x_1·y2 # ٣") == ["café", "π²", "x_1", "y2", "٣"]
    assert tokens("def f(x):\n    return x_1 + 2  \n\n\tpass") == \
        ["def", "f", "(", "x", "):", "\n", "return", "x_1", "+", "2", "\n", "pass"]
    m = model_of(["x = foo\n"], 2)
    ids = {t: i for i, t in enumerate(m.vocab)}
    assert m.context_ids("x = fo") == ([m.bos, ids["x"], ids["="]], "fo")  # mid-word: the typed part apart
    assert m.context_ids("x = ") == ([m.bos, ids["x"], ids["="]], "")
    assert m.context_ids("y\n") == ([m.bos, m.unk, ids["\n"]], "")


def test_the_cache_adds_the_words_typed_before():
    """CachedKeyboard: score(w) = (1 - weight - f) P(w | h) + weight c(w) / C + f a(w) / A over the words typed before
    the cursor's (a: those right after the cursor's word and link; f = 0 where there are none); a
    typed word outside the vocabulary (zz_new) is scored by the cache alone. After b (bigram, hand computation below):
    a 0.48125, c 0.33125, b 0.13125."""
    m = model_of(["a b a b c"], 2)
    assert CachedKeyboard(m, 0.0).suggest("a b ") == m.suggest("a b ") == ["a", "c", "b"]
    text = "zz_new zz_new b "  # typed before: zz_new 2, b 1 (C = 3)
    cached = CachedKeyboard(m, 0.5)
    # a 0.5 * 0.48125 = 0.241, c 0.166, b 0.066 + 0.5 / 3 = 0.232, zz_new 0.5 * 2 / 3 = 0.333
    assert cached.suggest(text) == ["zz_new", "a", "b"]
    assert cached.suggest(text + "z") == ["zz_new"]  # mid-word: the cached words that start with the typed part
    # weight 0.2: a 0.385, c 0.265, b 0.105 + 0.067 = 0.172, zz_new 0.133
    assert CachedKeyboard(m, 0.2).suggest(text) == ["a", "c", "b"]
    # the words typed right after the same word and link ("b", " "): c once (A = 1). follow_weight 0.5 with weight
    # 0.2: a 0.3 * 0.48125 = 0.144, c 0.099 + 0.2 / 3 + 0.5 = 0.666, b 0.039 + 0.2 * 2 / 3 = 0.173; without: a c b
    assert CachedKeyboard(m, 0.2, 0.5).suggest("b c b ") == ["c", "b", "a"]
    assert CachedKeyboard(m, 0.2, 0.0).suggest("b c b ") == ["a", "c", "b"]


def test_kneser_ney_bigram_matches_hand_computation():
    """<s> a b a b c. Unigram continuation counts a 2, b 1, c 1 (D1 = n1/(n1+2 n2) = 2/4); bigram raw counts
    <s>a 1, ab 2, ba 1, bc 1 (D2 = 3/5). P1 = max(a - 0.5, 0)/4 + 0.375/4 over {a, b, c, <unk>}."""
    m = model_of(["a b a b c"], 2)
    ids = {t: i for i, t in enumerate(m.vocab)}
    p1 = {"a": 0.46875, "b": 0.21875, "c": 0.21875, "<unk>": 0.09375}
    expected = {  # P(w | h) = max(c(hw) - 0.6, 0) / c(h) + gamma(h) P1(w), gamma(h) = 0.6 N1+(h .) / c(h)
        "b": {w: (0.4 / 2 if w in "ac" else 0) + 0.6 * p for w, p in p1.items()},
        "a": {w: (1.4 / 2 if w == "b" else 0) + 0.3 * p for w, p in p1.items()},
        "<s>": {w: (0.4 if w == "a" else 0) + 0.6 * p for w, p in p1.items()},
        "c": p1,  # no continuation: the unigram distribution
    }
    for h, dist in expected.items():
        p = m.distribution([ids[h]])
        assert p[m.bos] == 0
        for w, want in dist.items():
            assert p[ids[w]] == pytest.approx(want, abs=1e-6), (h, w)
    assert expected["b"]["a"] == pytest.approx(0.48125)
    assert m.suggest("a b ") == ["a", "c", "b"]  # after b: a 0.481, c 0.331, b 0.131
    # mid-word: the words that go on from the typed part, never the typed part itself (it is not the word being
    # typed, or the bar would have been read after it); until 2026-12-05 "b" after "b" took a slot
    assert m.suggest("a b a b b") == [] and m.suggest("a b a b ") == ["a", "c", "b"]
    m2 = model_of(["ab abc abd abc x ab abd abc"], 2)
    assert m2.suggest("x ab") == ["abc", "abd"]  # after x: ab (not offered), then abc, abd by probability
    assert list(top_words(np.array([0.1, 0.3, 0.3, 0.2, 0.3]), 2)) == [1, 2]  # ties at the n-th: the lower index


@pytest.mark.parametrize("order,min_count", [(2, 1), (3, 1), (4, 1), (3, 2), (4, 2)])
def test_kneser_ney_sums_to_one_over_the_vocabulary(order, min_count):
    """Every context, seen or not, pruned or not, gives a distribution over the vocabulary (<s> excluded)."""
    m = model_of(["import os\nimport sys\nfrom os import path\n", "x = os.path.join(a, b)\nimport os\n",
                  "def f(a, b):\n    return a + b\n"], order, min_count)
    if min_count > 1:
        assert len(m.levels[0].word) < len(model_of(["import os\n"], 2).vocab) ** 2
    for context in itertools.product(range(len(m.vocab)), repeat=order - 1):
        p = m.distribution(list(context))
        assert p.sum() == pytest.approx(1, abs=1e-6) and p.min() >= 0 and p[m.bos] == 0, context


def test_fit_meets_the_size_cap_and_round_trips(tmp_path):
    docs = [tokens(f"value_{i % 50} = compute(value_{(i * 7) % 50}, {i % 13})\n") for i in range(2000)]
    vocab = make_vocab(docs, 1000)
    counts = count_ngrams(encode(docs, vocab), len(vocab) - 1, 3)
    full, full_size = fit(counts, vocab, 3, 10**9)
    capped, size = fit(counts, vocab, 3, full_size - 1)
    assert full.info["min_count"] == 1 and capped.info["min_count"] > 1 and size < full_size
    assert capped.save(tmp_path / "m.npz") == size == (tmp_path / "m.npz").stat().st_size
    again = NgramKeyboard.load(tmp_path / "m.npz")
    text = "value_3 = compute(value_21, 3)\nvalue_"
    assert again.suggest(text) == capped.suggest(text) and len(again.suggest(text)) == 3
    np.testing.assert_array_equal(again.distribution([1, 2]), capped.distribution([1, 2]))


def test_metrics_of_a_scripted_suggester():
    """ab: on the bar at once (top-1; saves 2 - 1) and after 1 character; cdefg: after 2 characters (saves 5 - 3);
    h: top-1 (saves 0). Words longer than 1 / 2 characters count for the completion figures."""
    bars = {"": ["ab", "x", "y"], "a": ["ab"], "ab ": ["x", "cd", "y"], "ab cd": ["q", "r", "cdefg", "late"],
            "ab cdefg.": ["h"]}
    asked = []

    def suggest(text):
        asked.append(text)
        return bars.get(text, [])

    tally = K.type_text(suggest, "ab cdefg.h", K.Tally())
    assert asked == ["", "a", "ab ", "ab c", "ab cd", "ab cdefg."]  # stops once shown and past 2 characters
    m = tally.metrics()
    assert (m["words"], m["next_top1"], m["next_top3"], m["after1"], m["after2"]) == (3, 2 / 3, 2 / 3, 1 / 2, 1.0)
    assert m["savings"] == 3 / 8 and m["savings_of_text"] == 3 / 10 and m["suggestions"] == 6
    both = tally + K.type_text(lambda text: [], "zz", K.Tally())
    assert both.metrics()["words"] == 4 and both.metrics()["savings"] == 3 / 10 and both.after1 == 3


def test_cut_texts():
    assert K.cut_texts(["ab\ncd\n", "efgh"], 5) == ["ab\n"]
    assert K.cut_texts(["ab\ncd\n", "efgh"], 8) == ["ab\ncd\n", "ef"]
    assert K.cut_texts(["abcdef"], 4) == ["abcd"]


def test_spread_texts(monkeypatch):
    monkeypatch.setattr(K, "PIECE_CHARS", 10)
    conf = "# conf\n" * 3  # a first file of boilerplate, 21 characters
    code = "".join(f"line{i:02d}\n" for i in range(40))  # 280 characters of 7-character lines
    pieces = K.spread_texts([conf, code], 20)
    # 2 pieces of 10 characters, from the middles of the halves of the 301 characters: 75 and 225, each from the
    # line start at or after it (code's characters 54 and 204: lines 08 and 30 start at 56 and 210), cut at a line end
    assert pieces == ["line08\n", "line30\n"]
    assert K.spread_texts([conf, code], 301) == [conf, code]  # all of a text no longer than asked
    assert K.spread_texts([conf, code], 25) == ["line05\n", "line19\n", "line33\n"]  # 50, 150, 250: 9, 8, 8 a piece
    assert K.spread_texts(["ab\ncd\n", "efgh\nij\n"], 4) == ["ij\n"]  # runs on into the next file's lines


def write_built_corpus(root, projects):
    """A built corpus folder: {split}/{project}/{path} and a record whose sha256 matches the files."""
    entries = []
    for (split, project), files in projects.items():
        for path, text in files.items():
            (root / split / project).mkdir(parents=True, exist_ok=True)
            (root / split / project / path).write_text(text)
            entries.append((split, project, path, hashlib.sha256(text.encode()).hexdigest()))
    (root / RECORD).write_text(json.dumps({"format": CORPUS_FORMAT, "sha256": listing_sha256(entries)}))


def scripted_checkpoint(path) -> str:
    """A checkpoint folder with the files `evaluate` checks for first; the tests script the model itself."""
    path.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (path / name).write_text("{}")
    return str(path)


def test_evaluate_keyboard_end_to_end(tmp_path, monkeypatch, capsys):
    """`evaluate CKPT --keyboard`: the n-gram keyboard trained on the training projects (order chosen on one of
    them), typed on the held-out project; the table and files name its order and size."""
    code = "import os\nimport sys\n\ndef main(args):\n    return os.path.join(args.root, args.name)\n"
    corpus = {("train", f"p{i}"): {"m.py": code.replace("main", f"main{i % 2}")} for i in range(4)}
    corpus[("val", "held")] = {"a.py": code}
    corpus[("calib", "dev")] = {"d.py": "import os\nos.path\n"}
    write_built_corpus(tmp_path / "corpus", corpus)
    monkeypatch.setattr(K, "NGRAM_ORDERS", (2, 3))
    # the model's keyboard scripted (the real one: hrm_edge.runtime.suggest, tests/test_keyboard.py): always "os"
    monkeypatch.setattr(K, "model_suggester", lambda path, onnx=None, threads=1: lambda text: ["os"])
    out = tmp_path / "out"
    scripted_checkpoint(tmp_path / "ckpt")
    assert evaluate_main([str(tmp_path / "ckpt"), "--corpus", str(tmp_path / "corpus"), "--keyboard", "--out",
                          str(out), "--keyboard-chars", "60", "--keyboard-sample", "start"]) == 0  # its first 60
    record = json.loads((out / "keyboard.json").read_text())
    ngram = record["ngram"]
    assert ngram["bytes"] == (out / K.NGRAM_FILE).stat().st_size and ngram["order"] in (2, 3)
    assert ngram["dev_projects"] and [t["order"] for t in ngram["order_trials"]] == [2, 3]
    rows = {(r["project"], r["suggester"]): r for r in record["rows"]}
    held = rows[("held", f"ngram-{ngram['order']}")]
    assert held["words"] == len(WORD.findall(code[:60].rsplit("\n", 1)[0] + "\n")) == 7
    assert held["next_top3"] >= 0.5 and 0.3 < held["savings"] < 1  # the training text is the held-out text
    assert rows[("all", f"ngram-{ngram['order']}")]["words"] == 7
    cached = rows[("held", f"ngram-{ngram['order']} + cache")]  # the n-gram with the words typed before
    assert cached["words"] == 7 and cached["savings"] >= held["savings"] and record["ngram"]["cache_weight"] == 0.3
    # "os" is the next word at 1 of the 7 typed word starts ("import os"; the text is cut before "return os")
    assert rows[("held", "ckpt")]["next_top3"] == pytest.approx(1 / 7)
    assert f"{ngram['bytes']:,} bytes on disk" in (out / "keyboard.md").read_text() in capsys.readouterr().out
    # a second run loads the saved n-gram keyboard (no training: its progress bar would say "tokens")
    assert evaluate_main([str(tmp_path / "ckpt"), "--corpus", str(tmp_path / "corpus"), "--keyboard", "--out",
                          str(out), "--keyboard-chars", "60"]) == 0
    assert "dev: order" not in capsys.readouterr().out
    assert evaluate_main([str(tmp_path / "ckpt"), "--corpus", str(tmp_path / "corpus"), "--keyboard", "--out",
                          str(out), "--keyboard-split", "calib", "--ngram-cache-weight", "0"]) == 0  # the dev set
    record = json.loads((out / "keyboard.json").read_text())
    assert record["split"] == "calib" and {r["project"] for r in record["rows"]} == {"dev", "all"}
    rows = {r["suggester"]: r for r in record["rows"] if r["project"] == "dev"}
    plain, cached = rows[f"ngram-{ngram['order']}"], rows[f"ngram-{ngram['order']} + cache"]
    scores = ("words", "next_top1", "next_top3", "after1", "after2", "savings", "suggestions")
    assert plain["words"] == 4 and [cached[k] for k in scores] == [plain[k] for k in scores]  # weight 0: no cache
    assert "calib split's projects" in capsys.readouterr().out


def test_a_chip_is_scored_by_what_a_tap_types():
    """A model chip labelled `if` that inserts "    if" (deeper indentation, then the word) types other text than the
    next word: no hit. Scored by label it was one (top-3 on the held-out text counted such chips)."""
    text = "    x = 1\n    if y:\n"
    start = text.index("if")
    chips = [Chip(label="if", insert="    if"), Chip(label="for", insert="for")]
    assert K.tapped_words("", chips) == ["    if", "for"]
    tally = K.Tally()
    K.type_word(lambda typed: K.tapped_words("", chips) if typed == text[:start] else [], text, start, "if", tally)
    assert tally.next_top3 == 0 and tally.saved_keys == 0
    mid = [Chip(label="import", insert="port")]  # mid-word ("im" typed): the label is the whole word
    assert K.tapped_words("im", mid) == ["import"]
    tally = K.Tally()
    K.type_word(lambda typed: K.tapped_words("", [Chip(label="if", insert="if")]), text, start, "if", tally)
    assert tally.next_top3 == 1


def test_keyboard_user_errors(tmp_path, monkeypatch):
    ckpt = scripted_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UserError, match="--keyboard-chars must be >= 1"):
        evaluate_main([ckpt, "--keyboard", "--keyboard-chars", "0"])
    with pytest.raises(UserError, match=r"--ngram-cache-weight must be in \[0, 1\], not 1.5"):
        evaluate_main([ckpt, "--keyboard", "--ngram-cache-weight", "1.5"])
    with pytest.raises(UserError, match="--ngram-cache-weight must be in"):
        evaluate_main([ckpt, "--keyboard", "--ngram-cache-weight", "nan"])
    with pytest.raises(UserError, match=r"--ngram-follow-weight must be in \[0, 1\], not -0.1"):
        evaluate_main([ckpt, "--keyboard", "--ngram-follow-weight", "-0.1"])
    with pytest.raises(UserError, match=r"add up to more than 1 \(0.8 \+ 0.25\)"):
        evaluate_main([ckpt, "--keyboard", "--ngram-cache-weight", "0.8"])
    write_built_corpus(tmp_path / "corpus", {("train", "only"): {"m.py": "x = 1\n"}, ("val", "h"): {"a.py": "y\n"}})
    keyboard_graph = [ckpt, "--corpus", str(tmp_path / "corpus"), "--keyboard", "--keyboard-graph"]
    (tmp_path / "bare.kv.onnx").write_bytes(b"\x08\x07")  # not in an export folder: its sha256 is not known
    with pytest.raises(UserError, match="no manifest.json beside it"):
        evaluate_main(keyboard_graph + [str(tmp_path / "bare.kv.onnx")])
    export = fake_export(tmp_path / "export")  # m.kv.onnx, listed; its tokenizer is not the checkpoint's
    with pytest.raises(UserError, match="was exported with another tokenizer than"):
        evaluate_main(keyboard_graph + [str(export / "m.kv.onnx")])
    shutil.copyfile(export / "tokenizer.json", tmp_path / "ckpt" / "tokenizer.json")
    with pytest.raises(UserError, match="cannot load m.kv.onnx"):  # refused before the n-grams
        evaluate_main(keyboard_graph + [str(export / "m.kv.onnx")])
    (export / "m.kv.onnx").write_bytes(b"edited")  # it was opened without a look at the manifest
    with pytest.raises(UserError, match="m.kv.onnx does not match the sha256"):
        evaluate_main(keyboard_graph + [str(export / "m.kv.onnx")])
    monkeypatch.setattr(K, "model_suggester", lambda *args, **kwargs: (lambda text: []))  # the n-grams' errors
    with pytest.raises(UserError, match="at least 2 training projects"):
        evaluate_main([ckpt, "--corpus", str(tmp_path / "corpus"), "--keyboard"])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(UserError, match="not an n-gram keyboard file"):
        evaluate_main([ckpt, "--corpus", str(tmp_path / "corpus"), "--keyboard", "--ngram",
                       str(tmp_path / "bad.npz")])
    np.savez(tmp_path / "cut.npz", counts=np.arange(1000))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "cut.npz").read_bytes()[:-100])  # a truncated file: BadZipFile
    with pytest.raises(UserError, match="not an n-gram keyboard file"):
        evaluate_main([ckpt, "--corpus", str(tmp_path / "corpus"), "--keyboard", "--ngram",
                       str(tmp_path / "cut.npz")])
