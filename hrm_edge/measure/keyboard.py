"""Keyboard evaluation: a 3-word suggestion bar typing held-out code, the model's keyboard next to a word n-gram
keyboard trained on the corpus's training split (docs/keyboard-evaluation.md).

    python -m hrm_edge.evaluate hrm_edge/default_model --keyboard --out runs/keyboard

A suggester is a callable `text before the cursor -> up to 3 whole-word labels` (mid-word: the completed word).
Each held-out file is typed character by character; at every identifier word (a run of [\\p{L}\\p{N}_]+, see
hrm_edge.measure.ngram) the bar is read before its first character and after each typed one, until the word
shows on the bar (and at least after 2 characters, for the completion figures). Only identifier words are
scored; runs of other characters and whitespace are typed, not predicted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_text
from hrm_edge.measure.harness import cpu_info, describe_cpu
from hrm_edge.measure.ngram import WORD, CachedKeyboard, NgramKeyboard, count_ngrams, encode, fit, make_vocab, tokens
from hrm_edge.train.dataset import built_corpus_root, read_built_corpus

# text before the cursor -> for each chip, the word a tap on it leaves: the typed part of the word and what the tap
# inserts (an n-gram chip inserts the rest of its word; a model chip may insert more, indentation before its word)
Suggester = Callable[[str], list[str]]
SUGGESTIONS = 3  # words on the bar
KEYBOARD_CHARS = 4_000  # default text per held-out project
PIECE_CHARS = 1_000  # a project's text is typed in pieces of this many characters spread over its files
NGRAM_FILE = "keyboard-ngram.npz"
NGRAM_MAX_BYTES = 10_000_000  # phone keyboards ship n-gram LMs of at most ~10 MB
NGRAM_VOCAB = 50_000  # tokens (words and punctuation runs) the n-gram keyboard knows
NGRAM_ORDERS = (2, 3, 4, 5)
DEV_PROJECTS = 8  # training projects held out of the n-gram to choose its order
DEV_CHARS = 6_000  # text per dev project


@dataclass
class Project:
    name: str
    texts: list[str]


@dataclass
class Tally:
    """What one suggester did on some text (sums, so projects add up)."""
    words: int = 0  # identifier words typed
    next_top1: int = 0  # the word was the bar's first suggestion before its first character
    next_top3: int = 0  # ... was on the bar
    after1: int = 0  # words longer than 1 character
    after1_shown: int = 0  # ... on the bar after their first character
    after2: int = 0  # words longer than 2 characters
    after2_shown: int = 0
    word_keys: int = 0  # keystrokes to type the words character by character
    saved_keys: int = 0  # keystrokes saved by taking each word as soon as it shows (taking it costs 1)
    text_chars: int = 0  # characters of the text, whitespace and punctuation included
    ms: list[float] = field(default_factory=list)  # time of each suggestion

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def metrics(self) -> dict:
        def rate(a, b):
            return a / b if b else float("nan")

        ms = np.asarray(self.ms) if self.ms else np.asarray([np.nan])
        return {"words": self.words, "next_top1": rate(self.next_top1, self.words),
                "next_top3": rate(self.next_top3, self.words), "after1": rate(self.after1_shown, self.after1),
                "after2": rate(self.after2_shown, self.after2), "savings": rate(self.saved_keys, self.word_keys),
                "savings_of_text": rate(self.saved_keys, self.text_chars), "suggestions": len(self.ms),
                "ms_median": float(np.median(ms)), "ms_p90": float(np.percentile(ms, 90))}


def type_word(suggest: Suggester, text: str, start: int, word: str, tally: Tally) -> None:
    """Type `word` (at text[start:]) character by character, reading the bar before each character."""
    shown_at = None
    for k in range(len(word)):
        if shown_at is not None and k > 2:
            break
        t = time.perf_counter()
        bar = list(suggest(text[: start + k]))[:SUGGESTIONS]
        tally.ms.append(1e3 * (time.perf_counter() - t))
        shown = word in bar
        if k == 0:
            tally.next_top1 += bar[:1] == [word]
            tally.next_top3 += shown
        elif k == 1:
            tally.after1 += 1
            tally.after1_shown += shown
        elif k == 2:
            tally.after2 += 1
            tally.after2_shown += shown
        if shown and shown_at is None:
            shown_at = k
    tally.words += 1
    tally.word_keys += len(word)
    if shown_at is not None:
        tally.saved_keys += len(word) - (shown_at + 1)


def type_text(suggest: Suggester, text: str, tally: Tally, bar=None) -> Tally:
    """Type one file; every identifier word is scored."""
    tally.text_chars += len(text)
    for m in WORD.finditer(text):
        type_word(suggest, text, m.start(), m.group(), tally)
        if bar is not None:
            bar.update()
    return tally


def cut_texts(texts: list[str], max_chars: int) -> list[str]:
    """The first max_chars characters of the files (the last one cut at a line end, or mid-line if it has none)."""
    out, left = [], max_chars
    for t in texts:
        if len(t) >= left:
            cut = t.rfind("\n", 0, left) + 1
            out.append(t[: cut or left])
            break
        out.append(t)
        left -= len(t)
    return out


def spread_texts(texts: list[str], max_chars: int) -> list[str]:
    """About max_chars characters of a project's files (laid end to end in their order) in ceil(max_chars /
    PIECE_CHARS) pieces, one from the middle of each of that many equal stretches of the text: each piece starts at
    the first line start at or after its stretch's midpoint and runs on (into the next files) for its share, cut at
    a line end (cut_texts). A project's first files are often a Sphinx conf.py or an __init__.py of imports, a
    percent of its text: its first max_chars characters would measure those alone. All of a shorter text."""
    ends = np.cumsum([len(t) for t in texts])  # [F] where each file ends in the laid-out text
    if not texts or ends[-1] <= max_chars:
        return [t for t in texts if t]
    pieces, out = -(-max_chars // PIECE_CHARS), []
    for k in range(pieces):
        at = (2 * k + 1) * int(ends[-1]) // (2 * pieces)
        f = int(np.searchsorted(ends, at, side="right"))  # the file that holds character `at`
        text, start = texts[f], at - (int(ends[f - 1]) if f else 0)
        if start:  # the line start at or after it (the file's end if none)
            newline = text.find("\n", start - 1)
            start = newline + 1 if newline >= 0 else len(text)
        share = max_chars // pieces + (k < max_chars % pieces)
        out += [t for t in cut_texts([text[start:]] + texts[f + 1:], share) if t]
    return out


def evaluate_keyboards(suggesters: dict[str, Suggester], projects: list, progress: bool = True) -> dict:
    """{suggester: {project: Tally}} for projects with .name and .texts."""
    words = sum(len(WORD.findall(t)) for p in projects for t in p.texts)
    out = {}
    for name, suggest in suggesters.items():
        with tqdm(total=words, desc=f"keyboard {name}", unit="word", disable=not progress, mininterval=2) as bar:
            out[name] = {p.name: _type_project(suggest, p.texts, bar) for p in projects}
    return out


def _type_project(suggest: Suggester, texts: list[str], bar) -> Tally:
    tally = Tally()
    for t in texts:
        type_text(suggest, t, tally, bar)
    return tally


def keyboard_rows(results: dict) -> list[dict]:
    """One row per (project, suggester), then the 'all' rows (every project's words together)."""
    rows, projects = [], list(next(iter(results.values())))
    for project in projects + ["all"]:
        for name, by_project in results.items():
            tally = by_project[project] if project != "all" else sum(by_project.values(), Tally())
            rows.append({"project": project, "suggester": name} | tally.metrics())
    return rows


def render_keyboard(rows: list[dict]) -> str:
    lines = ["| project | suggester | words | next top-1 | next top-3 | after 1 char | after 2 chars "
             "| keystroke savings | ms median | ms p90 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = " | ".join(f"{100 * r[k]:.1f}%" for k in ("next_top1", "next_top3", "after1", "after2", "savings"))
        lines.append(f"| {r['project']} | {r['suggester']} | {r['words']:,} | {pct} | {r['ms_median']:.2f} "
                     f"| {r['ms_p90']:.2f} |")
    return "\n".join(lines) + "\n"


def training_texts(corpus: str) -> dict[str, list[str]]:
    """The built corpus's training split: {project: [file text]}."""
    root = built_corpus_root(corpus)
    if root is None:
        raise UserError(f"--keyboard needs a built corpus (python -m hrm_edge.corpus); {corpus} is not one")
    projects: dict[str, list[str]] = {}
    for split, project, _, text in read_built_corpus(root)[1]:
        if split == "train":
            projects.setdefault(project, []).append(text)
    return projects


def ngram_counts(texts: list[str], max_order: int, progress: bool) -> tuple[list[str], list]:
    """(vocabulary, counts of orders 1..max_order) of the texts."""
    docs = [tokens(t) for t in tqdm(texts, desc="n-gram tokens", unit="file", disable=not progress, mininterval=2)]
    vocab = make_vocab(docs, NGRAM_VOCAB)
    ids = encode(docs, vocab)
    del docs
    return vocab, count_ngrams(ids, len(vocab) - 1, max_order)


def choose_order(projects: dict[str, list[str]], max_bytes: int, progress: bool) -> dict:
    """The order (of NGRAM_ORDERS) whose size-capped model saves the most keystrokes on DEV_PROJECTS training
    projects (chosen by hash of the name) when trained on the other training projects; ties: the lower order.
    {"order", "dev_projects", "order_trials": [metrics of each order]}"""
    if len(projects) < 2:
        raise UserError("the n-gram keyboard needs at least 2 training projects (one to choose its order on)")
    by_hash = sorted(projects, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    dev = by_hash[: min(DEV_PROJECTS, len(projects) // 2)]
    vocab, counts = ngram_counts([t for p, ts in projects.items() if p not in dev for t in ts], max(NGRAM_ORDERS),
                                 progress)
    dev_texts = [Project(p, spread_texts(projects[p], DEV_CHARS)) for p in dev]
    trials = []
    for order in NGRAM_ORDERS:
        model, size = fit(counts, vocab, order, max_bytes)
        name = f"{order}-gram dev"
        m = sum(evaluate_keyboards({name: model}, dev_texts, progress)[name].values(), Tally()).metrics()
        trials.append({"order": order, "min_count": model.info["min_count"], "bytes": size} | m)
        print(f"  dev: order {order}: keystroke savings {100 * m['savings']:.2f}%, next top-3 "
              f"{100 * m['next_top3']:.1f}%, {size:,} bytes (count >= {model.info['min_count']})")
    best = max(trials, key=lambda t: (round(t["savings"], 4), -t["order"]))
    return {"order": best["order"], "dev_projects": dev, "order_trials": trials}


def train_ngram_keyboard(corpus: str, max_bytes: int = NGRAM_MAX_BYTES, progress: bool = True) -> NgramKeyboard:
    """The n-gram keyboard of the corpus's training split: order chosen on dev projects, then trained on all of
    the training split and pruned to max_bytes."""
    projects = training_texts(corpus)
    chosen = choose_order(projects, max_bytes, progress)
    vocab, counts = ngram_counts([t for ts in projects.values() for t in ts], chosen["order"], progress)
    info = {"corpus": corpus, "train_projects": len(projects), "dev_chars": DEV_CHARS} | chosen
    return fit(counts, vocab, chosen["order"], max_bytes, info)[0]


def load_or_train(path: Path | None, corpus: str, progress: bool = True) -> tuple[NgramKeyboard, int]:
    """(n-gram keyboard, its file's bytes): loaded from `path` if it exists, else trained and saved there (without a
    path: not saved, and measured in memory)."""
    if path is not None and path.exists():
        try:
            return NgramKeyboard.load(path), path.stat().st_size
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # a truncated .npz: BadZipFile
            raise UserError(f"{path}: not an n-gram keyboard file ({e})") from None
    model = train_ngram_keyboard(corpus, progress=progress)
    return model, model.save(path) if path is not None else len(model.to_bytes())


def model_suggester(checkpoint: Path, onnx: Path | None = None, threads: int = 1) -> Suggester:
    """The model's keyboard (hrm_edge.runtime.suggest.suggest_words, 3 words) as a suggester: the eager
    checkpoint, or the exported ONNX graph `onnx` on `threads` threads (its chains on the *.branch.onnx graph beside
    it, else the *.draft.onnx, as on the page). The typed context keeps its cache between keystrokes, as on the page."""
    from hrm_edge.model.checkpoint import TOKENIZER, load_model  # torch
    from hrm_edge.runtime.suggest import OnnxStepModel, TypedContext, draft_beside, suggest_words, trailing_word
    from hrm_edge.train.tokenizer import load_tokenizer

    if onnx is not None:
        step, draft = OnnxStepModel(onnx, threads), draft_beside(onnx, threads)
    else:
        import torch

        from hrm_edge.model.eager import EagerStepModel

        torch.set_num_threads(threads)
        model = load_model(checkpoint)
        step, draft = EagerStepModel(model), EagerStepModel(model, n_cycles=1) if model.cfg.H_cycles > 1 else None
    tokenizer, context = load_tokenizer(checkpoint / TOKENIZER), TypedContext(step, draft)

    def suggest(text: str) -> list[str]:
        return tapped_words(trailing_word(text), suggest_words(context, tokenizer, text, n=SUGGESTIONS).words)

    return suggest


def tapped_words(typed: str, chips: list) -> list[str]:
    """What a tap on each chip leaves of the word being typed (`typed`, its typed part): typed + the chip's insert. A
    chip is scored by this, not by its label: `if` that inserts "    if" after a line's indentation types other text
    than the word; scored by label, such chips counted as hits (docs/keyboard-evaluation.md)."""
    return [typed + w.insert for w in chips]


def run_keyboard(a: argparse.Namespace, checkpoints: dict[str, Path], projects: list, graph: Path | None = None) -> int:
    """`python -m hrm_edge.evaluate CKPT --keyboard` (its flags `a`): the table, printed and written to
    a.out/keyboard.{json,md}. graph: run the (one) checkpoint's keyboard through this exported KV graph instead of the
    eager model. The projects come from the corpus split a.keyboard_split (val: held out; calib: a dev set)."""
    threads, out = a.threads or 1, a.out
    suggesters: dict[str, Suggester] = {  # first: a checkpoint or graph that cannot load is refused before the n-grams
        (f"{name} ({graph.name})" if graph else name): model_suggester(path, onnx=graph, threads=threads)
        for name, path in checkpoints.items()}
    model, size = load_or_train(a.ngram or (out / NGRAM_FILE if out else None), a.corpus)
    suggesters[f"ngram-{model.order}"] = model
    suggesters[f"ngram-{model.order} + cache"] = CachedKeyboard(model, a.ngram_cache_weight, a.ngram_follow_weight)
    rows = keyboard_rows(evaluate_keyboards(suggesters, projects))
    cpu = cpu_info(threads)
    ngram_line = (f"n-gram keyboard: interpolated Kneser-Ney, order {model.order} (chosen on dev projects), "
                  f"{len(model.vocab):,} tokens, n-grams of count >= {model.info.get('min_count')}, "
                  f"{model.ngrams:,} n-grams, {size:,} bytes on disk; + cache: the words typed before, weight "
                  f"{a.ngram_cache_weight:g}, and after the same word and link, {a.ngram_follow_weight:g}")
    where = "held-out projects" if a.keyboard_split == "val" else f"the {a.keyboard_split} split's projects"
    table = (f"Keyboard on {where} ({sum(len(t) for p in projects for t in p.texts):,} characters; "
             f"identifier words; 3 suggestions):\n{describe_cpu(cpu)}\n{ngram_line}\n\n" + render_keyboard(rows))
    print(table)
    if out:
        record = {"corpus": a.corpus, "split": a.keyboard_split, "cpu": cpu,
                  "ngram": {"path": str(a.ngram or out / NGRAM_FILE), "bytes": size, "order": model.order,
                            "vocab": len(model.vocab), "ngrams": model.ngrams, "cache_weight": a.ngram_cache_weight,
                            "follow_weight": a.ngram_follow_weight}
                  | model.info, "rows": rows}
        atomic_write_text(out / "keyboard.json", json.dumps(record, indent=2) + "\n")
        atomic_write_text(out / "keyboard.md", table)
    return 0
