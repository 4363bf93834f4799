"""How often continuations of held-out code repeat themselves, per repetition penalty: what the clients' default
(hrm_edge.runtime.healing.DEFAULT_REPETITION_PENALTY) is chosen from.

    python -m hrm_edge.evaluate hrm_edge/default_model --repetition 1,1.1,1.2,1.3

Prompts: in each held-out project's files (the corpus's validation split), the text up to and including a
`def` / `class` header line (the completion point where a model that loops, or stops, shows it), with up to
PROMPT_BYTES before it. Each prompt is healed (as every client does) and continued for 64 tokens (`new_tokens`)
greedily and sampled (temperature 0.8, top-k 40, as the completions of `--samples`). Per penalty:

    4-gram repeats   of a continuation's token 4-grams, the fraction equal to an earlier 4-gram of the same
                     continuation (a loop repeats nearly all of them; real code repeats some: the "held-out text"
                     row is the files' own next tokens)
    repeated lines   of its non-blank lines, the fraction equal (stripped) to an earlier line of the same
                     continuation
    bits/token       quality: the penalised distribution's loss on the files' real next tokens (teacher forced;
                     real code repeats identifiers, so a strong penalty makes it worse)
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_text
from hrm_edge.model.checkpoint import TOKENIZER, load_model
from hrm_edge.runtime.decoders import Sampling, generate
from hrm_edge.runtime.healing import heal_prompt, penalize_repetition, token_bytes
from hrm_edge.train.dataset import heldout_projects
from hrm_edge.train.tokenizer import load_tokenizer

NGRAM = 4
PROMPT_BYTES = 600  # context before the header line (whole lines)
MAX_PROMPT_TOKENS = 160  # and at most this many tokens of it: the shipped model's context is 256
PROMPTS_PER_PROJECT = 4
SETTINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_k=40, seed=1)}
HEADER = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t].*:[ \t]*\n", re.M)


@dataclass
class Prompt:
    text: str  # ends in a def / class header line and its "\n"
    truth: str  # the file's text after it


def header_prompts(text: str, n: int) -> list[Prompt]:
    """Up to n prompts of one file: the text through each of its first n def / class header lines (after the
    first PROMPT_BYTES // 2 bytes, so that there is context), cut to whole lines within PROMPT_BYTES before it."""
    out = []
    for m in HEADER.finditer(text, PROMPT_BYTES // 2):
        start = text.find("\n", max(m.end() - PROMPT_BYTES, 0)) + 1 if m.end() > PROMPT_BYTES else 0
        out.append(Prompt(text[start: m.end()], text[m.end():]))
        if len(out) == n:
            break
    return out


def heldout_prompts(projects: dict[str, list[tuple[str, str]]], per_project: int = PROMPTS_PER_PROJECT) -> list[Prompt]:
    """Prompts from every project (heldout_projects' {project: [(path, text)]}): one per file, files in path
    order, up to per_project."""
    out = []
    for _, docs in sorted(projects.items()):
        found = [p for _, text in sorted(docs) for p in header_prompts(text, 1)]
        out += found[:per_project]
    return out


def ngram_repeats(tokens: list[int], n: int = NGRAM) -> tuple[int, int]:
    """(n-grams equal to an earlier n-gram of the same sequence, n-grams)."""
    seen, repeated = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i: i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated, max(len(tokens) - n + 1, 0)


def line_repeats(text: str) -> tuple[int, int]:
    """(non-blank lines equal, stripped, to an earlier line of the text, non-blank lines); the last line only
    when the text ends it (a cut-off line is not a line yet)."""
    lines = [s.strip() for s in text.split("\n")[:-1] if s.strip()]
    return len(lines) - len(set(lines)), len(lines)


def truth_bits(model, ids: list[int], prompt_len: int, penalty: float) -> tuple[float, int]:
    """(bits, tokens) of ids[prompt_len:] under the penalised next-token distribution, teacher forced."""
    import torch  # the model's runtime

    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0].double().numpy()  # [S - 1, V]
    bits = 0.0
    for i in range(prompt_len, len(ids)):
        z = penalize_repetition(logits[i - 1], ids[:i], penalty)
        bits += (np.logaddexp.reduce(z) - z[ids[i]]) / math.log(2)
    return bits, len(ids) - prompt_len


def measure_penalty(model, tok, prompts: list[Prompt], penalty: float, new_tokens: int, threads: int) -> dict:
    """One row: repeat rates of the greedy and sampled continuations and the bits/token of the real ones."""
    from hrm_edge.model.eager import EagerDecoder  # torch

    vocab_bytes = token_bytes(tok)
    counts = {}
    bits = tokens = 0
    for p in prompts:
        ids = tok.encode(p.text, add_special_tokens=False).ids
        cut = max(len(ids) - MAX_PROMPT_TOKENS, 0)
        whole = tok.encode(p.text + p.truth, add_special_tokens=False).ids[cut: len(ids) + new_tokens]
        ids = ids[cut:]
        context, heal = heal_prompt(ids, vocab_bytes)
        for name, s in SETTINGS.items():
            s = Sampling(s.temperature, s.top_k, s.top_p, s.seed, penalty)
            new = generate(EagerDecoder(model, threads), context, new_tokens, s, heal=heal).tokens
            text = b"".join(vocab_bytes[t] for t in new)[len(heal.prefix) if heal else 0:].decode("utf-8", "replace")
            add_counts(counts, name, ngram_repeats(new), line_repeats(text))
        b, n = truth_bits(model, whole, len(ids), penalty)
        bits, tokens = bits + b, tokens + n
    return {"penalty": penalty, **rates(counts), "bits_per_token": bits / tokens}


def add_counts(counts: dict, name: str, ngrams: tuple[int, int], lines: tuple[int, int]) -> None:
    for key, (repeated, total) in ((f"{name}_4gram", ngrams), (f"{name}_lines", lines)):
        r, t = counts.get(key, (0, 0))
        counts[key] = (r + repeated, t + total)


def rates(counts: dict) -> dict:
    return {k: r / t if t else 0.0 for k, (r, t) in counts.items()}


def heldout_row(tok, prompts: list[Prompt], new_tokens: int) -> dict:
    """The files' own next new_tokens tokens after each prompt, counted the same way (what real code repeats)."""
    vocab_bytes, counts = token_bytes(tok), {}
    for p in prompts:
        ids = tok.encode(p.text, add_special_tokens=False).ids  # the real text's tokens after len(ids) - 1
        new = tok.encode(p.text + p.truth, add_special_tokens=False).ids[len(ids): len(ids) + new_tokens]
        text = b"".join(vocab_bytes[t] for t in new).decode("utf-8", "replace")
        add_counts(counts, "text", ngram_repeats(new), line_repeats(text))
    return rates(counts)


def render(rows: list[dict], reference: dict, n_prompts: int, new_tokens: int) -> str:
    lines = [f"Repetition in continuations of {n_prompts} held-out prompts ({new_tokens} new tokens; healed):\n",
             "| penalty | greedy 4-gram repeats | greedy repeated lines | sampled 4-gram repeats | "
             "sampled repeated lines | bits/token of the real text |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['penalty']:g} | {r['greedy_4gram']:.1%} | {r['greedy_lines']:.1%} | "
                     f"{r['sampled_4gram']:.1%} | {r['sampled_lines']:.1%} | {r['bits_per_token']:.3f} |")
    lines.append(f"| held-out text | {reference['text_4gram']:.1%} | {reference['text_lines']:.1%} | | | |")
    return "\n".join(lines) + "\n"


def measure_repetition(model, tok, projects: dict, penalties: list[float], new_tokens: int = 64,
                       threads: int = 0, log=print) -> tuple[list[dict], str]:
    """(one row per penalty, the markdown table) for the held-out projects {project: [(path, text)]}."""
    prompts = heldout_prompts(projects)
    rows = []
    for penalty in penalties:
        rows.append(measure_penalty(model, tok, prompts, penalty, new_tokens, threads))
        log(f"  penalty {penalty:g}: " + "  ".join(f"{k} {v:.3f}" for k, v in rows[-1].items() if k != "penalty"))
    return rows, render(rows, heldout_row(tok, prompts, new_tokens), len(prompts), new_tokens)


def parse_penalties(text: str) -> list[float]:
    """"1,1.1,1.2" -> [1.0, 1.1, 1.2]; a ValueError for anything else or a penalty outside [1, 10]."""
    values = [float(v) for v in text.split(",")]
    if not values or not all(1 <= v <= 10 for v in values):
        raise ValueError(text)
    return values


def run_repetition(a) -> int:
    """`python -m hrm_edge.evaluate CHECKPOINT --repetition PENALTIES` (its parsed arguments): the first
    checkpoint's table on the corpus's held-out projects; with --out, repetition.json and repetition.md there."""
    try:
        penalties = parse_penalties(a.repetition)
    except ValueError:
        raise UserError(f"--repetition takes penalties in [1, 10] separated by commas (e.g. 1,1.1,1.2), "
                        f"not {a.repetition!r}") from None
    model, tok = load_model(a.checkpoints[0]), load_tokenizer(a.checkpoints[0] / TOKENIZER)
    rows, table = measure_repetition(model, tok, heldout_projects(a.corpus), penalties, threads=a.threads)
    print(table)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        record = {"corpus": a.corpus, "checkpoint": str(a.checkpoints[0]), "rows": rows}
        atomic_write_text(a.out / "repetition.json", json.dumps(record, indent=2) + "\n")
        atomic_write_text(a.out / "repetition.md", table)
    return 0
