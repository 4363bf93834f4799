"""Export an HRM-LM to ONNX (iteration as an ONNX Loop) and ExecuTorch (XNNPACK), gate every artifact on
numerical parity with the eager model, and write manifest.json + parity_report.md.

    python -m hrm_edge.export --preset tiny --out export/out        # train the tiny preset, then export
    python -m hrm_edge.export --checkpoint runs/tiny --out D         # export an existing checkpoint

Exit codes: 0 all artifacts passed, 1 an artifact failed parity (the manifest says which and why),
2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from hrm_edge.config import DataConfig, ModelConfig, QuantConfig, load_preset
from hrm_edge.errors import ArgumentParser, UserError
from hrm_edge.export.calibrate import activation_ranges, make_calibration_set, save_calibration_set
from hrm_edge.export.executorch import export_pte, export_pte_decode, export_pte_speculative, quantized_for_pte
from hrm_edge.export.names import artifact_name
from hrm_edge.export.onnx import (NBITS_TABLE_BITS, export_onnx, export_onnx_branch, export_onnx_decode, export_onnx_draft,
                                  export_onnx_verify, export_ort, mobile_usability, quantize_nbits, quantize_static_int8)
from hrm_edge.export.quantize import (NBITS_BLOCK, all_linear_int8_names, dynamic_int4_quantization, dynamic_quantization,
                                      int8_weight_bytes, nbits_quantization, nbits_reference, nbits_weight_bytes,
                                      parse_linear_names, pt2e_quantization, pte_weight_bytes,
                                      static_int8_names, static_int8_pt2e_model, static_int8_reference,
                                      static_onnx_quantization, static_plan)
from hrm_edge.export.workers import init_worker, spawn_workers
from hrm_edge.io import (atomic_write_text, check_writable_dir, folder_lock, one_line_write_errors, path_arg, publish,
                         removed_if_failed, sha256_file, some_names, staging_folder, text_arg)
from hrm_edge.model.checkpoint import (CONFIG, TOKENIZER, WEIGHTS, check_checkpoint, configs_for, copy_model_files,
                                       load_model, load_train_state)
from hrm_edge.model.eager import EagerDecoder
from hrm_edge.model.lm import HRMLM, parameter_counts, unique_weight_bytes
from hrm_edge.quiet import native_stderr_kept_back, quiet_third_party
from hrm_edge.runtime.decoders import generate
from hrm_edge.runtime.manifest import BUNDLE, MANIFEST, MANIFEST_FORMAT, REPORT, Artifact, manifest_json
from hrm_edge.train.dataset import (Corpus, built_corpus_root, check_corpus, encode_documents, fixed_windows,
                                    load_corpus)
from hrm_edge.train.loop import train
from hrm_edge.train.tokenizer import bos_id, eos_id, load_tokenizer
from hrm_edge.verify.parity import load_bundle, perplexity, run_gate, tolerances, write_bundle
from hrm_edge.verify.reference import adaptive_references, eager_logits
from hrm_edge.verify.web_bundle import write_web_bundle

DEFAULT_OUT = Path("export/out")
SHIPPED_CHECKPOINT = Path(__file__).resolve().parents[1] / "default_model"
INT8_MODES = ("static", "static-shared", "dynamic", "pt2e", "8da4w", "nbits")
INT8_FORMATS = {"static": "onnx", "static-shared": "onnx", "nbits": "onnx", "dynamic": "pte", "pt2e": "pte",
                "8da4w": "pte"}  # what each mode makes
PTE_PROGRAMS = ("full_sequence", "kv_cache", "speculative")  # the .pte program kinds (manifest "program")
GREEDY_NEW_TOKENS = 64  # decode parity: this many greedy tokens must match eager fp32 exactly


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("hrm-edge", "torch", "executorch", "torchao", "onnx", "onnxruntime", "onnxscript", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _stage(msg: str, log=print):
    log(f"[export] {msg}")
    return time.perf_counter()


def comma_list(text: str, choices: tuple) -> tuple[tuple[str, ...], list[str]]:
    """The comma-separated values of a flag, and those of them not in `choices` (sorted)."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    return values, sorted(set(values) - set(choices))


def parse_int8_modes(text: str) -> tuple[str, ...]:
    modes, bad = ((), []) if text.strip() == "none" else comma_list(text, INT8_MODES)
    if bad == ["none"]:  # `none` with modes ("none,static")
        raise UserError("int8 modes: none means no int8 program: give it alone, or leave it out of the list")
    if bad:
        raise UserError(f"int8 modes: unknown {', '.join(bad)}; choose from {', '.join(INT8_MODES)}, or none alone")
    return modes


def parse_pte_programs(text: str, int8: tuple | None) -> tuple[str, ...]:
    programs, bad = comma_list(text, PTE_PROGRAMS)
    if bad or not programs:
        raise UserError(f"--pte-programs: unknown {', '.join(bad) or '(none given)'}; choose from "
                        f"{', '.join(PTE_PROGRAMS)}")
    if int8 and "pt2e" in int8 and "full_sequence" not in programs:
        raise UserError("--int8 pt2e makes a full_sequence .pte program, which --pte-programs leaves out")
    return programs


def check_no_idle_flags(formats: tuple, int8: tuple | None, pte_programs_given: bool, steps_given: bool,
                        checkpoint: Path | None) -> None:
    """Flags that would do nothing with the others given: refused, not ignored without a word (`--formats onnx
    --int8 dynamic` exported no int8 artifact)."""
    if pte_programs_given and "pte" not in formats:
        raise UserError("--pte-programs chooses .pte programs, which --formats leaves out")
    idle = [m for m in int8 or () if INT8_FORMATS[m] not in formats]
    if idle:
        raise UserError(f"--int8 {','.join(idle)} makes {' and '.join(sorted({INT8_FORMATS[m] for m in idle}))} "
                        "artifacts, which --formats leaves out")
    if steps_given and checkpoint is not None:
        raise UserError("--steps sets the training of a --preset; a checkpoint (the shipped model by default) is "
                        "exported as it is")


def check_cycles(cycles: tuple, cfg) -> None:
    if cycles and cfg.arch != "hrm":
        raise UserError("--cycles: the depth dial needs an HRM model (model.arch = hrm)")
    bad = [k for k in cycles if not 1 <= k <= cfg.H_cycles]
    if bad:
        raise UserError(f"--cycles: {bad[0]} is not in 1..{cfg.H_cycles} (the model's outer cycles, H_cycles)")


# ---- what each stage returns ----
@dataclass
class ExportOptions:
    """What to export: the CLI's choices (None: the preset's, or the checkpoint's)."""

    preset: str | None = None  # train this preset into OUT/checkpoint first (None with no checkpoint: default)
    checkpoint: Path | None = None  # or export this checkpoint folder
    corpus: str | None = None  # replaces the preset's / checkpoint's corpus (also the parity windows' source)
    steps: int | None = None  # replaces the preset's training steps
    parity_samples: int = 8  # validation windows the gate runs
    formats: tuple[str, ...] = ("onnx", "pte")
    int8: tuple[str, ...] | None = None  # subset of INT8_MODES
    calib_samples: int | None = None
    calib_corpus: str | None = None
    cycles: tuple[int, ...] = ()  # depth dial: outer cycle counts to export besides the full depth
    pte_programs: tuple[str, ...] = PTE_PROGRAMS  # the .pte program kinds to make (--pte-programs)
    progress: bool = True
    verbose: bool = False  # show third-party notices and the .pte workers' native stderr


@dataclass(frozen=True)
class Prepared:
    """The model to export (prepare_checkpoint)."""

    checkpoint: Path  # where the model came from
    model_dir: Path  # the copy of its files in the staging folder: published with the export, loaded by the .pte workers
    model: HRMLM  # eval mode
    tokenizer: Tokenizer
    data_cfg: DataConfig  # the corpus whose validation split is the parity set
    quant_cfg: QuantConfig  # calibration and the int8 gate's bounds
    seq_len: int  # tokens per parity (and calibration) window
    int8: tuple[str, ...]  # the int8 modes to build

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


@dataclass(frozen=True)
class ParitySet:
    """The inputs every artifact is gated on (build_parity_set)."""

    corpus: Corpus  # the loaded corpus (its calibration split is read by calibrate)
    windows: np.ndarray  # [N, S + 1] validation windows: inputs [:, :-1], targets [:, 1:]
    reference: np.ndarray  # [N, S, V] eager fp32 logits of the inputs
    prefill_len: int  # KV-cache programs: prefill this many tokens, decode the rest

    @property
    def tokens(self) -> np.ndarray:
        return self.windows[:, :-1]  # [N, S]


@dataclass(frozen=True)
class Calibration:
    """The calibration set and what was measured on it (calibrate)."""

    windows: np.ndarray  # [n, S] calibration windows
    ranges: dict | None  # per-step activation ranges (HRM only)
    record: dict  # the manifest's calibration record


@dataclass(frozen=True)
class Made:
    """What a stage wrote: its artifacts (the manifest's records, in the order written) and the eager
    references it adds to the parity bundle (bundle name -> [N, S, V] logits). Stages' results add up with +."""

    artifacts: tuple[Artifact, ...] = ()
    references: dict = field(default_factory=dict)

    def __add__(self, other: Made) -> Made:
        return Made(self.artifacts + other.artifacts, self.references | other.references)

    def has(self, name: str) -> bool:
        return any(a.path == name for a in self.artifacts)


def wrote(path: Path, fmt: str, precision: str, program: str, iteration: str, references: dict | None = None,
         **optional) -> Made:
    """One freshly written file as a stage's result."""
    return Made((Artifact.new(path, fmt, precision, program, iteration, **optional),), references or {})


# ---- the output folder: one export at a time, published whole ----
EXPORT_MARKER = ".hrm-export"  # in every folder an export writes: "an export's folder", and its lock (pid inside)
STAGING = ".export-staging"  # inside the folder: where a running export writes, until it is published


def export_all(out: Path, options: ExportOptions | None = None, log=print) -> bool:
    """The whole pipeline into `out`, under its lock. The files are written into a staging folder inside `out`
    and moved in (manifest last) only when the gate has written the manifest: an export that fails part-way
    (a bad input, a full disk) leaves the folder's previous export as it was. Returns True when every
    artifact passed the parity gate."""
    options, out = options or ExportOptions(), Path(out)
    check_inputs(options)
    with removed_if_failed(out, leftovers=(EXPORT_MARKER,)):
        check_output_folder(out, options.checkpoint)
        with folder_lock(out, EXPORT_MARKER, log), staging_folder(out, STAGING) as staging:
            with one_line_write_errors(out):
                ok = export_stages(out, staging, options, log)
                stale = earlier_export_files(out) - {p.name for p in staging.iterdir()}
                publish(staging, out, last=(REPORT, MANIFEST))
                remove_stale(out, stale, log)
    log(f"[export] published into {out}")
    return ok


# the files only some exports write (calibration: a static int8 mode; the operator list: .ort files)
OPTIONAL_FILES = ("calibration.json", "calibration_set.npz", "required_operators.config", "web_bundle.bin")


def earlier_export_files(out: Path) -> set[str]:
    """The names of the files an earlier export in `out` wrote that a new export may not write again: the artifacts
    its manifest lists and the optional files. Never a checkpoint's files (an export may go into its checkpoint)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        arts = manifest.get("artifacts") or []
    except (OSError, ValueError, AttributeError):  # no earlier manifest, or not one to read
        arts = []
    names = {a.get("path") for a in arts if isinstance(a, dict)}
    return {n for n in names if isinstance(n, str) and Path(n).name == n and Path(n).suffix in (".onnx", ".ort", ".pte")
            } | set(OPTIONAL_FILES)


def remove_stale(out: Path, names: set[str], log=print) -> None:
    """Remove the earlier export's files this one did not write (after its manifest, which does not list them, is in
    place): they were of the earlier model, and a reader that opens a file by name would have taken them."""
    removed = sorted(n for n in names if (out / n).is_file() and not (out / n).is_symlink())
    for name in removed:
        (out / name).unlink()
    if removed:
        log(f"[export] removed {len(removed)} files of the earlier export that this one did not write "
            f"({some_names(removed)})")


def check_inputs(options: ExportOptions) -> None:
    """What an export reads, checked before its folder is made (a bad input leaves nothing behind) and before a
    preset trains: the corpora, the checkpoint's files, the preset, and the depth dial against the model's cycles."""
    check_corpus(options.corpus)
    check_corpus(options.calib_corpus)
    if options.calib_corpus and built_corpus_root(options.calib_corpus) is None:  # a file or folder of text: read
        # now, as the int8 stage reads it (not UTF-8, or no text: refused in a moment, not after the fp32 programs)
        load_corpus(DataConfig(corpus=options.calib_corpus, val_percent=0, calib_percent=100), required_splits=())
    if options.checkpoint is not None:
        check_checkpoint(options.checkpoint)
        check_cycles(options.cycles, ModelConfig.load(Path(options.checkpoint) / CONFIG))
    else:
        preset = load_preset(options.preset or "default")
        preset.override(options.corpus, options.steps)  # --steps >= 1
        parse_linear_names(preset.quant.static_fp32_linears)  # a typo fails now, not after training
        check_cycles(options.cycles, preset.model)


def check_output_folder(out: Path, checkpoint: Path | None) -> None:
    """`out` is created if missing and must be writable; an existing folder must be empty, an earlier export's
    (manifest.json, or the marker every export leaves) or the checkpoint being exported: an export is never mixed
    into a folder of other files."""
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    check_writable_dir(out)
    if entries and MANIFEST not in entries and EXPORT_MARKER not in entries and not (
            checkpoint is not None and Path(checkpoint).resolve() == out.resolve()):
        raise UserError(f"--out {out} is not an export folder and holds other files ({some_names(entries)}); "
                        "refusing to mix an export into it: choose a new or empty folder, or an earlier export's")


# ---- the stages, in the order export_stages runs them ----
def export_stages(out: Path, staging: Path, options: ExportOptions, log=print) -> bool:
    """Every stage, each writing its files into `staging` (a preset is trained into `out`/checkpoint, which
    stays). The .pte programs are lowered in worker processes while this one writes the ONNX graphs; the
    full-sequence, KV and depth-dial graphs are converted to .ort (the speculative sets stay .onnx: their clients load
    ONNX); the manifest lists the files in the order written."""
    prepared = prepare_checkpoint(out, staging, options, log)
    parity = build_parity_set(prepared, options.parity_samples, log)
    with pte_workers(staging, prepared, parity, options, log) as wait_for_pte_programs:
        onnx_fp32 = export_fp32_onnx(staging, prepared, parity, options, log)
        int8, calibration = export_int8(staging, prepared, parity, onnx_fp32, options, log)
        int8 += export_nbits_onnx(staging, prepared, parity, onnx_fp32, log)
        dial, depth_dial = export_depth_dial(staging, prepared, parity, options, log)
        exported = with_ort(staging, onnx_fp32 + int8 + dial, options, log)
        exported += export_speculative_onnx(staging, prepared, parity, calibration, onnx_fp32 + int8, log)
        exported += wait_for_pte_programs()
    if any(a.precision == "fp32" and a.program in ("verify", "speculative") for a in exported.artifacts):
        # adaptive depth's eager reference of the fp32 speculative sets (the gate's where no eager model runs)
        exported += Made(references=adaptive_references(prepared.model, "fp32", parity.tokens, parity.prefill_len))
    greedy = eager_greedy(prepared, parity, exported, options.cycles)
    write_bundle(staging / BUNDLE, parity.windows, parity.reference, exported.references, greedy)
    artifacts = [with_digest(staging, art) for art in exported.artifacts]
    manifest = build_manifest(staging, prepared, parity, artifacts, calibration, depth_dial)
    write_web_parity_bundle(staging, manifest)
    with native_stderr_kept_back(options.verbose):  # ExecuTorch's runtime prints cpuinfo notices on its first load
        return gate(staging, manifest, parity, log)


def prepare_checkpoint(out: Path, staging: Path, options: ExportOptions, log=print) -> Prepared:
    """The checkpoint (given, or trained from the preset into `out`/checkpoint), its model and tokenizer, and a
    copy of its files in `staging`, where the export writes."""
    out = check_writable_dir(out)
    for leftover in out.glob(".*.tmp"):  # temp files of a run that was killed before its rename
        leftover.unlink()
    if options.checkpoint is not None:
        checkpoint = Path(options.checkpoint)  # its files are there (export_all checked them)
        data_cfg, quant_cfg = configs_for(checkpoint, options.corpus)
        if not options.corpus and checkpoint.resolve() == SHIPPED_CHECKPOINT:
            # The shipped model trained on the PyPI corpus, which a fresh machine has not downloaded: its parity
            # windows and calibration come from the standard library's splits (on every machine; code the PyPI
            # corpus excludes, so held out from training too). --corpus pypi uses the corpus's own splits.
            data_cfg.corpus = ""
        seq_len = load_train_state(checkpoint).get("train", {}).get("seq_len", 128)
    else:
        checkpoint, data_cfg, quant_cfg, seq_len = _train_preset(out, options, log)
    model = load_model(checkpoint)
    tok = load_tokenizer(checkpoint / TOKENIZER)
    if tok.get_vocab_size() != model.cfg.vocab_size:
        raise UserError(f"checkpoint {checkpoint}: tokenizer has {tok.get_vocab_size()} tokens, model {model.cfg.vocab_size}")
    if checkpoint.resolve() != staging.resolve():
        copy_model_files(checkpoint, staging)
    int8 = options.int8 if options.int8 is not None else parse_int8_modes(quant_cfg.int8_modes)
    return Prepared(checkpoint, staging, model, tok, data_cfg, quant_cfg, min(seq_len, model.cfg.max_seq_len), int8)


def _train_preset(out: Path, options: ExportOptions, log) -> tuple:
    """Train the preset into out/checkpoint. Returns (checkpoint, data config, quant config, seq_len)."""
    preset = load_preset(options.preset or "default")
    preset.override(options.corpus, options.steps)  # (its names and --cycles: check_inputs)
    checkpoint = out / "checkpoint"
    t = _stage(f"training preset {preset.name!r} into {checkpoint}", log)
    train(preset, checkpoint, progress=options.progress, log=log)
    log(f"[export] trained in {time.perf_counter() - t:.0f} s")
    return checkpoint, preset.data, preset.quant, preset.train.seq_len


def build_parity_set(prepared: Prepared, samples: int, log=print) -> ParitySet:
    """The parity inputs: held-out validation windows (never training or calibration text), and the eager fp32
    logits every artifact is compared with."""
    _stage("building the parity set from the validation split", log)
    corpus = load_corpus(prepared.data_cfg, required_splits=("val",))  # an export reads no training text
    windows = fixed_windows(encode_documents(prepared.tokenizer, corpus.val), samples, prepared.seq_len)
    return ParitySet(corpus, windows, eager_logits(prepared.model, windows[:, :-1]), max(1, prepared.seq_len // 4))


@contextlib.contextmanager
def pte_workers(staging: Path, prepared: Prepared, parity: ParitySet, options: ExportOptions, log):
    """Lower the .pte programs (pte_jobs) in worker processes while the with-block builds the rest in this one.
    Yields wait(): the programs' artifacts and eager references, once every worker is done (empty without
    "pte" in the formats). An error stops the workers; a worker's error shows its native stderr too."""
    wanted = options.pte_programs if "pte" in options.formats else ()
    jobs = pte_jobs(prepared.cfg, prepared.int8, options.cycles, wanted)
    if not jobs:
        yield Made  # wait() -> nothing lowered
        return
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="hrm-export-workers.") as stderr_dir:
        pool, programs = start_pte_workers(prepared.model_dir, staging, jobs, parity, log,
                                           None if options.verbose else Path(stderr_dir))
        torch.set_num_threads(1)  # the workers have the cores; more threads here would only spin against them

        def wait() -> Made:
            t = _stage("waiting for the ExecuTorch programs", log)
            lowered = Made()
            for program in programs:
                try:
                    results = program.get()
                except Exception:  # the worker's exception, re-raised here: show what it wrote to stderr too
                    show_worker_stderr(Path(stderr_dir))
                    raise
                for art, refs in results:
                    lowered += Made((art,), refs)
            log(f"[export] ExecuTorch programs ready after {time.perf_counter() - t:.0f} s more")
            return lowered

        try:
            yield wait
            pool.close()
        except BaseException:
            pool.terminate()  # stop lowering programs nobody will list
            raise
        finally:
            pool.join()
            torch.set_num_threads(threads)


def export_fp32_onnx(staging: Path, prepared: Prepared, parity: ParitySet, options: ExportOptions, log) -> Made:
    """fp32 ONNX graphs: full-sequence and KV-cache."""
    if "onnx" not in options.formats:
        return Made()
    model, arch = prepared.model, prepared.cfg.arch
    loop = "onnx_loop" if arch == "hrm" else "unrolled"
    t = _stage(f"exporting fp32 ONNX ({'iteration as an ONNX Loop' if loop == 'onnx_loop' else 'unrolled'})", log)
    full = export_onnx(model, staging / artifact_name(arch, "fp32", "onnx"))
    kv = export_onnx_decode(model, staging / artifact_name(arch, "fp32", "onnx", "kv_cache"))
    log(f"[export] wrote 2 ONNX graphs in {time.perf_counter() - t:.0f} s")
    return (wrote(full, "onnx", "fp32", "full_sequence", loop)
            + wrote(kv, "onnx", "fp32", "kv_cache", loop, prefill_len=parity.prefill_len))


def export_int8(staging: Path, prepared: Prepared, parity: ParitySet, onnx_fp32: Made, options: ExportOptions,
                log) -> tuple[Made, Calibration | None]:
    """Calibrate, then write the static int8 ONNX graphs (rewrites of the fp32 graphs in `onnx_fp32`) and the
    opt-in PT2E program, with their eager int8 references. The dynamic int8 program is lowered by a .pte
    worker (pte_jobs). Returns what was written and the calibration (None without int8 modes)."""
    if not prepared.int8:
        return Made(), None
    fp32_linears = parse_linear_names(prepared.quant_cfg.static_fp32_linears)
    calibration = calibrate(staging, prepared, parity, options, log)
    int8 = Made()
    if {"static", "static-shared"} & set(prepared.int8) and onnx_fp32.has(artifact_name(prepared.cfg.arch, "fp32", "onnx")):
        if prepared.cfg.arch != "hrm":
            log("[export] static int8 ONNX is built for the HRM Loop graph only; skipped for the transformer baseline")
        else:
            int8 += export_static_int8_onnx(staging, prepared, parity, calibration, fp32_linears, onnx_fp32, log)
    if "pt2e" in prepared.int8 and "pte" in options.formats:
        int8 += export_pt2e_program(staging, prepared, parity, calibration, log)
    return int8, calibration


def calibrate(staging: Path, prepared: Prepared, parity: ParitySet, options: ExportOptions, log) -> Calibration:
    """The calibration set (calibration_set.npz) and per-step activation ranges (calibration.json)."""
    samples = options.calib_samples or prepared.quant_cfg.calib_samples
    _stage(f"calibrating: {samples} windows of {prepared.seq_len} tokens, ranges per iteration step", log)
    windows, record = make_calibration_set(prepared.tokenizer, prepared.data_cfg, samples, prepared.seq_len,
                                           prepared.quant_cfg.calib_seed, options.calib_corpus, parity.corpus)
    save_calibration_set(staging / "calibration_set.npz", windows)
    ranges = activation_ranges(prepared.model, windows) if prepared.cfg.arch == "hrm" else None
    manifest_record = dataclasses.asdict(record) | {"set": "calibration_set.npz", "ranges": "calibration.json"}
    atomic_write_text(staging / "calibration.json",
                      json.dumps(manifest_record | {"activation_ranges": ranges}, indent=2) + "\n")
    return Calibration(windows, ranges, manifest_record)


def export_static_int8_onnx(staging: Path, prepared: Prepared, parity: ParitySet, calibration: Calibration,
                            fp32_linears: tuple, onnx_fp32: Made, log) -> Made:
    """Static int8 inside the Loop body, with activation scales per iteration step (static: + the KV-cache
    graph) and/or one scale shared by every step (static-shared: a comparison; on the default model it misses
    the top-1 gate that per-step scales pass, so it is opt-in)."""
    model, arch = prepared.model, prepared.cfg.arch
    written = Made()
    for scales in [s for s, mode in (("per_step", "static"), ("shared", "static-shared")) if mode in prepared.int8]:
        _stage(f"static int8 ONNX, activation scales {scales.replace('_', ' ')}", log)
        plan = static_plan(model, calibration.ranges, per_step=scales == "per_step", fp32_linears=fp32_linears)
        precision = f"int8-static-{scales.replace('_', '')}"
        name = artifact_name(arch, precision, "onnx")
        int8 = {"reference": name, "weight_bytes": int8_weight_bytes(model, static_int8_names(plan)),
                "quantization": static_onnx_quantization(plan, calibration.record["tokens_sha256"])}
        path = quantize_static_int8(staging / artifact_name(arch, "fp32", "onnx"), staging / name, model, plan)
        # per-tensor static scales make a position's result independent of the others: the
        # full-sequence reference is the decode program's reference too
        written += wrote(path, "onnx", "int8", "full_sequence", "onnx_loop",
                        {name: eager_logits(static_int8_reference(model, plan), parity.tokens)}, **int8)
        fp32_kv = artifact_name(arch, "fp32", "onnx", "kv_cache")
        if scales == "per_step" and onnx_fp32.has(fp32_kv):
            path = quantize_static_int8(staging / fp32_kv, staging / artifact_name(arch, precision, "onnx", "kv_cache"),
                                        model, plan)
            written += wrote(path, "onnx", "int8", "kv_cache", "onnx_loop", prefill_len=parity.prefill_len, **int8)
    return written


def export_nbits_onnx(staging: Path, prepared: Prepared, parity: ParitySet, onnx_fp32: Made, log) -> Made:
    """Weight-only ONNX graphs (int8 mode nbits): the fp32 full-sequence and KV graphs with every block linear and
    the tied head as onnxruntime's MatMulNBits, 8-bit ("int8-nbits") and 4-bit ("int4-nbits") weights, each
    pair with its eager reference (quantize.nbits_reference). No calibration: the kernel quantizes its inputs."""
    arch, model = prepared.cfg.arch, prepared.model
    if "nbits" not in prepared.int8 or arch != "hrm" or not onnx_fp32.has(artifact_name(arch, "fp32", "onnx")):
        return Made()
    written, widths = Made(), sorted({prepared.cfg.d_model, prepared.cfg.ffn_hidden})  # the matmuls' input widths
    for bits, block in NBITS_BLOCK.items():
        if any(w % block for w in widths):
            log(f"[export] int{bits}-nbits skipped: input widths {widths} are not multiples of its block, {block}")
            continue
        t = _stage(f"weight-only int{bits} ONNX (MatMulNBits, blocks of {block})", log)
        precision, made = f"int{bits}-nbits", {}
        for program in ("full_sequence", "kv_cache"):
            made[program] = quantize_nbits(staging / artifact_name(arch, "fp32", "onnx", program),
                                           staging / artifact_name(arch, precision, "onnx", program), model, bits, block)
        weights = made["full_sequence"][1]  # (the same in both graphs)
        name = artifact_name(arch, precision, "onnx")  # its eager reference is the KV graph's too
        info = {"reference": name, "quantization": nbits_quantization(bits, block, NBITS_TABLE_BITS),
                "weight_bytes": nbits_weight_bytes(model, weights, bits, block, NBITS_TABLE_BITS)}
        written += wrote(made["full_sequence"][0], "onnx", f"int{bits}", "full_sequence", "onnx_loop",
                         {name: eager_logits(nbits_reference(model, weights, block), parity.tokens)}, **info)
        written += wrote(made["kv_cache"][0], "onnx", f"int{bits}", "kv_cache", "onnx_loop",
                         prefill_len=parity.prefill_len, **info)
        log(f"[export] wrote {name} and its KV graph in {time.perf_counter() - t:.0f} s")
    return written


def export_speculative_onnx(staging: Path, prepared: Prepared, parity: ParitySet, calibration: Calibration | None,
                            made: Made, log) -> Made:
    """Self-speculative decoding's draft and verify graphs (hrm_edge.runtime.speculative), and the suggestion bar's
    branch graph (the draft's work for rows sharing one context), beside each full-depth KV graph in `made` they
    serve: fp32, and int8 with the static per-step KV graph's own plan (the verify graph's Loop starts at block
    application L + 1, so its per-step scales do too)."""
    cfg, model = prepared.cfg, prepared.model
    if cfg.arch != "hrm" or cfg.H_cycles < 2 or not made.has(artifact_name("hrm", "fp32", "onnx", "kv_cache")):
        return Made()
    t = _stage("self-speculative decoding: draft (first outer cycle), branch and verify (the rest) ONNX graphs", log)
    written = Made()
    for program, export in (("draft", export_onnx_draft), ("branch", export_onnx_branch), ("verify", export_onnx_verify)):
        path = export(model, staging / artifact_name("hrm", "fp32", "onnx", program))
        written += wrote(path, "onnx", "fp32", program, "onnx_loop", prefill_len=parity.prefill_len,
                         mobile_usability=mobile_usability(path))
    int8_kv = next((a for a in made.artifacts if a.path == artifact_name("hrm", "int8-static-perstep", "onnx",
                                                                          "kv_cache")), None)
    if calibration is not None and int8_kv is not None:
        plan = static_plan(model, calibration.ranges, per_step=True,
                           fp32_linears=parse_linear_names(prepared.quant_cfg.static_fp32_linears))
        for program, first_step in (("draft", 0), ("branch", 0), ("verify", cfg.L_cycles + 1)):
            path = quantize_static_int8(staging / artifact_name("hrm", "fp32", "onnx", program),
                                        staging / artifact_name("hrm", "int8-static-perstep", "onnx", program),
                                        model, plan, first_step)
            written += wrote(path, "onnx", "int8", program, "onnx_loop", prefill_len=parity.prefill_len,
                             reference=int8_kv.reference, weight_bytes=int8_kv.weight_bytes,
                             quantization=int8_kv.quantization, mobile_usability=mobile_usability(path))
        written += Made(references=adaptive_references(static_int8_reference(model, plan), int8_kv.reference,
                                                       parity.tokens, parity.prefill_len))
    written += nbits_speculative_onnx(staging, model, parity, made)
    log(f"[export] wrote {len(written.artifacts)} ONNX graphs in {time.perf_counter() - t:.0f} s")
    return written


def nbits_speculative_onnx(staging: Path, model: HRMLM, parity: ParitySet, made: Made) -> Made:
    """The draft, branch and verify graphs of each MatMulNBits KV graph in `made` (export_nbits_onnx): the fp32 ones (written
    by export_speculative_onnx) rewritten as the KV graph was; its eager reference is theirs too."""
    written = Made()
    for kv in [a for a in made.artifacts if a.program == "kv_cache" and (a.quantization or {}).get("mode") == "nbits"]:
        bits = int(kv.precision.removeprefix("int"))
        for program in ("draft", "branch", "verify"):
            name = kv.path.replace(".kv.", f".{program}.")
            path, weights = quantize_nbits(staging / artifact_name("hrm", "fp32", "onnx", program), staging / name,
                                           model, bits, NBITS_BLOCK[bits])
            written += wrote(path, "onnx", kv.precision, program, "onnx_loop", prefill_len=parity.prefill_len,
                             reference=kv.reference, weight_bytes=kv.weight_bytes, quantization=kv.quantization,
                             mobile_usability=mobile_usability(path))
        written += Made(references=adaptive_references(nbits_reference(model, weights, NBITS_BLOCK[bits]), kv.reference,
                                                       parity.tokens, parity.prefill_len))
    return written


def export_pt2e_program(staging: Path, prepared: Prepared, parity: ParitySet, calibration: Calibration, log) -> Made:
    """The opt-in static PT2E int8 ExecuTorch program (calibrated, XNNPACK), built in this process."""
    model, tok, tokens = prepared.model, prepared.tokenizer, parity.tokens
    t = _stage("static int8 ExecuTorch program (PT2E XNNPACKQuantizer, calibrated, XNNPACK)", log)
    graph = static_int8_pt2e_model(model, calibration.windows)
    path = export_pte(model, staging / artifact_name(prepared.cfg.arch, "int8-static", "pte"), bos_id(tok), eos_id(tok),
                      traced=graph)
    log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
    with torch.no_grad():  # batch 1, as the program runs
        reference = np.concatenate([graph(torch.from_numpy(tokens[i : i + 1])).numpy() for i in range(len(tokens))])
    return wrote(path, "pte", "int8", "full_sequence", "unrolled", {path.name: reference}, reference=path.name,
                weight_bytes=int8_weight_bytes(model, all_linear_int8_names(model)),
                quantization=pt2e_quantization(calibration.record["tokens_sha256"]))


def export_depth_dial(staging: Path, prepared: Prepared, parity: ParitySet, options: ExportOptions,
                      log) -> tuple[Made, list | None]:
    """The depth dial (--cycles): the same weights run with K < H outer cycles (the model was trained with a
    readout after every outer cycle). Per depth: a full-sequence ONNX Loop graph (fp32) here, and the KV-cache
    .pte (pte_jobs) in a worker, each gated against the eager model at depth K (its reference goes into the
    parity bundle). Returns them and the manifest's depth_dial record: each depth's quality against the full
    depth (None without --cycles)."""
    if not options.cycles:
        return Made(), None
    cfg, model = prepared.cfg, prepared.model
    check_cycles(options.cycles, cfg)
    tokens, targets = parity.tokens, parity.windows[:, 1:]
    full = eager_logits(model, tokens)
    record, dial = [], Made()
    for k in sorted(set(options.cycles) | {cfg.H_cycles}):
        logits = full if k == cfg.H_cycles else eager_logits(partial(model, n_cycles=k), tokens)
        record.append({"cycles": k, "block_applications": k * (cfg.L_cycles + 1),
                       "perplexity": perplexity(logits, targets), "full_depth_perplexity": perplexity(full, targets),
                       "top1_vs_full_depth": float((logits.argmax(-1) == full.argmax(-1)).mean())})
        if k == cfg.H_cycles:
            continue  # the full depth is the export's main artifacts
        dial += Made(references={f"fp32.c{k}": logits})
        if "onnx" in options.formats:
            t = _stage(f"depth dial: ONNX graph with {k} of {cfg.H_cycles} outer cycles", log)
            path = export_onnx(model, staging / artifact_name(cfg.arch, "fp32", "onnx", n_cycles=k), n_cycles=k)
            dial += wrote(path, "onnx", "fp32", "full_sequence", "onnx_loop", cycles=k, fp32_reference=f"reference/fp32.c{k}")
            log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
    return dial, record


def with_ort(staging: Path, exported: Made, options: ExportOptions, log) -> Made:
    """ONNX Runtime's mobile format: every ONNX artifact of `exported` converted to .ort (checked by the gate
    like any other), required_operators.config for a reduced build, and the mobile-usability verdict per
    graph. Returns `exported` with the verdicts on its ONNX records, followed by the .ort records."""
    if "onnx" not in options.formats:
        return exported
    onnx_arts = [a for a in exported.artifacts if a.format == "onnx"]
    t = _stage(f"converting {len(onnx_arts)} ONNX graphs to ORT format", log)
    written, _ = export_ort([staging / a.path for a in onnx_arts], staging)
    checked = {a.path: dataclasses.replace(a, mobile_usability=mobile_usability(staging / a.path)) for a in onnx_arts}
    converted = tuple(dataclasses.replace(checked[a.path], path=path.name, format="ort", converted_from=a.path,
                                          mobile_usability=None) for a, path in zip(onnx_arts, written))
    log(f"[export] wrote {len(written)} .ort files and required_operators.config in {time.perf_counter() - t:.0f} s")
    return Made(tuple(checked.get(a.path, a) for a in exported.artifacts) + converted, exported.references)


def eager_greedy(prepared: Prepared, parity: ParitySet, exported: Made, cycles: tuple) -> tuple | None:
    """The eager fp32 model's greedy continuation (at every exported depth) that the KV-cache programs must
    replay: (prompt, tokens, {K: tokens at depth K}); None without a KV-cache program."""
    if not any(a.program == "kv_cache" for a in exported.artifacts):
        return None
    cfg = prepared.cfg
    n_new = min(GREEDY_NEW_TOKENS, cfg.max_seq_len - parity.prefill_len)
    prompt = parity.windows[0, :parity.prefill_len]

    def greedy(n_cycles=None):
        tokens = generate(EagerDecoder(prepared.model, n_cycles=n_cycles), prompt.tolist(), n_new).tokens
        return np.array(tokens, dtype=np.int64)

    return prompt, greedy(), {k: greedy(k) for k in set(cycles) - {cfg.H_cycles}}


def with_digest(staging: Path, art: Artifact) -> Artifact:
    """The record with its file's final bytes and sha256."""
    return dataclasses.replace(art, bytes=(staging / art.path).stat().st_size, sha256=sha256_file(staging / art.path))


def build_manifest(staging: Path, prepared: Prepared, parity: ParitySet, artifacts: list[Artifact],
                   calibration: Calibration | None, depth_dial: list | None) -> dict:
    cfg, tok, windows = prepared.cfg, prepared.tokenizer, parity.windows
    total, unique = parameter_counts(prepared.model)
    return {
        "format_version": MANIFEST_FORMAT,
        "created_unix": int(time.time()),
        "versions": versions(),
        "model": dataclasses.asdict(cfg),
        "block_applications": cfg.n_steps,
        "parameters": {"unique": unique, "per_application": total},
        "unique_weight_bytes": unique_weight_bytes(prepared.model),
        "size_rule": "artifact bytes <= 1.10 x unique_weight_bytes + 256 KiB",
        "checkpoint": {"config": CONFIG, "weights": WEIGHTS, "weights_sha256": sha256_file(staging / WEIGHTS)},
        "tokenizer": {"path": TOKENIZER, "sha256": sha256_file(staging / TOKENIZER), "vocab_size": tok.get_vocab_size(),
                      "bos_id": bos_id(tok), "eos_id": eos_id(tok)},
        "corpus": {"source": parity.corpus.source, "split_sha256": parity.corpus.names_sha256},
        "parity_bundle": {"path": BUNDLE, "sha256": sha256_file(staging / BUNDLE), "samples": int(windows.shape[0]),
                          "seq_len": int(windows.shape[1] - 1), "source": "validation split"},
        "calibration": calibration.record if calibration else None,
        "depth_dial": depth_dial,
        "tolerances": tolerances(prepared.quant_cfg),
        "artifacts": artifacts,
    }


def write_web_parity_bundle(staging: Path, manifest: dict) -> None:
    """The phone-sized parity bundle the demo's Self-test runs (hrm_edge.verify.web_bundle), listed in the manifest."""
    if not any(a.program == "kv_cache" for a in manifest["artifacts"]):
        return
    as_json = json.loads(manifest_json(manifest))
    path = write_web_bundle(staging, as_json, load_bundle(staging / BUNDLE))
    manifest["web_bundle"] = {"path": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
                              "source": "the parity bundle's first windows, cut to prefill + a few decode steps"}


def gate(staging: Path, manifest: dict, parity: ParitySet, log) -> bool:
    """Run every artifact in its runtime against the bundle; writes manifest.json and parity_report.md."""
    windows = parity.windows
    _stage(f"parity gate on {len(manifest['artifacts'])} artifact(s), {windows.shape[0]} x {windows.shape[1] - 1} tokens", log)
    # The reference was computed by build_parity_set from the same model: no need to recompute it.
    ok = run_gate(staging, manifest, recompute_reference=False, log=log)
    log(f"[export] {'PASSED' if ok else 'FAILED'} (the verdicts: {MANIFEST}, {REPORT})")
    return ok


# ---- ExecuTorch programs, lowered in worker processes ----
# XNNPACK lowering is single-threaded Python (one to two minutes per program at the default size) and the
# bulk of an export's time, so the .pte programs are lowered in spawned worker processes (killed with this
# one) while this process writes the ONNX graphs, int8 rewrites, .ort files and eager references.
@dataclass(frozen=True)
class PteJob:
    name: str  # file name in the export folder
    precision: str  # "fp32", "int8" (torchao 8-bit dynamic activations x 8-bit weights) or "int4" (x 4-bit weights)
    program: str  # "full_sequence", "kv_cache" or "speculative" (the KV program + draft and verify methods)
    n_cycles: int | None = None  # depth dial: outer cycles (None = all)
    reference: str | None = None  # quantized: the job whose eager reference it shares (the same quantized model)
    kv: str | None = None  # speculative: the KV program written from the same lowering (its forward method alone)


def pte_jobs(cfg, int8: tuple, cycles: tuple, programs: tuple = PTE_PROGRAMS) -> list[PteJob]:
    """The programs to lower, slowest first (a quantized lowering takes about 2.5x an fp32 one at the default
    size, a self-speculative program, twice the depth in three methods, about 1.7x its KV program), so that two
    workers finish close together. programs: the kinds to make (--pte-programs; the depth dial's are kv_cache).
    Where a speculative program and the full-depth KV program of its precision are both made, one job writes both
    (`kv`): the KV program is the speculative program's forward method, lowered once."""
    arch, jobs = cfg.arch, []
    speculative = arch == "hrm" and cfg.H_cycles >= 2  # the first outer cycle drafts, the rest verifies
    if speculative and "dynamic" in int8:
        jobs.append(PteJob(artifact_name(arch, "int8-dynamic", "pte", "speculative"), "int8", "speculative",
                           reference=artifact_name(arch, "int8-dynamic", "pte", "kv_cache")))
    # quantized: the KV-cache program only; it is what decodes on a device, and each lowering costs minutes
    if "8da4w" in int8:
        jobs.append(PteJob(artifact_name(arch, "8da4w", "pte", "kv_cache"), "int4", "kv_cache"))
    if "dynamic" in int8:
        jobs.append(PteJob(artifact_name(arch, "int8-dynamic", "pte", "kv_cache"), "int8", "kv_cache"))
    jobs += [PteJob(artifact_name(arch, "fp32", "pte"), "fp32", "full_sequence")]
    jobs += [PteJob(artifact_name(arch, "fp32", "pte", "speculative"), "fp32", "speculative")] if speculative else []
    jobs += [PteJob(artifact_name(arch, "fp32", "pte", "kv_cache"), "fp32", "kv_cache")]
    for k in sorted(set(cycles) - {cfg.H_cycles}):
        precision = "int8" if "dynamic" in int8 else "fp32"
        name = artifact_name(arch, "int8-dynamic" if precision == "int8" else "fp32", "pte", "kv_cache", n_cycles=k)
        jobs.append(PteJob(name, precision, "kv_cache", k))
    made = {j.name for j in jobs if j.program in programs}
    # a speculative program shares its KV program's eager reference (the same quantized model) when that is made,
    # and writes that program itself: its forward method is the KV program, lowered already
    kv_of = {j.name: next((k.name for k in jobs if k.name in made and k.program == "kv_cache" and k.n_cycles is None
                           and k.precision == j.precision), None)
             for j in jobs if j.program == "speculative" and j.name in made}
    merged = set(kv_of.values())
    return [dataclasses.replace(j, reference=j.reference if j.reference in made else None, kv=kv_of.get(j.name))
            for j in jobs if j.name in made and j.name not in merged]


def show_worker_stderr(stderr_dir: Path) -> None:
    """What the workers wrote to stderr (kept back unless --verbose), when an export fails."""
    for path in sorted(stderr_dir.glob("worker-*.stderr")):
        text = path.read_text(errors="replace").strip()
        if text:
            print(f"[export] {path.stem}:\n{text}", file=sys.stderr)


def build_pte_programs(model_dir: Path, staging: Path, jobs: list[PteJob], tokens: np.ndarray,
                       prefill_len: int) -> list[tuple[Artifact, dict]]:
    """Lower `jobs` of the model in `model_dir` into `staging` (the worker process's entry point). Returns
    (artifact, {reference name: eager quantized reference logits}) per program written."""
    torch.set_num_threads(1)  # lowering is single-threaded Python; idle OpenMP threads would spin on a shared core
    model = load_model(model_dir).eval()
    tok = load_tokenizer(model_dir / TOKENIZER)
    bos, eos = bos_id(tok), eos_id(tok)
    quantized: dict = {}  # precision -> quantized model, built once per worker
    results = []
    for job in jobs:
        t = time.perf_counter()
        if job.precision != "fp32":
            quantized[job.precision] = quantized.get(job.precision) or quantized_for_pte(model, job.precision)
        lowered = quantized.get(job.precision, model)
        paths = lower_pte_job(job, lowered, staging, bos, eos)
        weight_bytes = pte_weight_bytes(model, job.precision)
        for path, program in zip(paths, (job.program, "kv_cache")):  # the job's program (, its KV program)
            results.append(pte_artifact(job, path, program, lowered, weight_bytes, tokens, prefill_len))
        print(f"[export] wrote {' and '.join(p.name for p in paths)} in {time.perf_counter() - t:.0f} s", flush=True)
    return results


def pte_artifact(job: PteJob, path: Path, program: str, lowered, weight_bytes: int, tokens: np.ndarray,
                 prefill_len: int) -> tuple[Artifact, dict]:
    """(the manifest entry of a program `job` wrote, {reference name: eager reference logits} it computes): a
    quantized program's reference is computed by the program that owns it (its own name), once."""
    optional: dict = {"weight_bytes": weight_bytes, "table_copies": 2}
    references: dict = {}
    if program in ("kv_cache", "speculative"):
        optional["prefill_len"] = prefill_len
    if job.n_cycles is not None:
        optional |= {"cycles": job.n_cycles, "fp32_reference": f"reference/fp32.c{job.n_cycles}"}
    if job.precision != "fp32":
        reference = path.name if program == "kv_cache" else job.reference or job.name
        optional |= {"reference": reference, "quantization": _pte_quantization(job.precision)}
        if reference == path.name:
            # batch 1 as the program runs; per-token dynamic scales make prefill + decode equal the full sequence up
            # to rounding (a call of several tokens can round a value one quantum apart: the int8 bound's room)
            references[reference] = np.concatenate([eager_logits(lambda x: lowered(x, n_cycles=job.n_cycles),
                                                                 tokens[i : i + 1]) for i in range(len(tokens))])
        if program == "speculative":
            references |= adaptive_references(lowered, reference, tokens, prefill_len, batch_size=1)
    return Artifact.new(path, "pte", job.precision, program, "unrolled", **optional), references


def lower_pte_job(job: PteJob, model, staging: Path, bos: int, eos: int) -> list[Path]:
    """The job's program of `model` (fp32, or quantized by quantized_for_pte) written into staging, and its KV
    program where the job writes that too. Returns the files written."""
    path, kv = staging / job.name, job.kv and staging / job.kv
    if job.program == "speculative":
        return export_pte_speculative(model, path, bos, eos, kv_path=kv)
    lower = export_pte_decode if job.program == "kv_cache" else export_pte
    return [lower(model, path, bos, eos, n_cycles=job.n_cycles)]


def _pte_quantization(precision: str) -> dict:
    return dynamic_quantization() if precision == "int8" else dynamic_int4_quantization()


def start_pte_workers(model_dir: Path, staging: Path, jobs: list[PteJob], parity: ParitySet, log,
                      stderr_dir: Path | None):
    """Start lowering `jobs`, one job per task (its program, and its KV program where it writes that too), on two
    spawned worker processes (this machine class has 2 cores; the main process's own work is light by the time both
    are busy). Returns (pool, async results)."""
    programs = [j.name + (f" + {j.kv}" if j.kv else "") for j in jobs]  # "+": one lowering writes both
    _stage(f"lowering {len(jobs) + sum(bool(j.kv) for j in jobs)} ExecuTorch program(s) (unrolled, XNNPACK) in "
           f"worker processes: {', '.join(programs)}", log)
    pool = spawn_workers(min(2, len(jobs)), init_worker, (stderr_dir, os.getpid()))
    return pool, [pool.apply_async(build_pte_programs, (model_dir, staging, [job], parity.tokens, parity.prefill_len))
                  for job in jobs]


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m hrm_edge.export", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="train this preset (name in hrm_edge/train/presets/ or a .toml path), then export")
    src.add_argument("--checkpoint", type=path_arg,
                     help="export this checkpoint folder (config.json, model.safetensors, tokenizer.json) instead of "
                          "training")
    p.add_argument("--out", type=path_arg, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    p.add_argument("--corpus", type=text_arg,
                   help="text file or folder of UTF-8 text, or pypi; also the source of the held-out "
                        "parity windows (default: the checkpoint's or preset's corpus; for the shipped "
                        "model, the Python standard library, which it never trained on)")
    p.add_argument("--steps", type=int, help="override the preset's training steps")
    p.add_argument("--parity-samples", type=int, default=8, help="validation windows for the parity gate (default 8)")
    p.add_argument("--formats", default="onnx,pte", help="comma-separated subset of onnx,pte (default: both)")
    p.add_argument("--int8", type=text_arg,
                   help="quantized artifacts to add: comma-separated subset of static,static-shared,dynamic,8da4w,pt2e,"
                        "nbits, or none (default: the preset's [quant] int8_modes: static,dynamic for tiny, static,dynamic,nbits "
                        "for default and the shipped model). nbits: ONNX graphs with 8-bit and with 4-bit weights in onnxruntime's MatMulNBits "
                        "(weight-only, no calibration; also their self-speculative draft and verify graphs). static: "
                        "ONNX Loop graphs with calibrated int8 activation scales per iteration step; static-shared: the "
                        "same with one scale for every step (a comparison); dynamic: "
                        "ExecuTorch KV-cache program with int8 dynamic activations x int8 weights (torchao); 8da4w: the "
                        "same with 4-bit grouped weights, as ExecuTorch's Llama (gated with the preset's int4 bounds); "
                        "pt2e: ExecuTorch program with static PT2E XNNPACKQuantizer int8 (per-step scales by "
                        "construction; its quality is below the gate on the tiny preset, see README)")
    p.add_argument("--calib-samples", type=int,
                   help="calibration windows (default: the quant table of the checkpoint's train_state.json, or of "
                        "--preset's preset: 64 for the shipped model)")
    p.add_argument("--calib-corpus", type=text_arg,
                   help="text file or folder to calibrate on instead of the corpus's calibration split (less any "
                        "document of the validation split, where the parity gate's windows come from)")
    p.add_argument("--cycles", type=text_arg,
                   help="depth dial: also export the model run with K outer cycles (comma-separated, "
                   "1..H_cycles, e.g. 1); each depth gets an ONNX graph and a KV-cache .pte, gated against the eager "
                   "model at that depth, and the manifest's depth_dial lists each depth's perplexity")
    p.add_argument("--pte-programs", default=",".join(PTE_PROGRAMS),
                   help="the ExecuTorch programs to lower, comma-separated subset of full_sequence (tokens -> logits), "
                        "kv_cache (the text-LLM runner's program; the phone app's), speculative (the KV program with "
                        "draft, verify and skip methods) (default: all three; each lowering takes minutes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="also show the libraries' notices and warnings (torch, "
                   "torchao, ExecuTorch; the .pte workers' native stderr), which a plain run keeps back")
    a = p.parse_args(argv)
    quiet_third_party(a.verbose)
    formats, bad = comma_list(a.formats, ("onnx", "pte"))
    if bad or not formats:
        raise UserError(f"--formats: unknown format(s) {', '.join(bad) or '(none given)'}; choose from onnx, pte")
    int8 = parse_int8_modes(a.int8) if a.int8 is not None else None
    pte_programs = parse_pte_programs(a.pte_programs, int8)
    if a.parity_samples < 1 or (a.calib_samples is not None and a.calib_samples < 1):
        raise UserError("--parity-samples and --calib-samples must be >= 1")
    try:
        cycles = tuple(int(k) for k in a.cycles.split(",") if k.strip()) if a.cycles else ()
    except ValueError:
        raise UserError(f"--cycles: expected comma-separated integers, got {a.cycles!r}") from None
    checkpoint = a.checkpoint
    if checkpoint is None and a.preset is None and SHIPPED_CHECKPOINT.is_dir():
        checkpoint = SHIPPED_CHECKPOINT
    check_no_idle_flags(formats, int8, a.pte_programs != p.get_default("pte_programs"), a.steps is not None, checkpoint)
    ok = export_all(a.out, ExportOptions(preset=a.preset, checkpoint=checkpoint, corpus=a.corpus, steps=a.steps,
                                         parity_samples=a.parity_samples, formats=formats, int8=int8,
                                         calib_samples=a.calib_samples, calib_corpus=a.calib_corpus, cycles=cycles,
                                         pte_programs=pte_programs,
                                         progress=not a.no_progress, verbose=a.verbose))
    return 0 if ok else 1
