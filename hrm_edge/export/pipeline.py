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
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hrm_edge.model.checkpoint import (CONFIG, TOKENIZER, WEIGHTS, configs_for, copy_model_files, load_model,
                                 load_train_state)
from hrm_edge.errors import UserError, run_cli
from hrm_edge.io import (atomic_write_text, check_writable_dir, folder_lock, one_line_write_errors, publish,
                         sha256_file, staging_folder)
from hrm_edge.runtime.manifest import BUNDLE, MANIFEST, MANIFEST_FORMAT, REPORT, Artifact, manifest_json
from hrm_edge.verify.parity import perplexity, run_gate, tolerances, write_bundle
from hrm_edge.verify.reference import eager_logits

DEFAULT_OUT = Path("export/out")
SHIPPED_CHECKPOINT = Path(__file__).resolve().parents[1] / "default_model"
INT8_MODES = ("static", "static-shared", "dynamic", "pt2e", "8da4w")
GREEDY_NEW_TOKENS = 64  # decode parity: this many greedy tokens must match eager fp32 exactly


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

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


def parse_int8_modes(text: str) -> tuple[str, ...]:
    modes = () if text.strip() == "none" else tuple(m.strip() for m in text.split(",") if m.strip())
    bad = sorted(set(modes) - set(INT8_MODES))
    if bad:
        raise UserError(f"int8 modes: unknown {', '.join(bad)}; choose from {', '.join(INT8_MODES)}, or none")
    return modes


def check_cycles(cycles: tuple, cfg) -> None:
    if cycles and cfg.arch != "hrm":
        raise UserError("--cycles: the depth dial needs an HRM model (model.arch = hrm)")
    bad = [k for k in cycles if not 1 <= k <= cfg.H_cycles]
    if bad:
        raise UserError(f"--cycles: {bad[0]} is not in 1..{cfg.H_cycles} (the model's outer cycles, H_cycles)")


# ---- the state the stages share ----
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
    progress: bool = True


@dataclass
class ExportRun:
    """One export into `out`. prepare_checkpoint fills the first block; every later stage reads what the
    earlier ones set and adds its part: artifacts (the manifest's list, in the order they are written),
    references (the parity bundle's eager references by name) and its manifest record."""

    out: Path
    options: ExportOptions
    log: Callable
    checkpoint: Path  # where the model came from (a copy of its files is in out)
    model: Any  # HRMLM, eval mode
    tok: Any  # tokenizers.Tokenizer
    data_cfg: Any  # DataConfig: the corpus whose validation split is the parity set
    quant_cfg: Any  # QuantConfig: calibration and the int8 gate's bounds
    seq_len: int  # tokens per parity (and calibration) window
    int8: tuple[str, ...]  # the int8 modes to build
    corpus: Any = None  # the loaded Corpus (build_parity_set)
    windows: np.ndarray | None = None  # [N, S + 1] validation windows: inputs [:, :-1], targets [:, 1:]
    reference: np.ndarray | None = None  # [N, S, V] eager fp32 logits of the inputs
    prefill_len: int = 0  # KV-cache programs: prefill this many tokens, decode the rest
    artifacts: list[Artifact] = field(default_factory=list)
    references: dict = field(default_factory=dict)  # bundle name -> [N, S, V] eager logits (int8, depth dial)
    calibration: dict | None = None  # the manifest's calibration record
    calib_windows: np.ndarray | None = None  # [n, S] calibration windows
    ranges: dict | None = None  # per-step activation ranges (HRM only)
    depth_dial: list | None = None  # the manifest's depth_dial record
    greedy: tuple | None = None  # (prompt, eager tokens, {K: eager tokens at depth K})

    @property
    def cfg(self):
        return self.model.cfg

    def add(self, path: Path, fmt: str, precision: str, program: str, iteration: str, **optional) -> Artifact:
        art = Artifact.new(path, fmt, precision, program, iteration, **optional)
        self.artifacts.append(art)
        return art

    def has(self, name: str) -> bool:
        return any(a.path == name for a in self.artifacts)


# ---- the output folder: one export at a time, published whole ----
EXPORT_MARKER = ".hrm-export"  # in every folder an export writes: "an export's folder", and its lock (pid inside)
STAGING = ".export-staging"  # inside the folder: where a running export writes, until it is published


def export_all(out: Path, options: ExportOptions | None = None, log=print) -> bool:
    """The whole pipeline into `out`, under its lock. The files are written into a staging folder inside `out`
    and moved in (manifest last) only when the gate has written the manifest: an export that fails part-way
    (a bad input, a full disk) leaves the folder's previous export as it was. Returns True when every
    artifact passed the parity gate."""
    options, out = options or ExportOptions(), Path(out)
    check_output_folder(out, options.checkpoint)
    with folder_lock(out, EXPORT_MARKER, log), staging_folder(out, STAGING) as staging:
        with one_line_write_errors(out):
            ok = export_stages(out, staging, options, log)
            publish(staging, out, last=(REPORT, MANIFEST))
    log(f"[export] published into {out}")
    return ok


def check_output_folder(out: Path, checkpoint: Path | None) -> None:
    """`out` is created if missing and must be writable; an existing folder must be empty, an earlier export's
    (manifest.json, or the marker every export leaves) or the checkpoint being exported: an export is never mixed
    into a folder of other files."""
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    check_writable_dir(out)
    if entries and MANIFEST not in entries and EXPORT_MARKER not in entries and not (
            checkpoint is not None and Path(checkpoint).resolve() == out.resolve()):
        shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
        raise UserError(f"--out {out} is not an export folder and holds other files ({shown}); refusing to mix an "
                        "export into it: choose a new or empty folder, or an earlier export's")


# ---- the stages, in the order export_stages runs them ----
def export_stages(out: Path, staging: Path, options: ExportOptions, log=print) -> bool:
    """Every stage, writing into `staging` (a preset is trained into out/checkpoint, which stays)."""
    run = prepare_checkpoint(out, options, log, staging)
    build_parity_set(run)
    with pte_workers(run):  # the .pte programs are lowered in worker processes meanwhile
        export_fp32_onnx(run)
        export_int8(run)
        export_depth_dial(run)
        export_ort(run)
    write_parity_bundle(run)
    manifest = build_manifest(run)
    write_web_parity_bundle(run, manifest)
    return gate(run, manifest)


def prepare_checkpoint(out: Path, options: ExportOptions, log=print, staging: Path | None = None) -> ExportRun:
    """The checkpoint (given, or trained from the preset into out/checkpoint), its model and tokenizer, and a
    copy of its files in `staging`, where the run writes (default: `out` itself)."""
    from hrm_edge.train.tokenizer import load_tokenizer

    out = check_writable_dir(out)
    staging = out if staging is None else staging
    for leftover in out.glob(".*.tmp"):  # temp files of a run that was killed before its rename
        leftover.unlink()
    if options.checkpoint is not None:
        checkpoint = Path(options.checkpoint)
        if not checkpoint.is_dir():
            raise UserError(f"checkpoint folder not found: {checkpoint}")
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
    check_cycles(options.cycles, model.cfg)
    tok = load_tokenizer(checkpoint / TOKENIZER)
    if tok.get_vocab_size() != model.cfg.vocab_size:
        raise UserError(f"checkpoint {checkpoint}: tokenizer has {tok.get_vocab_size()} tokens, model {model.cfg.vocab_size}")
    if checkpoint.resolve() != staging.resolve():
        copy_model_files(checkpoint, staging)
    int8 = options.int8 if options.int8 is not None else parse_int8_modes(quant_cfg.int8_modes)
    return ExportRun(staging, options, log, checkpoint, model, tok, data_cfg, quant_cfg,
                     min(seq_len, model.cfg.max_seq_len), int8)


def _train_preset(out: Path, options: ExportOptions, log) -> tuple:
    """Train the preset into out/checkpoint. Returns (checkpoint, data config, quant config, seq_len)."""
    from hrm_edge.config import load_preset
    from hrm_edge.export.quantize import parse_linear_names
    from hrm_edge.train.loop import train

    preset = load_preset(options.preset or "default")
    preset.override(options.corpus, options.steps)
    parse_linear_names(preset.quant.static_fp32_linears)  # a typo fails now, not after training
    check_cycles(options.cycles, preset.model)
    checkpoint = out / "checkpoint"
    t = _stage(f"training preset {preset.name!r} into {checkpoint}", log)
    train(preset, checkpoint, progress=options.progress, log=log)
    log(f"[export] trained in {time.perf_counter() - t:.0f} s")
    return checkpoint, preset.data, preset.quant, preset.train.seq_len


def build_parity_set(run: ExportRun) -> None:
    """The parity inputs: held-out validation windows (never training or calibration text), and the eager fp32
    logits every artifact is compared with."""
    from hrm_edge.train.dataset import encode_documents, fixed_windows, load_corpus

    _stage("building the parity set from the validation split", run.log)
    run.corpus = load_corpus(run.data_cfg, required_splits=("val",))  # an export reads no training text
    run.windows = fixed_windows(encode_documents(run.tok, run.corpus.val), run.options.parity_samples, run.seq_len)
    run.reference = eager_logits(run.model, run.windows[:, :-1])
    run.prefill_len = max(1, run.seq_len // 4)


@contextlib.contextmanager
def pte_workers(run: ExportRun):
    """Lower the .pte programs (pte_jobs) in worker processes while the with-block builds the rest in this one;
    at its end, wait for them and add their artifacts and eager references. An error stops the workers."""
    import torch

    pool = None
    threads = torch.get_num_threads()
    if "pte" in run.options.formats:
        jobs = pte_jobs(run.cfg, run.int8, run.options.cycles)
        pool, programs = start_pte_workers(run.out, jobs, run.windows[:, :-1], run.prefill_len, run.log)
        torch.set_num_threads(1)  # the workers have the cores; more threads here would only spin against them
    try:
        yield
        if pool is not None:
            t = _stage("waiting for the ExecuTorch programs", run.log)
            for program in programs:
                for art, refs in program.get():
                    run.artifacts.append(art)
                    run.references.update(refs)
            run.log(f"[export] ExecuTorch programs ready after {time.perf_counter() - t:.0f} s more")
            pool.close()
    except BaseException:
        if pool is not None:  # stop lowering programs nobody will list
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.join()
        torch.set_num_threads(threads)


def export_fp32_onnx(run: ExportRun) -> None:
    """fp32 ONNX graphs: full-sequence and KV-cache."""
    if "onnx" not in run.options.formats:
        return
    from hrm_edge.export.onnx import export_onnx, export_onnx_decode

    cfg = run.cfg
    loop = "onnx_loop" if cfg.arch == "hrm" else "unrolled"
    t = _stage(f"exporting fp32 ONNX ({'iteration as an ONNX Loop' if loop == 'onnx_loop' else 'unrolled'})", run.log)
    run.add(export_onnx(run.model, run.out / f"{cfg.arch}.fp32.onnx"), "onnx", "fp32", "full_sequence", loop)
    run.add(export_onnx_decode(run.model, run.out / f"{cfg.arch}.fp32.kv.onnx"), "onnx", "fp32", "kv_cache", loop,
            prefill_len=run.prefill_len)
    run.log(f"[export] wrote 2 ONNX graphs in {time.perf_counter() - t:.0f} s")


def export_int8(run: ExportRun) -> None:
    """Calibrate, then write the static int8 ONNX graphs (and the opt-in PT2E program) next to the fp32 ones;
    their eager int8 references go into run.references (for the parity bundle). The dynamic int8 program is
    lowered by a .pte worker (pte_jobs)."""
    if not run.int8:
        return
    from hrm_edge.export.quantize import parse_linear_names

    fp32_linears = parse_linear_names(run.quant_cfg.static_fp32_linears)
    calibrate(run)
    if {"static", "static-shared"} & set(run.int8) and run.has(f"{run.cfg.arch}.fp32.onnx"):
        if run.cfg.arch != "hrm":
            run.log("[export] static int8 ONNX is built for the HRM Loop graph only; skipped for the transformer baseline")
        else:
            export_static_int8_onnx(run, fp32_linears)
    if "pt2e" in run.int8 and "pte" in run.options.formats:
        export_pt2e_program(run)


def calibrate(run: ExportRun) -> None:
    """The calibration set (calibration_set.npz) and per-step activation ranges (calibration.json)."""
    from hrm_edge.export.calibrate import activation_ranges, make_calibration_set, save_calibration_set

    samples = run.options.calib_samples or run.quant_cfg.calib_samples
    _stage(f"calibrating: {samples} windows of {run.seq_len} tokens, ranges per iteration step", run.log)
    run.calib_windows, record = make_calibration_set(run.tok, run.data_cfg, samples, run.seq_len, run.quant_cfg.calib_seed,
                                                     run.options.calib_corpus, run.corpus)
    save_calibration_set(run.out / "calibration_set.npz", run.calib_windows)
    run.ranges = activation_ranges(run.model, run.calib_windows) if run.cfg.arch == "hrm" else None
    run.calibration = dataclasses.asdict(record) | {"set": "calibration_set.npz", "ranges": "calibration.json"}
    atomic_write_text(run.out / "calibration.json",
                      json.dumps(run.calibration | {"activation_ranges": run.ranges}, indent=2) + "\n")


def export_static_int8_onnx(run: ExportRun, fp32_linears: tuple) -> None:
    """Static int8 inside the Loop body, with activation scales per iteration step (static: + the KV-cache
    graph) and/or one scale shared by every step (static-shared: a comparison; on the default model it misses
    the top-1 gate that per-step scales pass, so it is opt-in)."""
    from hrm_edge.export.onnx import quantize_static_int8
    from hrm_edge.export.quantize import (int8_weight_bytes, static_int8_names, static_int8_reference, static_onnx_quantization,
                                   static_plan)

    model, tokens = run.model, run.windows[:, :-1]
    for scales in [s for s, mode in (("per_step", "static"), ("shared", "static-shared")) if mode in run.int8]:
        _stage(f"static int8 ONNX, activation scales {scales.replace('_', ' ')}", run.log)
        plan = static_plan(model, run.ranges, per_step=scales == "per_step", fp32_linears=fp32_linears)
        stem = f"hrm.int8-static-{scales.replace('_', '')}"
        int8 = {"reference": f"{stem}.onnx", "weight_bytes": int8_weight_bytes(model, static_int8_names(plan)),
                "quantization": static_onnx_quantization(plan, run.calibration["tokens_sha256"])}
        path = quantize_static_int8(run.out / "hrm.fp32.onnx", run.out / f"{stem}.onnx", model, plan)
        run.add(path, "onnx", "int8", "full_sequence", "onnx_loop", **int8)
        # per-tensor static scales make a position's result independent of the others: the
        # full-sequence reference is the decode program's reference too
        run.references[f"{stem}.onnx"] = eager_logits(static_int8_reference(model, plan), tokens)
        if scales == "per_step" and run.has("hrm.fp32.kv.onnx"):
            path = quantize_static_int8(run.out / "hrm.fp32.kv.onnx", run.out / f"{stem}.kv.onnx", model, plan)
            run.add(path, "onnx", "int8", "kv_cache", "onnx_loop", prefill_len=run.prefill_len, **int8)


def export_pt2e_program(run: ExportRun) -> None:
    """The opt-in static PT2E int8 ExecuTorch program (calibrated, XNNPACK), built in this process."""
    import torch

    from hrm_edge.export.executorch import export_pte
    from hrm_edge.export.quantize import all_linear_int8_names, int8_weight_bytes, pt2e_quantization, static_int8_pt2e_model
    from hrm_edge.train.tokenizer import bos_id, eos_id

    tokens = run.windows[:, :-1]
    t = _stage("static int8 ExecuTorch program (PT2E XNNPACKQuantizer, calibrated, XNNPACK)", run.log)
    graph = static_int8_pt2e_model(run.model, run.calib_windows)
    path = export_pte(run.model, run.out / f"{run.cfg.arch}.int8-static.pte", bos_id(run.tok), eos_id(run.tok), traced=graph)
    run.log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
    with torch.no_grad():  # batch 1, as the program runs
        run.references[path.name] = np.concatenate([graph(torch.from_numpy(tokens[i : i + 1])).numpy()
                                                    for i in range(len(tokens))])
    run.add(path, "pte", "int8", "full_sequence", "unrolled", reference=path.name,
            weight_bytes=int8_weight_bytes(run.model, all_linear_int8_names(run.model)),
            quantization=pt2e_quantization(run.calibration["tokens_sha256"]))


def export_depth_dial(run: ExportRun) -> None:
    """The depth dial (--cycles): the same weights run with K < H outer cycles (the model was trained with a
    readout after every outer cycle). Per depth: a full-sequence ONNX Loop graph (fp32) here, and the KV-cache
    .pte (pte_jobs) in a worker, each gated against the eager model at depth K (its reference goes into the
    parity bundle). run.depth_dial: each depth's quality against the full depth."""
    if not run.options.cycles:
        return
    from functools import partial

    cfg, model = run.cfg, run.model
    check_cycles(run.options.cycles, cfg)
    tokens, targets = run.windows[:, :-1], run.windows[:, 1:]
    full = eager_logits(model, tokens)
    run.depth_dial = []
    for k in sorted(set(run.options.cycles) | {cfg.H_cycles}):
        logits = full if k == cfg.H_cycles else eager_logits(partial(model, n_cycles=k), tokens)
        run.depth_dial.append({"cycles": k, "block_applications": k * (cfg.L_cycles + 1),
                               "perplexity": perplexity(logits, targets), "full_depth_perplexity": perplexity(full, targets),
                               "top1_vs_full_depth": float((logits.argmax(-1) == full.argmax(-1)).mean())})
        if k == cfg.H_cycles:
            continue  # the full depth is the export's main artifacts
        run.references[f"fp32.c{k}"] = logits
        if "onnx" in run.options.formats:
            from hrm_edge.export.onnx import export_onnx

            t = _stage(f"depth dial: ONNX graph with {k} of {cfg.H_cycles} outer cycles", run.log)
            path = export_onnx(model, run.out / f"hrm.fp32.c{k}.onnx", n_cycles=k)
            run.add(path, "onnx", "fp32", "full_sequence", "onnx_loop", cycles=k, fp32_reference=f"reference/fp32.c{k}")
            run.log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")


def export_ort(run: ExportRun) -> None:
    """ONNX Runtime's mobile format: every ONNX artifact converted to .ort (checked by the gate like any
    other), required_operators.config for a reduced build, and the mobile-usability verdict per graph."""
    if "onnx" not in run.options.formats:
        return
    from hrm_edge.export.onnx import export_ort as convert, mobile_usability

    onnx_arts = [a for a in run.artifacts if a.format == "onnx"]
    t = _stage(f"converting {len(onnx_arts)} ONNX graphs to ORT format", run.log)
    written, _ = convert([run.out / a.path for a in onnx_arts], run.out)
    for art, path in zip(onnx_arts, written):
        art.mobile_usability = mobile_usability(run.out / art.path)
        run.artifacts.append(dataclasses.replace(art, path=path.name, format="ort", converted_from=art.path,
                                                 mobile_usability=None))
    run.log(f"[export] wrote {len(written)} .ort files and required_operators.config in {time.perf_counter() - t:.0f} s")


def write_parity_bundle(run: ExportRun) -> None:
    """The eager fp32 model's greedy continuation (at every exported depth) that the KV-cache programs must
    replay, written with the windows and references into the parity bundle; then every artifact's bytes
    and sha256, now that all files are final."""
    cfg = run.cfg
    if any(a.program == "kv_cache" for a in run.artifacts):
        from hrm_edge.model.eager import EagerDecoder
        from hrm_edge.runtime.decoders import generate

        n_new = min(GREEDY_NEW_TOKENS, cfg.max_seq_len - run.prefill_len)
        prompt = run.windows[0, :run.prefill_len]

        def greedy(n_cycles=None):
            tokens = generate(EagerDecoder(run.model, n_cycles=n_cycles), prompt.tolist(), n_new).tokens
            return np.array(tokens, dtype=np.int64)

        run.greedy = (prompt, greedy(), {k: greedy(k) for k in set(run.options.cycles) - {cfg.H_cycles}})
    write_bundle(run.out / BUNDLE, run.windows, run.reference, run.references, run.greedy)
    for art in run.artifacts:
        art.bytes = (run.out / art.path).stat().st_size
        art.sha256 = sha256_file(run.out / art.path)


def build_manifest(run: ExportRun) -> dict:
    from hrm_edge.model.lm import parameter_counts, unique_weight_bytes
    from hrm_edge.train.tokenizer import bos_id, eos_id

    cfg, out, tok, windows = run.cfg, run.out, run.tok, run.windows
    total, unique = parameter_counts(run.model)
    return {
        "format_version": MANIFEST_FORMAT,
        "created_unix": int(time.time()),
        "versions": versions(),
        "model": dataclasses.asdict(cfg),
        "block_applications": cfg.n_steps,
        "parameters": {"unique": unique, "per_application": total},
        "unique_weight_bytes": unique_weight_bytes(run.model),
        "size_rule": "artifact bytes <= 1.10 x unique_weight_bytes + 256 KiB",
        "checkpoint": {"config": CONFIG, "weights": WEIGHTS, "weights_sha256": sha256_file(out / WEIGHTS)},
        "tokenizer": {"path": TOKENIZER, "sha256": sha256_file(out / TOKENIZER), "vocab_size": tok.get_vocab_size(),
                      "bos_id": bos_id(tok), "eos_id": eos_id(tok)},
        "corpus": {"source": run.corpus.source, "split_sha256": run.corpus.names_sha256},
        "parity_bundle": {"path": BUNDLE, "sha256": sha256_file(out / BUNDLE), "samples": int(windows.shape[0]),
                          "seq_len": int(windows.shape[1] - 1), "source": "validation split"},
        "calibration": run.calibration,
        "depth_dial": run.depth_dial,
        "tolerances": tolerances(run.quant_cfg),
        "artifacts": run.artifacts,
    }


def write_web_parity_bundle(run: ExportRun, manifest: dict) -> None:
    """The phone-sized parity bundle the demo's Self-test runs (hrm_edge.verify.web_bundle), listed in the manifest."""
    if not any(a.program == "kv_cache" for a in run.artifacts):
        return
    from hrm_edge.verify.parity import load_bundle
    from hrm_edge.verify.web_bundle import write_web_bundle

    as_json = json.loads(manifest_json(manifest))
    path = write_web_bundle(run.out, as_json, load_bundle(run.out / BUNDLE))
    manifest["web_bundle"] = {"path": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
                              "source": "the parity bundle's first windows, cut to prefill + a few decode steps"}


def gate(run: ExportRun, manifest: dict) -> bool:
    """Run every artifact in its runtime against the bundle; writes manifest.json and parity_report.md."""
    _stage(f"parity gate on {len(run.artifacts)} artifact(s), {run.windows.shape[0]} x {run.seq_len} tokens", run.log)
    # The reference was computed by build_parity_set from the same model: no need to recompute it.
    ok = run_gate(run.out, manifest, recompute_reference=False, log=run.log)
    run.log(f"[export] {'PASSED' if ok else 'FAILED'} (the verdicts: {MANIFEST}, {REPORT})")
    return ok


# ---- ExecuTorch programs, lowered in worker processes ----
# XNNPACK lowering is single-threaded Python (one to two minutes per program at the default size) and the
# bulk of an export's time, so the .pte programs are lowered in spawned worker processes (killed with this
# one) while this process writes the ONNX graphs, int8 rewrites, .ort files and eager references.
@dataclass
class PteJob:
    name: str  # file name in the export folder
    precision: str  # "fp32", "int8" (torchao 8-bit dynamic activations x 8-bit weights) or "int4" (x 4-bit weights)
    program: str  # "full_sequence" or "kv_cache"
    n_cycles: int | None = None  # depth dial: outer cycles (None = all)


def pte_jobs(cfg, int8: tuple, cycles: tuple) -> list[PteJob]:
    """The programs to lower, slowest first (a quantized lowering takes about 2.5x an fp32 one at the default
    size), so that two workers finish close together."""
    jobs = []
    # quantized: the KV-cache program only; it is what decodes on a device, and each lowering costs minutes
    if "8da4w" in int8:
        jobs.append(PteJob(f"{cfg.arch}.8da4w.kv.pte", "int4", "kv_cache"))
    if "dynamic" in int8:
        jobs.append(PteJob(f"{cfg.arch}.int8-dynamic.kv.pte", "int8", "kv_cache"))
    jobs += [PteJob(f"{cfg.arch}.fp32.pte", "fp32", "full_sequence"), PteJob(f"{cfg.arch}.fp32.kv.pte", "fp32", "kv_cache")]
    for k in sorted(set(cycles) - {cfg.H_cycles}):
        precision = "int8" if "dynamic" in int8 else "fp32"
        jobs.append(PteJob(f"hrm.{'int8-dynamic' if precision == 'int8' else 'fp32'}.c{k}.kv.pte", precision, "kv_cache", k))
    return jobs


def _die_with_parent() -> None:
    # a worker must not outlive a killed export (kill -9 leaves no orphan still writing into the folder)
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def build_pte_programs(out: Path, jobs: list[PteJob], tokens: np.ndarray, prefill_len: int) -> list[tuple[Artifact, dict]]:
    """Lower `jobs` from the checkpoint copied into `out` (the worker process's entry point). Returns
    (artifact, {reference name: eager quantized reference logits}) per program."""
    from hrm_edge.export.executorch import export_pte, export_pte_decode, quantized_for_pte
    from hrm_edge.export.quantize import pte_weight_bytes
    from hrm_edge.train.tokenizer import bos_id, eos_id, load_tokenizer

    import torch

    torch.set_num_threads(1)  # lowering is single-threaded Python; idle OpenMP threads would spin on a shared core
    model = load_model(out).eval()
    tok = load_tokenizer(out / TOKENIZER)
    bos, eos = bos_id(tok), eos_id(tok)
    quantized: dict = {}  # precision -> quantized model, built once per worker
    results = []
    for job in jobs:
        t = time.perf_counter()
        optional: dict = {"weight_bytes": pte_weight_bytes(model, job.precision), "table_copies": 2}
        references: dict = {}
        if job.program == "kv_cache":
            optional["prefill_len"] = prefill_len
        if job.n_cycles is not None:
            optional |= {"cycles": job.n_cycles, "fp32_reference": f"reference/fp32.c{job.n_cycles}"}
        if job.precision == "fp32":
            lower = export_pte_decode if job.program == "kv_cache" else export_pte
            path = lower(model, out / job.name, bos, eos, n_cycles=job.n_cycles)
        else:
            qmodel = quantized.get(job.precision) or quantized_for_pte(model, job.precision)
            quantized[job.precision] = qmodel
            path = export_pte_decode(qmodel, out / job.name, bos, eos, n_cycles=job.n_cycles)
            optional |= {"reference": job.name, "quantization": _pte_quantization(job.precision)}
            # batch 1 as the program runs; per-token dynamic scales make prefill + decode equal the full sequence
            references[job.name] = np.concatenate([eager_logits(lambda x: qmodel(x, n_cycles=job.n_cycles), tokens[i : i + 1])
                                                   for i in range(len(tokens))])
        results.append((Artifact.new(path, "pte", job.precision, job.program, "unrolled", **optional), references))
        print(f"[export] wrote {job.name} in {time.perf_counter() - t:.0f} s", flush=True)
    return results


def _pte_quantization(precision: str) -> dict:
    from hrm_edge.export.quantize import dynamic_int4_quantization, dynamic_quantization

    return dynamic_quantization() if precision == "int8" else dynamic_int4_quantization()


def start_pte_workers(out: Path, jobs: list[PteJob], tokens: np.ndarray, prefill_len: int, log):
    """Start lowering `jobs`, one program per task, on two spawned worker processes (this machine class has
    2 cores; the main process's own work is light by the time both are busy). Returns (pool, async results)."""
    import multiprocessing

    _stage(f"lowering {len(jobs)} ExecuTorch program(s) (unrolled, XNNPACK) in worker processes: "
           f"{', '.join(j.name for j in jobs)}", log)
    pool = multiprocessing.get_context("spawn").Pool(min(2, len(jobs)), initializer=_die_with_parent)
    return pool, [pool.apply_async(build_pte_programs, (out, [job], tokens, prefill_len)) for job in jobs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrm_edge.export", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="train this preset (name in hrm_edge/train/presets/ or a .toml path), then export")
    src.add_argument("--checkpoint", type=Path, help="export this checkpoint folder (config.json, model.safetensors, "
                                                     "tokenizer.json) instead of training")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    p.add_argument("--corpus", help="text file or folder of UTF-8 text, or pypi; also the source of the held-out "
                                    "parity windows (default: the checkpoint's or preset's corpus; for the shipped "
                                    "model, the Python standard library, which it never trained on)")
    p.add_argument("--steps", type=int, help="override the preset's training steps")
    p.add_argument("--parity-samples", type=int, default=8, help="validation windows for the parity gate (default 8)")
    p.add_argument("--formats", default="onnx,pte", help="comma-separated subset of onnx,pte (default: both)")
    p.add_argument("--int8",
                   help="quantized artifacts to add: comma-separated subset of static,static-shared,dynamic,8da4w,pt2e, or "
                        "none (default: the preset's [quant] int8_modes: static,dynamic for tiny and default). static: "
                        "ONNX Loop graphs with calibrated int8 activation scales per iteration step; static-shared: the "
                        "same with one scale for every step (a comparison); dynamic: "
                        "ExecuTorch KV-cache program with int8 dynamic activations x int8 weights (torchao); 8da4w: the "
                        "same with 4-bit grouped weights, as ExecuTorch's Llama (gated with the preset's int4 bounds); "
                        "pt2e: ExecuTorch program with static PT2E XNNPACKQuantizer int8 (per-step scales by "
                        "construction; its quality is below the gate on the tiny preset, see README)")
    p.add_argument("--calib-samples", type=int, help="calibration windows (default: the preset's, 32)")
    p.add_argument("--calib-corpus", help="text file or folder to calibrate on instead of the corpus's calibration split")
    p.add_argument("--cycles", help="depth dial: also export the model run with K outer cycles (comma-separated, "
                   "1..H_cycles, e.g. 1); each depth gets an ONNX graph and a KV-cache .pte, gated against the eager "
                   "model at that depth, and the manifest's depth_dial lists each depth's perplexity")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    formats = tuple(f.strip() for f in a.formats.split(",") if f.strip())
    bad = sorted(set(formats) - {"onnx", "pte"})
    if bad or not formats:
        raise UserError(f"--formats: unknown format(s) {', '.join(bad) or '(none given)'}; choose from onnx, pte")
    int8 = parse_int8_modes(a.int8) if a.int8 is not None else None
    if a.parity_samples < 1:
        raise UserError("--parity-samples must be >= 1")
    try:
        cycles = tuple(int(k) for k in a.cycles.split(",") if k.strip()) if a.cycles else ()
    except ValueError:
        raise UserError(f"--cycles: expected comma-separated integers, got {a.cycles!r}") from None
    checkpoint = a.checkpoint
    if checkpoint is None and a.preset is None and SHIPPED_CHECKPOINT.is_dir():
        checkpoint = SHIPPED_CHECKPOINT
    ok = export_all(a.out, ExportOptions(preset=a.preset, checkpoint=checkpoint, corpus=a.corpus, steps=a.steps,
                                         parity_samples=a.parity_samples, formats=formats, int8=int8,
                                         calib_samples=a.calib_samples, calib_corpus=a.calib_corpus, cycles=cycles,
                                         progress=not a.no_progress))
    return 0 if ok else 1
