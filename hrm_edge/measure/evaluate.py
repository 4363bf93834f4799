"""Held-out evaluation: bits per byte of checkpoints on projects none of them trained on, at full depth and
with one outer cycle (the depth dial), next to `xz -9` compressing each file on its own; and completions of
held-out code.

    python -m hrm_edge.evaluate hrm_edge/default_model                       # the shipped model
    python -m hrm_edge.evaluate runs/default OLD_CHECKPOINT --out runs/eval  # several checkpoints, one table
    python -m hrm_edge.evaluate hrm_edge/default_model --samples 3           # plus completions of held-out code
    python -m hrm_edge.evaluate hrm_edge/default_model --keyboard --out runs/keyboard  # 3-word bar vs an n-gram

The text is the validation split of the pinned PyPI corpus (python -m hrm_edge.corpus): whole projects the
corpus holds out of training. Bits per byte do not depend on the tokenizer, so checkpoints with different
tokenizers compare on the same bytes: each project's files are concatenated (each followed by EOS), cut
into windows of --seq-len + 1 tokens that overlap by one token (every token but the first is predicted once,
with up to --seq-len tokens of context), and bpb = total next-token loss in bits / total UTF-8 bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hrm_edge.app.shared_weights import page_form
from hrm_edge.errors import ArgumentParser, UserError, run_cli
from hrm_edge.io import (atomic_write_text, check_writable_dir, check_writable_file, flags_given, path_arg,
                         refuse_flags, refuse_out_of_range, refuse_unused, removed_if_failed, sha256_file, text_arg)
from hrm_edge.measure.keyboard import KEYBOARD_CHARS, PIECE_CHARS, cut_texts, run_keyboard, spread_texts
from hrm_edge.measure.ngram import CACHE_WEIGHT, FOLLOW_WEIGHT
from hrm_edge.model.checkpoint import TOKENIZER, check_checkpoint, load_model
from hrm_edge.runtime.manifest import MANIFEST, read_manifest, verify_files
from hrm_edge.runtime.suggest import graphs_beside
from hrm_edge.runtime.decoders import Sampling, generate
from hrm_edge.train.dataset import encode_documents, heldout_projects, xz_bits_per_byte
from hrm_edge.train.tokenizer import load_tokenizer


@dataclass
class ProjectText:
    name: str
    texts: list[str]

    @property
    def bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.texts)


def heldout_texts(corpus: str, max_bytes: int) -> list[ProjectText]:
    """The held-out projects, each cut to its first files up to max_bytes (whole files; at least one)."""
    out = []
    for project, docs in sorted(heldout_projects(corpus).items()):
        texts, n = [], 0
        for _, text in docs:
            if texts and n + len(text.encode("utf-8")) > max_bytes:
                break
            texts.append(text)
            n += len(text.encode("utf-8"))
        out.append(ProjectText(project, texts))
    return out


def project_bits(model, tok, texts: list[str], seq_len: int, n_cycles: int | None, batch_size: int = 8) -> float:
    """Total next-token loss in bits of one project's text (each file followed by EOS)."""
    import torch  # the model's runtime: imported when a checkpoint is evaluated, not for --help

    stream = encode_documents(tok, texts).astype(np.int64)
    starts = range(0, max(len(stream) - 1, 1), seq_len)
    windows = [stream[s : s + seq_len + 1] for s in starts]  # the last one may be shorter
    nats = 0.0
    with torch.no_grad():
        for w in windows:
            if len(w) < 2:
                continue
            x = torch.from_numpy(w[None, :-1])
            logits = model(x, n_cycles=n_cycles)
            nats += torch.nn.functional.cross_entropy(logits[0], torch.from_numpy(w[1:]), reduction="sum").item()
    return nats / math.log(2)


def evaluate_checkpoint(checkpoint: Path, projects: list[ProjectText], seq_len: int, log=print) -> dict:
    """{project: {"full": bpb, "1_cycle": bpb}} of one checkpoint (1_cycle only for an HRM with H > 1)."""
    model = load_model(checkpoint)
    tok = load_tokenizer(checkpoint / TOKENIZER)
    depths = {"full": None}
    if model.cfg.arch == "hrm" and model.cfg.H_cycles > 1:
        depths["1_cycle"] = 1
    seq_len = min(seq_len, model.cfg.max_seq_len)
    result = {}
    for p in projects:
        result[p.name] = {name: project_bits(model, tok, p.texts, seq_len, k) / p.bytes for name, k in depths.items()}
        log(f"  {checkpoint.name:<16} {p.name:<16} " + "  ".join(f"{k} {v:.3f}" for k, v in result[p.name].items()))
    return result


def summary_rows(projects: list[ProjectText], results: dict) -> list[dict]:
    """One row per project (and 'all': byte-weighted): xz -9 and every checkpoint's bpb at each depth."""
    rows, total = [], sum(p.bytes for p in projects)
    for p in projects:
        rows.append({"project": p.name, "bytes": p.bytes, "files": len(p.texts), "xz_9": xz_bits_per_byte(p.texts)}
                    | {f"{ck}:{depth}": bpb for ck, r in results.items() for depth, bpb in r[p.name].items()})
    keys = [k for k in rows[0] if k not in ("project", "bytes", "files")]
    rows.append({"project": "all", "bytes": total, "files": sum(r["files"] for r in rows)}
                | {k: sum(r[k] * r["bytes"] for r in rows) / total for k in keys})
    return rows


def render_rows(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k not in ("project", "bytes", "files")]
    lines = ["| project | files | bytes | " + " | ".join(keys) + " |", "|---|---:|---:|" + "---:|" * len(keys)]
    for r in rows:
        lines.append(f"| {r['project']} | {r['files']} | {r['bytes']:,} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def completions(checkpoint: Path, projects: list[ProjectText], n: int, prompt_tokens: int = 48,
                new_tokens: int = 48) -> list[dict]:
    """Greedy and sampled (temperature 0.8, top-k 40) continuations of the first prompt_tokens of the first
    file of n held-out projects."""
    from hrm_edge.model.eager import EagerDecoder  # torch

    model, tok = load_model(checkpoint), load_tokenizer(checkpoint / TOKENIZER)
    out = []
    for p in projects[:n]:
        prompt = tok.encode(p.texts[0], add_special_tokens=False).ids[:prompt_tokens]
        sample = {}
        for name, s in (("greedy", Sampling()), ("sampled", Sampling(temperature=0.8, top_k=40, seed=1))):
            sample[name] = tok.decode(generate(EagerDecoder(model), prompt, new_tokens, s).tokens)
        out.append({"project": p.name, "prompt": tok.decode(prompt)} | sample)
    return out


def check_inputs(a: argparse.Namespace) -> None:
    """What every mode reads and writes, checked before minutes of n-gram training or held-out text."""
    if not 0 <= a.threads <= 256:
        raise UserError("--threads must be in 0..256")
    if a.depth_curve and len(a.checkpoints) > 1:  # it ran on the first and said nothing of the others
        raise UserError("--depth-curve measures one checkpoint: give one")
    for checkpoint in a.checkpoints:
        check_checkpoint(checkpoint)
    if a.out:
        check_writable_dir(a.out)  # before the evaluation, whose files go there
    if a.ngram and not a.ngram.exists():  # trained and saved there
        check_writable_file(a.ngram)


def refuse_unread(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The bits-per-byte flags that an "instead:" mode does not read: a user error, not ignored without a word."""
    bpb_flags = ("--max-bytes", "--seq-len", "--samples")
    for flag, unread in (("--keyboard", bpb_flags), ("--repetition", bpb_flags), ("--depth-curve", ("--samples",))):
        if getattr(a, flag[2:].replace("-", "_")) not in (None, False):
            refuse_flags(flags_given(p, a, unread), (f"does not apply with {flag}", f"do not apply with {flag}"))


def parser() -> ArgumentParser:
    """The command's flags: the bits-per-byte evaluation's, then each "instead:" mode's."""
    p = ArgumentParser(prog="python -m hrm_edge.evaluate", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", type=path_arg, nargs="+", help="checkpoint folders (config.json, model.safetensors, "
                                                               "tokenizer.json)")
    p.add_argument("--corpus", type=text_arg,
                   default="pypi", help="a built corpus (default: pypi, python -m hrm_edge.corpus)")
    p.add_argument("--max-bytes", type=int, default=200_000,
                   help="text per held-out project: its first whole files up to this many bytes (default 200000)")
    p.add_argument("--seq-len", type=int, default=256, help="context per window, at most each model's (default 256)")
    p.add_argument("--samples", type=int, default=0, help="also print completions of this many held-out files")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's; --keyboard: 1)")
    p.add_argument("--out", type=path_arg, help="write evaluation.json and evaluation.md into this folder")
    mode = p.add_mutually_exclusive_group()  # each "instead:" is its own evaluation
    mode.add_argument("--depth-curve", action="store_true",
                   help="instead: adaptive depth's trade-off (exit rate, bpb, eager decode speed per halting rule and "
                        "threshold) of the first checkpoint; --out gets depth_curve.json/.md (hrm_edge.measure.adaptive)")
    mode.add_argument("--keyboard", action="store_true", help="instead: the 3-word keyboard evaluation of the "
                   "checkpoints next to a word n-gram keyboard (docs/keyboard-evaluation.md); writes keyboard.json, "
                   "keyboard.md and the n-gram's file into --out")
    p.add_argument("--keyboard-chars", type=int, default=KEYBOARD_CHARS,
                   help=f"--keyboard: characters typed per held-out project (default {KEYBOARD_CHARS}; spread: in "
                        f"pieces of {PIECE_CHARS} from the middles of equal stretches of its files)")
    p.add_argument("--keyboard-sample", choices=("spread", "start"), default="spread",
                   help="--keyboard: where each project's text comes from: pieces spread over its files (default), "
                        "or its first files from their start (the measure before 2026-12-03, dominated by a "
                        "project's first files: a Sphinx conf.py, an __init__.py of imports)")
    p.add_argument("--keyboard-split", choices=("val", "calib"), default="val",
                   help="--keyboard: the split typed: the held-out projects (val, default), or the calibration "
                        "split's documents (calib: text neither the model nor the n-gram trained on, from other "
                        "projects than the held-out ones; where the suggestion algorithm's choices are measured)")
    p.add_argument("--ngram", type=path_arg, help="--keyboard: the n-gram keyboard's file, loaded if it exists, else "
                   "trained on the corpus's training split and saved there (default: OUT/keyboard-ngram.npz)")
    p.add_argument("--ngram-cache-weight", type=float, default=CACHE_WEIGHT, help="--keyboard: the share of the "
                   f"n-gram keyboard's cache of the words already typed, in its row '+ cache' (default {CACHE_WEIGHT}, "
                   "chosen on the calib split)")
    p.add_argument("--ngram-follow-weight", type=float, default=FOLLOW_WEIGHT, help="--keyboard: the share in that "
                   "row of the words typed right after the same word and link as the cursor's (default "
                   f"{FOLLOW_WEIGHT}, chosen on the calib split; the two shares add up to at most 1)")
    p.add_argument("--keyboard-graph", type=path_arg, help="--keyboard: suggest through this exported KV graph (e.g. "
                   "the page's EXPORT/hrm.int8-nbits.kv.onnx) instead of the eager checkpoint (one checkpoint); the "
                   "words are extended by the .branch.onnx graph beside it (else the .draft.onnx) when there is one, "
                   "as on the page")
    p.add_argument("--keyboard-page-form", action="store_true", help="--keyboard-graph: run the graphs as the demo "
                   "serves them to the page (8-bit MatMulNBits as float MatMuls over the same 8-bit weights, which is "
                   "what the page computes; hrm_edge/app/shared_weights.py)")
    mode.add_argument("--repetition", metavar="PENALTIES",
                   help="instead: how often continuations of held-out code repeat themselves at these repetition "
                        "penalties, e.g. 1,1.1,1.2 (hrm_edge.measure.repetition)")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    refuse_unused(p, a, ("--keyboard-chars", "--keyboard-sample", "--keyboard-split", "--ngram", "--ngram-cache-weight",
                         "--ngram-follow-weight", "--keyboard-graph", "--keyboard-page-form"), "--keyboard")
    refuse_unread(p, a)
    refuse_out_of_range(("--max-bytes", a.max_bytes, a.max_bytes >= 1, ">= 1"),
                        ("--seq-len", a.seq_len, a.seq_len >= 2, ">= 2"), ("--samples", a.samples, a.samples >= 0, ">= 0"))
    with removed_if_failed(a.out) if a.out else contextlib.nullcontext():  # a new --out of a refused run: removed
        check_inputs(a)
        return run_mode(a)


def run_mode(a: argparse.Namespace) -> int:
    """The evaluation `a` asks for, its inputs checked: bits per byte (the default), or an "instead:" mode."""
    if a.repetition is not None:
        from hrm_edge.measure.repetition import run_repetition  # generation on top of evaluation: its own module

        return run_repetition(a)
    names = [c.resolve().name if c.name in ("", ".") else c.name for c in a.checkpoints]
    if len(set(names)) != len(names):
        raise UserError(f"two checkpoints share the folder name {names}: give each its own name")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.keyboard:
        return keyboard(a, names)
    projects = heldout_texts(a.corpus, a.max_bytes)
    print(f"{len(projects)} held-out projects, {sum(p.bytes for p in projects):,} bytes")
    if a.depth_curve:
        from hrm_edge.measure.adaptive import run_depth_curve  # torch, as the model's runtime above

        return run_depth_curve(a.checkpoints[0], projects, a.seq_len, a.out)
    results = {name: evaluate_checkpoint(c, projects, a.seq_len) for name, c in zip(names, a.checkpoints)}
    rows = summary_rows(projects, results)
    table = "Bits per byte on held-out projects (lower is better; xz_9: each file compressed on its own):\n\n" + render_rows(rows)
    samples = completions(a.checkpoints[0], projects, a.samples) if a.samples else []
    for s in samples:
        table += f"\n### {s['project']}\n\nprompt:\n```python\n{s['prompt']}\n```\ngreedy:\n```python\n{s['greedy']}\n```\n" \
                 f"sampled (temperature 0.8, top-k 40):\n```python\n{s['sampled']}\n```\n"
    print(table)
    if a.out:
        record = {"corpus": a.corpus, "max_bytes": a.max_bytes, "seq_len": a.seq_len,
                  "checkpoints": [str(c) for c in a.checkpoints], "rows": rows, "samples": samples}
        atomic_write_text(a.out / "evaluation.json", json.dumps(record, indent=2) + "\n")
        atomic_write_text(a.out / "evaluation.md", table)
    return 0


def check_keyboard_graph(graph: Path, checkpoint: Path) -> None:
    """--keyboard-graph and the graphs beside it that extend the words, checked against their export's manifest
    (sha256), and that export's tokenizer against the checkpoint's, whose words are read with it."""
    if not (graph.parent / MANIFEST).is_file():
        raise UserError(f"--keyboard-graph {graph}: no {MANIFEST} beside it; give a graph in its export folder (its "
                        "sha256 is checked there)")
    manifest = read_manifest(graph.parent)
    beside = [g.name for g in graphs_beside(graph) or () if g.is_file()]
    verify_files(graph.parent, manifest, [graph.name] + beside)
    if sha256_file(checkpoint / TOKENIZER) != manifest["tokenizer"]["sha256"]:
        raise UserError(f"--keyboard-graph {graph} was exported with another tokenizer than {checkpoint}'s")


def keyboard(a: argparse.Namespace, names: list[str]) -> int:
    """--keyboard: the suggestion bar on held-out projects against the n-gram keyboard (hrm_edge.measure.keyboard)."""
    refuse_out_of_range(("--keyboard-chars", a.keyboard_chars, a.keyboard_chars >= 1, ">= 1"),
                        ("--ngram-cache-weight", a.ngram_cache_weight, 0 <= a.ngram_cache_weight <= 1, "in [0, 1]"),
                        ("--ngram-follow-weight", a.ngram_follow_weight, 0 <= a.ngram_follow_weight <= 1, "in [0, 1]"))
    if a.ngram_cache_weight + a.ngram_follow_weight > 1:
        raise UserError(f"--ngram-cache-weight and --ngram-follow-weight add up to more than 1 "
                        f"({a.ngram_cache_weight:g} + {a.ngram_follow_weight:g})")
    if a.keyboard_graph and (len(a.checkpoints) != 1 or not a.keyboard_graph.is_file()
                             or not a.keyboard_graph.name.endswith((".kv.onnx", ".kv.ort"))):
        raise UserError("--keyboard-graph takes one checkpoint and an existing KV graph (*.kv.onnx or *.kv.ort)")
    if a.keyboard_page_form and not (a.keyboard_graph and a.keyboard_graph.name.endswith(".kv.onnx")):
        raise UserError("--keyboard-page-form needs --keyboard-graph with an ONNX KV graph (*.kv.onnx)")
    if a.keyboard_graph:
        check_keyboard_graph(a.keyboard_graph, a.checkpoints[0])
    sample = spread_texts if a.keyboard_sample == "spread" else cut_texts
    projects = [ProjectText(name, sample([t for _, t in docs], a.keyboard_chars))
                for name, docs in sorted(heldout_projects(a.corpus, a.keyboard_split).items())]
    with tempfile.TemporaryDirectory(prefix="hrm-page-form.") as tmp:  # the page's form of the graphs, if asked for
        graph = page_form(a.keyboard_graph, Path(tmp)) if a.keyboard_page_form else a.keyboard_graph
        return run_keyboard(a, dict(zip(names, a.checkpoints)), projects, graph)
