"""Study: what a looped, hierarchical model costs and buys, measured on our data.

    python -m hrm_edge.study --budget quick --out runs/study-quick      # CI: a few minutes
    python -m hrm_edge.study --budget full --out runs/study --threads 1 # docs/measurements.md's table (GPU: minutes)

Trains, on the same data, tokenizer, token budget (steps x batch x seq_len) and seed: a 4-layer unshared
Transformer (the reference), HRM-LM with about a quarter of its parameters, an unshared Transformer with
as many layers as HRM-LM has block applications (equal compute per token), and ablations of HRM-LM (no
hierarchy, no gating, no step embedding, slow-gate bias 0, other cycle counts). Reports unique parameters,
validation perplexity and bits per byte, training tokens/s and time per epoch, and decode tokens/s of
each main model's int8 KV-cache ExecuTorch program (the one `python -m hrm_edge.export` ships), then
checks the issue's goals and says whether they were met.

Writes DIR/NAME/ (checkpoint, result.json, int8 .pte), DIR/study.json (every number, the command line,
versions, budget, wall times) and DIR/study.md (the table). --resume continues a killed run: finished
models are kept, an interrupted one continues from its last checkpoint.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from hrm_edge.config import DataConfig, ModelConfig, Preset, TrainConfig
from hrm_edge.errors import ArgumentParser, UserError
from hrm_edge.export.names import artifact_name
from hrm_edge.export.pipeline import versions
from hrm_edge.io import (atomic_write_text, check_writable_dir, path_arg, refuse_out_of_range, removed_if_failed,
                         sha256_file, some_names, text_arg)
from hrm_edge.measure.harness import (DecodeTiming, build_unless_current, cpu_info, decode_in_child, describe_cpu,
                                      lower_kv_pte)
from hrm_edge.quiet import quiet_third_party
from hrm_edge.model.checkpoint import CONFIG, STATE, TOKENIZER, WEIGHTS, load_model
from hrm_edge.train.dataset import check_corpus
from hrm_edge.train.tokenizer import bos_id, eos_id, load_tokenizer

DEFAULT_OUT = Path("runs/study")
RESULT = "result.json"
STUDY_CONFIG = "study_config.json"
STUDY_JSON, STUDY_TABLE = "study.json", "study.md"  # the study's results and its table
# the goals
GOAL_BPB_RATIO = 1.05  # HRM-LM bits/byte <= 1.05 x the 4-layer Transformer's ...
GOAL_PARAM_RATIO = 0.30  # ... at <= 0.3 x its unique parameters
GOAL_DECODE_RATIO = 0.95  # HRM-LM int8 decode tokens/s >= 0.95 x the equal-compute unshared model's


@dataclass
class Budget:
    """Sizes and training budget shared by every model of one study."""

    name: str
    vocab_size: int
    d_model: int  # HRM-LM and the equal-compute Transformer (same block width)
    n_heads: int
    ref_d_model: int  # the 4-layer reference: wider, so HRM-LM has about a quarter of its parameters
    ref_heads: int
    H_cycles: int
    L_cycles: int
    max_seq_len: int
    data: DataConfig
    train: TrainConfig
    # int8 .pte decode measurement: prompt, greedy tokens; rounds interleave the models (a shared machine's
    # load drifts), each round runs `repeats` generations in a fresh process and keeps their median
    decode_prompt: int
    decode_new_tokens: int
    decode_rounds: int
    decode_repeats: int


BUDGETS = {
    # CI: tiny widths, tens of steps; only the plumbing and robust directions are checked. The HRM-LM
    # here has T = 2 (H 1, L 1) because lowering an unrolled int8 HRM program to XNNPACK takes minutes at
    # T = 8 on 2 cores, and quick must measure its .pte.
    "quick": Budget(
        name="quick", vocab_size=512, d_model=32, n_heads=2, ref_d_model=64, ref_heads=4, H_cycles=1, L_cycles=1,
        max_seq_len=64,
        data=DataConfig(max_corpus_bytes=400_000, tokenizer_sample_bytes=400_000),
        train=TrainConfig(seed=1337, seq_len=64, batch_size=8, steps=40, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                          eval_every=20, eval_batches=2, checkpoint_every=40, bf16_autocast=False),
        decode_prompt=8, decode_new_tokens=32, decode_rounds=1, decode_repeats=2),
    # The README table. Vocabulary 1024, not the shipped 4096: at 4096 the tied embedding alone is 71% of
    # a d-128 HRM-LM, so "a quarter of the parameters" would mostly count embedding rows; at 1024 it is 38%
    # and the block is most of the rest. HRM-LM keeps the shipped model's block (d 128, 4 heads, H 2, L 3,
    # T 8); the 4-layer reference is d 160 (HRM-LM has 0.24x its unique parameters).
    # Data: a 12 MB slice of the pinned PyPI corpus (python -m hrm_edge.corpus), cut across its splits, so
    # validation is code of projects no model trained on. 900 steps x 16 x 128 = 1.84 M tokens per model
    # (about half an epoch of the slice: no text is seen twice).
    "full": Budget(
        name="full", vocab_size=1024, d_model=128, n_heads=4, ref_d_model=160, ref_heads=5, H_cycles=2, L_cycles=3,
        max_seq_len=256,
        data=DataConfig(corpus="pypi", max_corpus_bytes=12_000_000, tokenizer_sample_bytes=4_000_000),
        train=TrainConfig(seed=1337, seq_len=128, batch_size=16, steps=900, lr=3e-3, min_lr=3e-4, warmup_steps=50,
                          eval_every=150, eval_batches=16, checkpoint_every=150, bf16_autocast=True),
        decode_prompt=32, decode_new_tokens=128, decode_rounds=3, decode_repeats=3),
}


@dataclass
class Entry:
    name: str
    tests: str  # what this model tests, for the table
    overrides: dict = field(default_factory=dict)  # ModelConfig fields changed from the budget's HRM-LM
    role: str = "ablation"  # "reference" | "hrm" | "equal-compute" | "ablation" | "idea" (a training idea)
    # TrainConfig fields changed from the budget's recipe; "{out}" in a value is the study folder
    train_overrides: dict = field(default_factory=dict)


def hrm_fields(b: Budget) -> dict:
    # aux_loss_weight 0 (the shipped preset uses 0.3 for its depth dial): every model trains on the same
    # single next-token loss
    return dict(arch="hrm", vocab_size=b.vocab_size, d_model=b.d_model, n_heads=b.n_heads, max_seq_len=b.max_seq_len,
                H_cycles=b.H_cycles, L_cycles=b.L_cycles, aux_loss_weight=0.0)


def study_entries(b: Budget) -> list[Entry]:
    T = ModelConfig(**hrm_fields(b)).n_steps

    def cycles(H, L):
        return f"H={H}, L={L} (T={H * (L + 1)})"

    return [
        Entry("transformer-4L", f"the reference: 4 unshared blocks of width {b.ref_d_model}",
              dict(arch="transformer", n_layers=4, d_model=b.ref_d_model, n_heads=b.ref_heads), "reference"),
        Entry("hrm", f"HRM-LM: one block of width {b.d_model} applied {cycles(b.H_cycles, b.L_cycles)}, "
                     f"gated two-level state, step embedding", {}, "hrm"),
        Entry(f"transformer-{T}L", f"equal compute: one unshared block per HRM-LM block application "
                                   f"(width {b.d_model}), {T}x the block parameters",
              dict(arch="transformer", n_layers=T), "equal-compute"),
        Entry("hrm-no-hierarchy", "plain looped block: one state, every step a fast step, same T "
                                  "(what the two-level memory buys)", dict(hierarchy=False)),
        Entry("hrm-no-gating", "states replaced by the block output instead of gated updates (what the gates buy)",
              dict(gating=False)),
        Entry("hrm-no-step-emb", "no step embedding: the shared block is not told which step it is on",
              dict(use_step_embedding=False)),
        Entry("hrm-slow-bias-0", "slow gate bias 0 (starts at 0.5) instead of -2 (0.12): the conservative slow level",
              dict(slow_gate_bias=0.0)),
        Entry("hrm-H1-L7", f"{cycles(1, 7)}: one long fast phase, the slow level updated once",
              dict(H_cycles=1, L_cycles=7)),
        Entry("hrm-H4-L1", f"{cycles(4, 1)}: slow-heavy, the slow level updated every other step",
              dict(H_cycles=4, L_cycles=1)),
        Entry("hrm-H2-L1", f"{cycles(2, 1)}: fewer block applications (what iteration depth buys)",
              dict(H_cycles=2, L_cycles=1)),
        # the seed's training ideas, each on the plain HRM-LM recipe
        Entry("hrm-curriculum", f"a curriculum over iterations: 1 outer cycle for the first third of the steps "
                                f"({b.train.steps // 3}), then all {b.H_cycles}", {}, "idea",
              dict(curriculum_steps=b.train.steps // 3)),
        Entry("hrm-distill", "distillation from the 4-layer reference (trained first, same tokenizer): loss = "
                             "0.5 x next-token CE + 0.5 x KL(teacher || student)", {}, "idea",
              dict(distill_from="{out}/transformer-4L", distill_weight=0.5)),
        Entry("hrm-gate-dropout", "dropout 0.1 on the gates' inputs while training", dict(gate_dropout=0.1), "idea"),
    ]


def model_config(b: Budget, e: Entry) -> ModelConfig:
    # built from fields, not dataclasses.replace of a finished config: ffn_hidden and gate_rank are
    # derived from d_model in __post_init__ and must follow an overridden width
    return ModelConfig(**(hrm_fields(b) | e.overrides))


def _jsonable(obj) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(obj)))


def first_difference(had: dict, want: dict, where: str = "") -> tuple[str, object, object]:
    """(dotted key, value in had, value in want) of the first key, in want's order, whose values differ."""
    for key in [*want, *(k for k in had if k not in want)]:
        a, b = had.get(key), want.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                return first_difference(a, b, f"{where}{key}.")
            return f"{where}{key}", a, b
    return where.rstrip("."), had, want


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------- training


def train_entry(b: Budget, e: Entry, out: Path, resume: bool, threads: int, progress: bool, log) -> dict:
    """Train one model into out/NAME (or keep its finished result) and write out/NAME/result.json."""
    from hrm_edge.model.lm import parameter_counts
    from hrm_edge.train.loop import train

    folder = out / e.name
    want = model_config(b, e)
    if (folder / RESULT).is_file():  # only with --resume: a fresh study refuses a folder that has results
        result = _read_json(folder / RESULT)
        if result.get("requested_model") != _jsonable(want):
            raise UserError(f"{folder} holds a different {e.name} model; delete it or choose another --out")
        log(f"[study] {e.name}: already trained (kept)")
        return result
    continue_training = resume and (folder / STATE).is_file()
    if continue_training:
        have = _read_json(folder / CONFIG)
        # train() fits vocab_size to the tokenizer and max_seq_len to seq_len; everything else must match
        differs = sorted(k for k, v in _jsonable(want).items() if k not in ("vocab_size", "max_seq_len") and have.get(k) != v)
        if differs:
            raise UserError(f"{folder} holds a different {e.name} checkpoint ({', '.join(differs)}); "
                            f"delete it or choose another --out")
    overrides = {k: v.replace("{out}", str(out)) if isinstance(v, str) else v for k, v in e.train_overrides.items()}
    if overrides.get("distill_from") and not (Path(overrides["distill_from"]) / CONFIG).is_file():
        raise UserError(f"{e.name} distils from {overrides['distill_from']}, which is not trained yet; run the "
                        f"study without --only, or with its teacher first")
    preset = Preset(name=f"study-{b.name}-{e.name}", model=want, data=copy.deepcopy(b.data),
                    train=dataclasses.replace(b.train, threads=threads, **overrides))
    load_before = os.getloadavg()[0]
    state = train(preset, folder, resume=continue_training, progress=progress,
                  log=lambda msg: log(f"[study] {e.name}: {msg}"))
    load_after = os.getloadavg()[0]
    model = load_model(folder)
    total, unique = parameter_counts(model)
    hist = state["history"]
    # tokens/s per eval interval, measured by train() without the evaluations; the median is robust to a
    # slow first interval (warm-up) and to bursts of load from other work on a shared machine
    rates = [h["tokens_per_s"] for h in hist if "tokens_per_s" in h]
    tokens_per_s = statistics.median(rates)
    final, untrained = hist[-1], hist[0]
    result = {
        "name": e.name, "role": e.role, "tests": e.tests, "overrides": e.overrides, "train_overrides": e.train_overrides,
        "requested_model": _jsonable(want), "model": dataclasses.asdict(model.cfg),
        "block_applications": model.cfg.n_steps, "params_unique": unique, "params_per_application": total,
        "train_tokens": state["train_tokens"], "val_tokens": state["val_tokens"],
        "corpus": state["corpus"], "corpus_split_sha256": state["corpus_split_sha256"],
        "tokenizer_sha256": sha256_file(folder / TOKENIZER),
        "steps": state["step"], "tokens_trained": state["step"] * b.train.batch_size * b.train.seq_len,
        "val_loss": final["val_loss"], "val_perplexity": final["val_perplexity"],
        "val_bits_per_byte": final["val_bits_per_byte"], "untrained_bits_per_byte": untrained["val_bits_per_byte"],
        "train_tokens_per_s": tokens_per_s, "train_tokens_per_s_intervals": rates,
        # an epoch is one pass over the training split's tokens, extrapolated from the measured rate
        "epoch_s": state["train_tokens"] / tokens_per_s,
        "train_wall_s": state.get("wall_time_s"), "load_avg_1m": [load_before, load_after],
        "history": hist,
    }
    atomic_write_text(folder / RESULT, json.dumps(result, indent=2) + "\n")
    log(f"[study] {e.name}: {unique:,} unique parameters, T={model.cfg.n_steps}, val bpb {final['val_bits_per_byte']:.4f} "
        f"(untrained {untrained['val_bits_per_byte']:.3f}), {tokens_per_s:,.0f} train tokens/s")
    return result


def check_same_setup(results: list[dict]) -> None:
    """Every model must have seen the same data through the same tokenizer, or the table compares nothing."""
    first = results[0]
    for r in results[1:]:
        for key in ("tokenizer_sha256", "corpus_split_sha256", "train_tokens", "val_tokens", "tokens_trained"):
            if r[key] != first[key]:
                raise RuntimeError(f"study: {r['name']} and {first['name']} differ in {key} ({r[key]} vs {first[key]}): "
                                   f"their numbers are not comparable")


# ---------------------------------------------------------------- int8 program and decode speed


def pte_name(e: Entry) -> str:
    return artifact_name(e.name, "int8-dynamic", "pte", "kv_cache")


PTE_MARKER = "pte.json"  # what the int8 program was built from (hrm_edge.measure.harness.build_unless_current)


def export_entry(e: Entry, out: Path, threads: int, log) -> dict:
    """The int8 KV-cache ExecuTorch program, built exactly as `python -m hrm_edge.export` builds
    hrm.int8-dynamic.kv.pte (torchao int8 dynamic activations x int8 weights, XNNPACK); kept while its marker
    records these weights and the same exporting code."""
    folder = out / e.name
    result = _read_json(folder / RESULT)
    path = folder / pte_name(e)

    def build() -> list[Path]:
        import torch  # the lowering's thread count

        if threads:
            torch.set_num_threads(threads)
        log(f"[study] {e.name}: lowering the int8 KV-cache program to XNNPACK (T={result['block_applications']}; "
            f"minutes) ...")
        tok = load_tokenizer(folder / TOKENIZER)
        return [lower_kv_pte(load_model(folder), path, "int8", bos_id(tok), eos_id(tok))]

    record, built = build_unless_current(folder / PTE_MARKER, {"weights": sha256_file(folder / WEIGHTS)}, build)
    built_file = record["files"][0]
    pte = {"path": built_file["path"], "bytes": built_file["bytes"], "sha256": built_file["sha256"],
           "export_s": record["build_s"]}
    if not built:
        log(f"[study] {e.name}: int8 program already built (kept)")
    if result.get("pte") != pte:
        result["pte"] = pte
        atomic_write_text(folder / RESULT, json.dumps(result, indent=2) + "\n")
    if built:
        log(f"[study] {e.name}: wrote {path.name} ({pte['bytes']:,} bytes) in {pte['export_s']:.0f} s")
    return result


def measure_decode(b: Budget, entries: list[Entry], out: Path, threads: int, progress: bool, log,
                   verbose: bool = False) -> dict:
    """Decode tokens/s of each int8 program, each run in a fresh process (hrm_edge.measure.harness), the
    models interleaved round by round so that a change in machine load hits them alike."""
    t = time.perf_counter()
    timing = DecodeTiming(threads, b.decode_prompt, b.decode_new_tokens, b.decode_repeats)
    runs: dict[str, list[dict]] = {e.name: [] for e in entries}
    jobs = [(r, e) for r in range(b.decode_rounds) for e in entries]
    for r, e in tqdm(jobs, desc="decode", unit="run", disable=not progress):
        row = decode_in_child("decode", out / e.name, pte_name(e), timing, verbose)
        row["load_avg_1m"] = os.getloadavg()[0]
        runs[e.name].append(row)
        log(f"[study] decode round {r + 1}/{b.decode_rounds} {e.name}: {row['decode_tokens_per_s']:,.0f} tokens/s")
    summary = {name: {"decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in rows),
                      "prefill_tokens_per_s": statistics.median(x["prefill_tokens_per_s"] for x in rows),
                      "rounds": rows} for name, rows in runs.items()}
    return {"threads": threads, "prompt_len": b.decode_prompt, "new_tokens": b.decode_new_tokens,
            "rounds": b.decode_rounds, "repeats_per_round": b.decode_repeats, "wall_s": time.perf_counter() - t,
            "cpu": cpu_info(threads), "models": summary}


# ---------------------------------------------------------------- report


def goals(by_name: dict, ref: str, hrm: str, eq: str, decode: dict) -> list[dict]:
    out = []
    r, h = by_name.get(ref), by_name.get(hrm)
    text = (f"HRM-LM bits/byte <= {GOAL_BPB_RATIO:.2f} x {ref} at <= {GOAL_PARAM_RATIO:.2f} x its unique parameters")
    if r and h:
        bpb = h["val_bits_per_byte"] / r["val_bits_per_byte"]
        params = h["params_unique"] / r["params_unique"]
        out.append({"goal": text, "met": bpb <= GOAL_BPB_RATIO and params <= GOAL_PARAM_RATIO,
                    "detail": f"bits/byte {h['val_bits_per_byte']:.4f} vs {r['val_bits_per_byte']:.4f} = {bpb:.3f}x; "
                              f"parameters {h['params_unique']:,} vs {r['params_unique']:,} = {params:.3f}x"})
    else:
        out.append({"goal": text, "met": None, "detail": f"not evaluated: {ref} or {hrm} not in this study"})
    text = f"HRM-LM int8 decode tokens/s >= {GOAL_DECODE_RATIO:.2f} x {eq}"
    d = decode.get("models", {})
    if hrm in d and eq in d:
        mine, theirs = d[hrm]["decode_tokens_per_s"], d[eq]["decode_tokens_per_s"]
        out.append({"goal": text, "met": mine / theirs >= GOAL_DECODE_RATIO,
                    "detail": f"{mine:,.0f} vs {theirs:,.0f} tokens/s = {mine / theirs:.3f}x"})
    else:
        out.append({"goal": text, "met": None, "detail": f"not evaluated: no decode measurement of {hrm} and {eq}"})
    return out


def _duration(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


def render(study: dict) -> str:
    rows, decode = study["models"], study["decode"].get("models", {})
    by_name = {r["name"]: r for r in rows}
    ref, eq = by_name.get(study["reference"]), study["equal_compute"]
    b = study["budget"]
    tc = b["train"]
    tokens = tc["steps"] * tc["batch_size"] * tc["seq_len"]
    lines = [
        f"`{study['command']}`", "",
        f"Budget **{b['name']}**: every model trained on the same {tokens:,} tokens ({tc['steps']} steps x "
        f"{tc['batch_size']} x {tc['seq_len']}, seed {tc['seed']}, lr {tc['lr']} -> {tc['min_lr']} cosine, "
        f"bf16 autocast {'on' if tc['bf16_autocast'] else 'off'}; same recipe for all, not tuned per model) from "
        f"{rows[0]['corpus'] if rows else '?'} (corpus cut at {b['data']['max_corpus_bytes']:,} bytes), one "
        f"{rows[0]['model']['vocab_size'] if rows else '?'}-token BPE tokenizer shared by all (sha256 "
        f"{study['tokenizer_sha256'][:12] if study['tokenizer_sha256'] else '?'}). Validation: "
        f"{tc['eval_batches'] * tc['batch_size']} windows of {tc['seq_len']} tokens of the held-out split, the same for every "
        f"model; bits/byte = loss / ln 2 x tokens / bytes of the split. {describe_cpu(study.get('cpu', {}))}.", "",
        "| model | unique params | vs 4L | T | val ppl | bits/byte | bpb vs 4L | bpb vs hrm | train tok/s | epoch (est.) "
        "| int8 .pte bytes | int8 decode tok/s | decode vs 4L | decode vs equal-compute |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    hrm = by_name.get(study["hrm"])
    eq_decode = decode.get(eq, {}).get("decode_tokens_per_s")
    ref_decode = decode.get(study["reference"], {}).get("decode_tokens_per_s")
    for r in rows:
        p_ratio = f"{r['params_unique'] / ref['params_unique']:.2f}" if ref else "–"
        b_ratio = f"{r['val_bits_per_byte'] / ref['val_bits_per_byte']:.3f}" if ref else "–"
        h_ratio = f"{r['val_bits_per_byte'] / hrm['val_bits_per_byte']:.3f}" if hrm else "–"
        dec = decode.get(r["name"], {}).get("decode_tokens_per_s")
        dec_s = f"{dec:,.0f}" if dec else "–"
        pte_bytes = f"{r['pte']['bytes']:,}" if "pte" in r else "–"
        d_ref = f"{dec / ref_decode:.2f}" if dec and ref_decode else "–"
        d_eq = f"{dec / eq_decode:.2f}" if dec and eq_decode else "–"
        lines.append(f"| {r['name']} | {r['params_unique']:,} | {p_ratio} | {r['block_applications']} | "
                     f"{r['val_perplexity']:.2f} | {r['val_bits_per_byte']:.4f} | {b_ratio} | {h_ratio} | "
                     f"{r['train_tokens_per_s']:,.0f} | {_duration(r['epoch_s'])} | {pte_bytes} | {dec_s} | {d_ref} | {d_eq} |")
    d = study["decode"]
    lines += ["", "Goals (the issue's):", ""]
    for g in study["goals"]:
        verdict = {True: "**met**", False: "**not met**", None: "not evaluated"}[g["met"]]
        lines.append(f"- {g['goal']}: {verdict} ({g['detail']})")
    loads = [x for r in rows for x in r["load_avg_1m"]]
    lines += ["", "Notes:", "",
              "- epoch = one pass over the training split's "
              f"{rows[0]['train_tokens']:,} tokens, extrapolated from the measured training tokens/s "
              "(median over the intervals between evaluations, evaluation time excluded)." if rows else "- no models",
              f"- decode: each model's int8 KV-cache ExecuTorch program (torchao int8 dynamic activations x int8 "
              f"weights, XNNPACK; built as `python -m hrm_edge.export` builds `hrm.int8-dynamic.kv.pte`), "
              f"{d.get('prompt_len', '?')}-token prompt then {d.get('new_tokens', '?')} greedy tokens, "
              f"{d.get('threads', '?')} thread, median of {d.get('rounds', '?')} round(s) interleaved across the models "
              f"(each round a fresh process, median of {d.get('repeats_per_round', '?')} generations); "
              "'–' = not measured (ablations only with --decode-ablations).",
              f"- machine: {describe_cpu(study.get('cpu', {}))}; shared with other work (1-minute load average "
              f"during training "
              f"{min(loads):.1f}-{max(loads):.1f}), so tokens/s figures carry that noise." if loads else "",
              f"- wall time of this invocation {_duration(study['wall_time_s'])}; per model, summed over runs: "
              f"training loops {_duration(study['models_train_wall_s'])}, int8 lowering {_duration(study['models_export_s'])}.",
              "", "What each model tests:", ""]
    lines += [f"- `{r['name']}`: {r['tests']}" for r in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the study


@dataclass
class StudyOptions:
    """How to run a study (the CLI's flags)."""

    only: list[str] | None = None  # model names to train (None: all); the table lists every finished one
    resume: bool = False  # continue the study in `out` (otherwise `out` must not hold one)
    threads: int = 0  # CPU threads for training, tokenizing and lowering (0: all cores)
    decode_threads: int = 1
    decode_ablations: bool = False  # also lower and time every ablation's int8 program
    train_only: bool = False  # stop after training (a GPU machine without ExecuTorch); --resume does the rest
    progress: bool = True
    verbose: bool = False  # the runtimes' own log lines and the benchmark processes' stderr
    command: str = "python -m hrm_edge.study"  # recorded in study.json


def check_study_folder(out: Path, names: list[str], resume: bool) -> list[str]:
    """The models of `names` that a study in `out` has started (a checkpoint) or finished (a result). Refuses a study
    there without --resume, --resume where none has started, and a folder that holds other files than a study's (an
    export's: the study would mix 13 model folders into it)."""
    started = sorted({p.parent.name for pattern in (f"*/{RESULT}", f"*/{STATE}") for p in out.glob(pattern)})
    if started and not resume:
        raise UserError(f"{out} already holds a study ({', '.join(started)}); pass --resume to continue it, "
                        f"or choose another --out")
    if resume and not started:
        raise UserError(f"--resume: {out} holds no study to continue (no model has started there); leave --resume "
                        "out to start one")
    own = {*names, STUDY_CONFIG, STUDY_JSON, STUDY_TABLE}
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    other = [name for name in entries if name not in own and not name.startswith(".")]
    if other:
        raise UserError(f"--out {out} holds other files than a study's ({some_names(other)}); run the study in a new "
                        "or empty folder")
    return started


def run_study(b: Budget, out: Path, options: StudyOptions | None = None, log=print) -> dict:
    o = options or StudyOptions()
    only, resume, threads, progress = o.only, o.resume, o.threads, o.progress
    t_start = time.perf_counter()
    check_corpus(b.data.corpus)  # before the folder and its study_config.json are made
    entries = study_entries(b)
    names = [e.name for e in entries]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise UserError(f"--only: unknown model(s) {', '.join(unknown)}; known: {', '.join(names)}")
    out = Path(out)
    started = check_study_folder(out, names, resume)
    config = {"budget": _jsonable(b)}
    # the setup of a study that has started a model is kept; a run that stopped before (a corpus that turned out
    # empty) leaves nothing to keep, and its config is replaced
    if started and (out / STUDY_CONFIG).is_file() and _read_json(out / STUDY_CONFIG) != config:
        key, had, want = first_difference(_read_json(out / STUDY_CONFIG), config)
        raise UserError(f"{out} holds a study with another setup ({key}: {had!r} there, {want!r} now); "
                        f"choose another --out")
    if not o.train_only:  # imported now, not when first needed an hour later: a long run uses the code it started with
        import hrm_edge.export.executorch  # noqa: F401
        import hrm_edge.export.quantize  # noqa: F401

    selected = [e for e in entries if not only or e.name in only]

    done = {}
    with removed_if_failed(out, setup=(STUDY_CONFIG,)):  # a new folder of a study refused before any model started
        out = check_writable_dir(out)
        atomic_write_text(out / STUDY_CONFIG, json.dumps(config, indent=2) + "\n")
        for i, e in enumerate(selected):
            log(f"[study] model {i + 1}/{len(selected)}: {e.name} ({e.tests})")
            done[e.name] = train_entry(b, e, out, resume, threads, progress, log)
            check_same_setup(list(done.values()))  # fail at the first odd one out, not after an hour
    # the table holds every model of this study that has a result: earlier --only runs included
    results = [_read_json(out / e.name / RESULT) for e in entries if (out / e.name / RESULT).is_file()]
    check_same_setup(results)
    if o.train_only:
        log(f"[study] trained {', '.join(done)} in {out}; run again with --resume to build and time the programs")
        return {}

    decoded = [e for e in entries if (out / e.name / RESULT).is_file() and (e.role not in ("ablation", "idea")
                                                                          or o.decode_ablations)]
    for e in decoded:
        export_entry(e, out, threads, log)
    decode = measure_decode(b, decoded, out, o.decode_threads, progress, log, o.verbose) if decoded else {}

    results = [_read_json(out / e.name / RESULT) for e in entries if (out / e.name / RESULT).is_file()]
    by_name = {r["name"]: r for r in results}
    ref, hrm, eq = (next(e.name for e in entries if e.role == role) for role in ("reference", "hrm", "equal-compute"))
    study = {
        "command": o.command, "budget": _jsonable(b), "versions": versions(),
        "cpu": cpu_info(o.decode_threads),
        "threads": threads, "reference": ref, "hrm": hrm, "equal_compute": eq,
        "tokenizer_sha256": results[0]["tokenizer_sha256"] if results else None,
        "wall_time_s": time.perf_counter() - t_start,
        "models_train_wall_s": sum(r.get("train_wall_s") or 0 for r in results),
        "models_export_s": sum(r.get("pte", {}).get("export_s", 0) for r in results),
        "decode": decode, "goals": goals(by_name, ref, hrm, eq, decode),
        "models": results,
    }
    atomic_write_text(out / STUDY_JSON, json.dumps(study, indent=2) + "\n")
    atomic_write_text(out / STUDY_TABLE, render(study))
    return study


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = ArgumentParser(prog="python -m hrm_edge.study", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", choices=sorted(BUDGETS), default="quick",
                   help="quick: tiny widths, tens of steps, a few minutes (CI; numbers mean nothing); "
                        "full: the table in docs/measurements.md, its training took about 3 minutes on an H200, its "
                        "timing 10 on a CPU (default: quick)")
    p.add_argument("--out", type=path_arg, default=DEFAULT_OUT, help=f"study folder (default: {DEFAULT_OUT})")
    p.add_argument("--only", help="comma-separated model names to run (default: all); the table also lists "
                                  "models an earlier run of the same --out finished")
    p.add_argument("--resume", action="store_true",
                   help="continue the study in --out: keep finished models, continue an interrupted one from "
                        "its last checkpoint (without it, --out must not hold a study yet)")
    p.add_argument("--corpus", type=text_arg,
                   help="text file or folder of UTF-8 text, or pypi (default: the budget's: the stdlib "
                        "source for quick, the pinned PyPI corpus for full)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for training, tokenizing and lowering (default 0: all cores)")
    p.add_argument("--decode-threads", type=int, default=1, help="threads of the int8 decode measurement (default 1)")
    p.add_argument("--decode-ablations", action="store_true",
                   help="also build and time the int8 program of every ablation (minutes each), not only the "
                        "three main models")
    p.add_argument("--train-only", action="store_true",
                   help="only train the models (on a GPU if there is one, even without ExecuTorch installed); a "
                        "later run with --resume keeps them and builds, times and tabulates")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    p.add_argument("--verbose", action="store_true", help="show the export stack's and runtimes' own log lines")
    a = p.parse_args(argv)
    quiet_third_party(a.verbose)
    refuse_out_of_range(("--threads", a.threads, 0 <= a.threads <= 256, "in 0..256"),
                        ("--decode-threads", a.decode_threads, 1 <= a.decode_threads <= 256, "in 1..256"))
    if a.train_only and (a.decode_ablations or a.decode_threads != 1):  # they would be ignored without a word
        raise UserError("--decode-ablations and --decode-threads shape the decode measurement, which --train-only "
                        "leaves to a later run with --resume: give them to that run")
    only = [n.strip() for n in a.only.split(",") if n.strip()] if a.only else None
    if a.only is not None and not only:
        raise UserError("--only: give at least one model name")
    budget = copy.deepcopy(BUDGETS[a.budget])
    if a.corpus:
        budget.data.corpus = a.corpus
    if a.threads:
        # the BPE trainer and encoder run on a rayon pool that reads this when first used
        os.environ.setdefault("RAYON_NUM_THREADS", str(a.threads))
    study = run_study(budget, a.out, StudyOptions(only=only, resume=a.resume, threads=a.threads,
                                                  decode_threads=a.decode_threads, decode_ablations=a.decode_ablations,
                                                  train_only=a.train_only, progress=not a.no_progress,
                                                  verbose=a.verbose,
                                                  command=shlex.join(["python", "-m", "hrm_edge.study", *argv])))
    if a.train_only:
        return 0
    print()
    print(render(study))
    print(f"wrote {a.out / STUDY_JSON} and {a.out / STUDY_TABLE}")
    return 0
