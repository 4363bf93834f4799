"""Adaptive depth's trade-off curve: `python -m hrm_edge.evaluate CHECKPOINT --depth-curve [--out DIR]`.

A token may exit after the first outer cycle when a halting rule's score reaches a threshold: the top probability of
that cycle's readout, or the checkpoint's halting head (python -m hrm_edge.train --halting-head CHECKPOINT). For
each rule and threshold: the share of held-out tokens that exit and the held-out bits per byte, exact (teacher
forced, all positions of a window in one pass: hrm_edge.model.lm.adaptive_forward's pieces), against full depth;
and eager greedy decode speed on held-out prompts, 1 thread, EagerAdaptiveDecoder against EagerDecoder. Per rule,
the default threshold is the most-exiting one whose bpb is at most MAX_BPB_RATIO x full depth's.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_text
from hrm_edge.model.checkpoint import HALTING, TOKENIZER, load_halting_head, load_model
from hrm_edge.model.eager import EagerAdaptiveDecoder, EagerDecoder
from hrm_edge.model.lm import HaltingRule, adaptive_logits, check_adaptive, run_first_cycle
from hrm_edge.runtime.decoders import generate
from hrm_edge.train.dataset import encode_documents
from hrm_edge.train.tokenizer import load_tokenizer

THRESHOLDS = {"top_prob": (0.4, 0.5, 0.6, 0.7, 0.8, 0.9), "halting_head": (0.85, 0.9, 0.93, 0.95, 0.97)}
MAX_BPB_RATIO = 1.005  # the default threshold's allowance over full depth's bits per byte
PROMPT_TOKENS, NEW_TOKENS = 48, 48  # decode speed: greedy continuations of each held-out project's first file


@dataclass
class CurvePoint:
    rule: str  # "full" (nothing exits), "top_prob" or "halting_head"
    threshold: float | None
    exit_rate: float  # held-out tokens that exit after the first cycle (teacher forced)
    bpb: float
    bpb_ratio: float  # bpb / full depth's
    tokens_per_s: float = 0.0  # eager greedy decode, 1 thread
    speedup: float = 0.0  # tokens_per_s / full depth's
    decode_exit_rate: float = 0.0  # decoded tokens that exited (on the model's own greedy text)


def windows_of(stream: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of seq_len + 1 tokens overlapping by one (as hrm_edge.measure.evaluate cuts a project)."""
    return [w for w in (stream[s : s + seq_len + 1] for s in range(0, max(len(stream) - 1, 1), seq_len)) if len(w) >= 2]


def curve_bits(model, rules: dict, windows: list[np.ndarray], batch_size: int = 8) -> dict:
    """{(rule, threshold): [bits, exited tokens]} over the windows, ("full", None) included; rules: {name: head or
    None}. The first cycle runs once per batch; each threshold reruns only the deeper cycles."""
    totals: dict = {("full", None): [0.0, 0]} | {(r, t): [0.0, 0] for r in rules for t in THRESHOLDS[r]}
    by_len: dict = {}
    for w in windows:  # a batch holds windows of one length (each project's last one is shorter)
        by_len.setdefault(len(w), []).append(w)
    batches = [same[i : i + batch_size] for same in by_len.values() for i in range(0, len(same), batch_size)]
    with torch.no_grad():
        for batch in batches:
            tokens = torch.from_numpy(np.stack(batch).astype(np.int64))  # [B, S + 1]
            first = run_first_cycle(model, tokens[:, :-1])
            exits = {("full", None): torch.zeros(first.logits.shape[:2], dtype=torch.bool)}
            for name, head in rules.items():
                scores = HaltingRule(1.0, head).scores(model, first.output_state(model), first.logits)  # [B, S]
                exits |= {(name, t): scores >= t for t in THRESHOLDS[name]}
            for key, exited in exits.items():
                logits = adaptive_logits(model, first, exited)  # [B, S, V]
                nats = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").item()
                totals[key][0] += nats / math.log(2)
                totals[key][1] += int(exited.sum())
    return totals


def decode_speeds(model, prompts: list[list[int]], rules: list) -> list[tuple[float, float]]:
    """Per rule (None: full depth): (decode tokens/s, share of decoded tokens that exited) of greedy generation from
    each prompt, after a warm-up. Round-robin over the rules, prompt by prompt, so that a shared machine's changing
    load falls on every rule alike."""
    decoders = [EagerDecoder(model) if r is None else EagerAdaptiveDecoder(model, r) for r in rules]
    for decoder in decoders:
        generate(decoder, prompts[0], 8)  # warm-up
    steps, seconds, exited = np.zeros(len(rules)), np.zeros(len(rules)), np.zeros(len(rules))
    for prompt in prompts:
        for i, (decoder, rule) in enumerate(zip(decoders, rules)):
            g = generate(decoder, prompt, NEW_TOKENS)
            steps[i], seconds[i] = steps[i] + len(g.tokens) - 1, seconds[i] + g.decode_s
            exited[i] += decoder.depths.count(1) if rule is not None else 0
    return [(float(n / s), float(e / max(n, 1))) for n, s, e in zip(steps, seconds, exited)]


def pick_default(points: list[CurvePoint], rule: str) -> CurvePoint | None:
    """The most-exiting threshold of `rule` whose bpb is within MAX_BPB_RATIO of full depth's."""
    ok = [p for p in points if p.rule == rule and p.bpb_ratio <= MAX_BPB_RATIO]
    return max(ok, key=lambda p: (p.exit_rate, -p.threshold)) if ok else None


def depth_curve(checkpoint: Path, projects: list, seq_len: int, log=print) -> dict:
    """The curve of one checkpoint over held-out projects (hrm_edge.measure.evaluate.ProjectText)."""
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint / TOKENIZER)
    try:
        check_adaptive(model.cfg)
    except ValueError as e:
        raise UserError(f"--depth-curve: {e}") from None
    rules = {"top_prob": None}
    if (checkpoint / HALTING).is_file():
        rules["halting_head"] = load_halting_head(checkpoint, model.cfg.d_model)
    else:
        log(f"no {HALTING}: top_prob only (train a head with python -m hrm_edge.train --halting-head {checkpoint})")
    seq_len = min(seq_len, model.cfg.max_seq_len)
    windows = [w for p in projects for w in windows_of(encode_documents(tok, p.texts), seq_len)]
    n_tokens, n_bytes = sum(len(w) - 1 for w in windows), sum(p.bytes for p in projects)
    log(f"bits per byte of {n_tokens:,} held-out tokens ({n_bytes:,} bytes) at each threshold ...")
    totals = curve_bits(model, rules, windows)
    full_bpb = totals[("full", None)][0] / n_bytes
    points = [CurvePoint(r, t, exited / n_tokens, bits / n_bytes, bits / n_bytes / full_bpb)
              for (r, t), (bits, exited) in totals.items()]
    prompts = [tok.encode(p.texts[0], add_special_tokens=False).ids[:PROMPT_TOKENS] for p in projects]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    log(f"eager greedy decode speed, 1 thread, {len(prompts)} prompts x {NEW_TOKENS} tokens ...")
    try:
        speeds = decode_speeds(model, prompts, [None if p.rule == "full" else HaltingRule(p.threshold, rules[p.rule])
                                                for p in points])
        for p, (tokens_per_s, exit_rate) in zip(points, speeds):
            p.tokens_per_s, p.decode_exit_rate, p.speedup = tokens_per_s, exit_rate, tokens_per_s / speeds[0][0]
    finally:
        torch.set_num_threads(threads)
    defaults = {r: (asdict(d) if (d := pick_default(points, r)) else None) for r in rules}
    return {"checkpoint": str(checkpoint), "tokens": n_tokens, "bytes": n_bytes, "seq_len": seq_len,
            "max_bpb_ratio": MAX_BPB_RATIO, "points": [asdict(p) for p in points], "defaults": defaults}


def render_curve(record: dict) -> str:
    lines = [f"Adaptive depth (exit after the first outer cycle) on {record['tokens']:,} held-out tokens; decode: eager, "
             f"greedy, 1 thread.\n",
             "| rule | threshold | exit rate | bpb | vs full | decode tokens/s | vs full | decode exit rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in record["points"]:
        threshold = "–" if p["threshold"] is None else f"{p['threshold']:g}"
        lines.append(f"| {p['rule']} | {threshold} | {p['exit_rate']:.1%} | {p['bpb']:.4f} | {p['bpb_ratio']:.4f} | "
                     f"{p['tokens_per_s']:.0f} | {p['speedup']:.2f}x | {p['decode_exit_rate']:.1%} |")
    lines.append(f"\nDefault threshold (most exits with bpb <= {record['max_bpb_ratio']} x full depth):")
    for rule, d in record["defaults"].items():
        lines.append(f"- {rule}: " + (f"{d['threshold']:g} ({d['exit_rate']:.1%} exit, bpb x{d['bpb_ratio']:.4f}, "
                                      f"decode {d['speedup']:.2f}x)" if d else "none within the allowance"))
    return "\n".join(lines) + "\n"


def run_depth_curve(checkpoint: Path, projects: list, seq_len: int, out: Path | None) -> int:
    """evaluate --depth-curve: print the curve; with out, write depth_curve.json and depth_curve.md there."""
    record = depth_curve(checkpoint, projects, seq_len)
    table = render_curve(record)
    print(table)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "depth_curve.json", json.dumps(record, indent=2) + "\n")
        atomic_write_text(out / "depth_curve.md", table)
    return 0
