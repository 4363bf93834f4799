"""Export an HRM-LM to ONNX (iteration as an ONNX Loop) and ExecuTorch (XNNPACK), gate every artifact on
numerical parity with the eager model, and write manifest.json + parity_report.md.

    python -m hrm_edge.export --preset tiny --out export/out        # train the tiny preset, then export
    python -m hrm_edge.export --checkpoint runs/tiny --out D         # export an existing checkpoint

Exit codes: 0 all artifacts passed, 1 an artifact failed parity (the manifest says which and why),
2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
import json
import platform
import shutil
import time
from pathlib import Path

import numpy as np

from hrm_edge.errors import UserError, run_cli
from hrm_edge.io import atomic_path, check_writable_dir, sha256_file
from hrm_edge.parity import BUNDLE, MANIFEST, MANIFEST_FORMAT, REPORT, run_gate, tolerances

DEFAULT_OUT = Path("export/out")
SHIPPED_CHECKPOINT = Path(__file__).resolve().parent / "default_model"


def _versions() -> dict:
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


def _configs_for(checkpoint: Path, corpus: str | None):
    """The data and quant configs a checkpoint was trained with (its validation split is the parity set)."""
    from hrm_edge.config import DataConfig, QuantConfig, from_dict

    state_path = checkpoint / "train_state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    data = from_dict(DataConfig, state.get("data", {}), str(state_path))
    quant = from_dict(QuantConfig, state.get("quant", {}), str(state_path))
    if corpus:
        data.corpus = corpus
    return data, quant


INT8_MODES = ("static", "dynamic", "pt2e")


def parse_int8_modes(text: str) -> tuple[str, ...]:
    modes = () if text.strip() == "none" else tuple(m.strip() for m in text.split(",") if m.strip())
    bad = sorted(set(modes) - set(INT8_MODES))
    if bad:
        raise UserError(f"int8 modes: unknown {', '.join(bad)}; choose from static, dynamic, pt2e, or none")
    return modes
GREEDY_NEW_TOKENS = 64  # decode parity: this many greedy tokens must match eager fp32 exactly


def _artifact(path: Path, fmt: str, precision: str, program: str, iteration: str, **extra) -> dict:
    art = {"path": path.name, "format": fmt, "runtime": "onnxruntime" if fmt == "onnx" else "executorch",
           "precision": precision, "program": program, "iteration": iteration}
    if fmt == "pte":
        art["backend"] = "xnnpack"
    return art | extra


def export_ort_artifacts(out: Path, artifacts: list, log) -> None:
    """ONNX Runtime's mobile format: every ONNX artifact converted to .ort (checked by the gate like any
    other), required_operators.config for a reduced build, and the mobile-usability verdict per graph."""
    from hrm_edge.export_onnx import export_ort, mobile_usability

    onnx_arts = [a for a in artifacts if a["format"] == "onnx"]
    t = _stage(f"converting {len(onnx_arts)} ONNX graphs to ORT format", log)
    written, _ = export_ort([out / a["path"] for a in onnx_arts], out)
    for art, path in zip(onnx_arts, written):
        art["mobile_usability"] = mobile_usability(out / art["path"])
        ort_art = {k: v for k, v in art.items() if k != "mobile_usability"}
        artifacts.append(ort_art | {"path": path.name, "format": "ort", "converted_from": art["path"]})
    log(f"[export] wrote {len(written)} .ort files and required_operators.config in {time.perf_counter() - t:.0f} s")


def export_fp32_onnx(out: Path, model, artifacts: list, prefill_len: int, log) -> None:
    """fp32 ONNX graphs: full-sequence and KV-cache."""
    from hrm_edge.export_onnx import export_onnx, export_onnx_decode

    cfg = model.cfg
    loop = "onnx_loop" if cfg.arch == "hrm" else "unrolled"
    t = _stage(f"exporting fp32 ONNX ({'iteration as an ONNX Loop' if loop == 'onnx_loop' else 'unrolled'})", log)
    artifacts.append(_artifact(export_onnx(model, out / f"{cfg.arch}.fp32.onnx"), "onnx", "fp32", "full_sequence", loop))
    artifacts.append(_artifact(export_onnx_decode(model, out / f"{cfg.arch}.fp32.kv.onnx"), "onnx", "fp32",
                               "kv_cache", loop, prefill_len=prefill_len))
    log(f"[export] wrote 2 ONNX graphs in {time.perf_counter() - t:.0f} s")


# ---- ExecuTorch programs, lowered in a second process ----
# XNNPACK lowering is single-threaded Python (one to two minutes per program at the default size) and the
# bulk of an export's time, so the .pte programs are lowered in spawned worker processes (killed with this
# one) while this process writes the ONNX graphs, int8 rewrites, .ort files and eager references.
@dataclass
class PteJob:
    name: str  # file name in the export folder
    precision: str  # "fp32" or "int8" (dynamic: torchao 8-bit activations x 8-bit weights)
    program: str  # "full_sequence" or "kv_cache"
    n_cycles: int | None = None  # depth dial: outer cycles (None = all)


def pte_jobs(cfg, int8: tuple, cycles: tuple) -> list[PteJob]:
    """The programs to lower, slowest first (an int8 lowering takes about 2.5x an fp32 one at the default
    size), so that two workers finish close together."""
    jobs = []
    # int8: the KV-cache program only; it is what decodes on a device, and each int8 lowering costs minutes
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


def build_pte_programs(out: Path, jobs: list[PteJob], tokens: np.ndarray, prefill_len: int) -> list[tuple[dict, dict]]:
    """Lower `jobs` from the checkpoint copied into `out` (the worker process's entry point). Returns
    (manifest entry, {reference name: eager int8 reference logits}) per program."""
    from functools import partial

    from hrm_edge.export_executorch import export_pte, export_pte_decode, untie_head
    from hrm_edge.parity import eager_logits
    from hrm_edge.quantize import all_linear_int8_names, dynamic_int8_model, int8_weight_bytes
    from hrm_edge.tokenizer import bos_id, eos_id, load_tokenizer
    from hrm_edge.train import TOKENIZER, load_model

    import torch

    torch.set_num_threads(1)  # lowering is single-threaded Python; idle OpenMP threads would spin on a shared core
    model = load_model(out).eval()
    tok = load_tokenizer(out / TOKENIZER)
    bos, eos = bos_id(tok), eos_id(tok)
    qmodel = None
    results = []
    for job in jobs:
        t = time.perf_counter()
        extra: dict = {}
        references: dict = {}
        if job.program == "kv_cache":
            extra["prefill_len"] = prefill_len
        if job.n_cycles is not None:
            extra |= {"cycles": job.n_cycles, "fp32_reference": f"reference/fp32.c{job.n_cycles}"}
        if job.precision == "fp32":
            lower = export_pte_decode if job.program == "kv_cache" else export_pte
            path = lower(model, out / job.name, bos, eos, n_cycles=job.n_cycles)
        else:
            qmodel = qmodel or dynamic_int8_model(untie_head(model))  # the head quantized too
            path = export_pte_decode(qmodel, out / job.name, bos, eos, n_cycles=job.n_cycles)
            extra |= {"reference": job.name, "weight_bytes": int8_weight_bytes(model, all_linear_int8_names(model)),
                      "quantization": {"mode": "dynamic", "activation_scales": "dynamic per token",
                                       "activations": "int8 dynamic asymmetric per token",
                                       "weights": "int8 symmetric per output channel (every linear: block and gates)",
                                       "embedding": "int8 per row, one table shared by gather and head (weight-only head)",
                                       "calibration_sha256": None}}
            # batch 1 as the program runs; per-token dynamic scales make prefill + decode equal the full sequence
            run = partial(qmodel, n_cycles=job.n_cycles)
            references[job.name] = np.concatenate([eager_logits(run, tokens[i : i + 1]) for i in range(len(tokens))])
        results.append((_artifact(path, "pte", job.precision, job.program, "unrolled", **extra), references))
        print(f"[export] wrote {job.name} in {time.perf_counter() - t:.0f} s", flush=True)
    return results


def start_pte_workers(out: Path, jobs: list[PteJob], tokens: np.ndarray, prefill_len: int, log):
    """Start lowering `jobs`, one program per task, on two spawned worker processes (this machine class has
    2 cores; the main process's own work is light by the time both are busy). Returns (pool, async results)."""
    import multiprocessing

    _stage(f"lowering {len(jobs)} ExecuTorch program(s) (unrolled, XNNPACK) in worker processes: "
           f"{', '.join(j.name for j in jobs)}", log)
    pool = multiprocessing.get_context("spawn").Pool(min(2, len(jobs)), initializer=_die_with_parent)
    return pool, [pool.apply_async(build_pte_programs, (out, [job], tokens, prefill_len)) for job in jobs]


def export_all(out: Path, preset_name: str | None = None, checkpoint: Path | None = None,
               corpus: str | None = None, steps: int | None = None, parity_samples: int = 8,
               formats: tuple[str, ...] = ("onnx", "pte"), int8: tuple[str, ...] | None = None,
               calib_samples: int | None = None, calib_corpus: str | None = None,
               cycles: tuple[int, ...] = (), progress: bool = True, log=print) -> bool:
    """The whole pipeline into `out`. Returns True when every artifact passed the parity gate."""
    import torch

    from hrm_edge.config import load_preset
    from hrm_edge.data import encode_documents, fixed_windows, load_corpus
    from hrm_edge.model import parameter_counts, unique_weight_bytes
    from hrm_edge.parity import eager_logits, write_bundle
    from hrm_edge.quantize import parse_linear_names
    from hrm_edge.tokenizer import bos_id, eos_id, load_tokenizer
    from hrm_edge.train import CONFIG, TOKENIZER, WEIGHTS, load_model, train

    out = check_writable_dir(out)
    # A manifest from an earlier run must never describe the files this run is about to replace.
    for stale in (MANIFEST, REPORT):
        (out / stale).unlink(missing_ok=True)
    for leftover in out.glob(".*.tmp"):  # temp files of a run that was killed before its rename
        leftover.unlink()

    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        if not checkpoint.is_dir():
            raise UserError(f"checkpoint folder not found: {checkpoint}")
        data_cfg, quant_cfg = _configs_for(checkpoint, corpus)
        seq_len = None
    else:
        preset = load_preset(preset_name or "default")
        if corpus:
            preset.data.corpus = corpus
        if steps is not None:
            if steps < 1:
                raise UserError("--steps must be >= 1")
            preset.train.steps = steps
        parse_linear_names(preset.quant.static_fp32_linears)  # a typo fails now, not after training
        check_cycles(cycles, preset.model)
        checkpoint = out / "checkpoint"
        t = _stage(f"training preset {preset.name!r} into {checkpoint}", log)
        train(preset, checkpoint, progress=progress, log=log)
        log(f"[export] trained in {time.perf_counter() - t:.0f} s")
        data_cfg, quant_cfg, seq_len = preset.data, preset.quant, preset.train.seq_len

    model = load_model(checkpoint)
    check_cycles(cycles, model.cfg)
    tok = load_tokenizer(checkpoint / TOKENIZER)
    cfg = model.cfg
    if tok.get_vocab_size() != cfg.vocab_size:
        raise UserError(f"checkpoint {checkpoint}: tokenizer has {tok.get_vocab_size()} tokens, model {cfg.vocab_size}")
    if checkpoint.resolve() != out.resolve():
        for name in (CONFIG, WEIGHTS, TOKENIZER):
            with atomic_path(out / name) as tmp:
                shutil.copyfile(checkpoint / name, tmp)

    # Parity inputs: held-out validation windows (never training or calibration text).
    t = _stage("building the parity set from the validation split", log)
    corpus_obj = load_corpus(data_cfg)
    if seq_len is None:
        state = json.loads((checkpoint / "train_state.json").read_text()) if (checkpoint / "train_state.json").is_file() else {}
        seq_len = state.get("train", {}).get("seq_len", 128)
    seq_len = min(seq_len, cfg.max_seq_len)
    windows = fixed_windows(encode_documents(tok, corpus_obj.val), parity_samples, seq_len)
    reference = eager_logits(model, windows[:, :-1])
    int8_references: dict = {}

    total, unique = parameter_counts(model)
    prefill_len = max(1, seq_len // 4)  # KV-cache programs: prefill this many tokens, decode the rest
    artifacts = []
    if int8 is None:  # the preset's (or the checkpoint's) choice
        int8 = parse_int8_modes(quant_cfg.int8_modes)
    pool = None
    threads = torch.get_num_threads()
    if "pte" in formats:
        pool, programs = start_pte_workers(out, pte_jobs(cfg, int8, cycles), windows[:, :-1], prefill_len, log)
        torch.set_num_threads(1)  # the workers have the cores; more threads here would only spin against them
    try:
        if "onnx" in formats:
            export_fp32_onnx(out, model, artifacts, prefill_len, log)
        calibration, depth_dial = _export_in_this_process(
            out, model, tok, data_cfg, quant_cfg, formats, int8, cycles, artifacts, int8_references, windows,
            seq_len, calib_samples, calib_corpus, prefill_len, corpus_obj, log)
        if pool is not None:
            t = _stage("waiting for the ExecuTorch programs", log)
            for program in programs:
                for art, refs in program.get():
                    artifacts.append(art)
                    int8_references.update(refs)
            log(f"[export] ExecuTorch programs ready after {time.perf_counter() - t:.0f} s more")
            pool.close()
    except BaseException:
        if pool is not None:  # stop lowering programs nobody will list
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.join()
        torch.set_num_threads(threads)
    greedy = None
    greedy = None
    if any(a["program"] == "kv_cache" for a in artifacts):
        from hrm_edge.generate import EagerDecoder, generate

        n_new = min(GREEDY_NEW_TOKENS, cfg.max_seq_len - prefill_len)
        prompt = windows[0, :prefill_len]
        greedy = (prompt, np.array(generate(EagerDecoder(model), prompt.tolist(), n_new).tokens, dtype=np.int64),
                  {k: np.array(generate(EagerDecoder(model, n_cycles=k), prompt.tolist(), n_new).tokens, dtype=np.int64)
                   for k in set(cycles) - {cfg.H_cycles}})
    write_bundle(out / BUNDLE, windows, reference, int8_references, greedy)
    for art in artifacts:
        art["bytes"] = (out / art["path"]).stat().st_size
        art["sha256"] = sha256_file(out / art["path"])

    manifest = {
        "format_version": MANIFEST_FORMAT,
        "created_unix": int(time.time()),
        "versions": _versions(),
        "model": dataclasses.asdict(cfg),
        "block_applications": cfg.n_steps,
        "parameters": {"unique": unique, "per_application": total},
        "unique_weight_bytes": unique_weight_bytes(model),
        "size_rule": "artifact bytes <= 1.10 x unique_weight_bytes + 256 KiB",
        "checkpoint": {"config": CONFIG, "weights": WEIGHTS, "weights_sha256": sha256_file(out / WEIGHTS)},
        "tokenizer": {"path": TOKENIZER, "sha256": sha256_file(out / TOKENIZER), "vocab_size": tok.get_vocab_size(),
                      "bos_id": bos_id(tok), "eos_id": eos_id(tok)},
        "corpus": {"source": corpus_obj.source, "split_sha256": corpus_obj.names_sha256},
        "parity_bundle": {"path": BUNDLE, "sha256": sha256_file(out / BUNDLE), "samples": int(windows.shape[0]),
                          "seq_len": int(windows.shape[1] - 1), "source": "validation split"},
        "calibration": calibration,
        "depth_dial": depth_dial,
        "tolerances": tolerances(quant_cfg),
        "artifacts": artifacts,
    }
    t = _stage(f"parity gate on {len(artifacts)} artifact(s), {windows.shape[0]} x {seq_len} tokens", log)
    # The reference was computed just above from the same model: no need to recompute it.
    ok = run_gate(out, manifest, recompute_reference=False, log=log)
    log(f"[export] {'PASSED' if ok else 'FAILED'}: {out / MANIFEST}, {out / REPORT}")
    return ok


def _export_in_this_process(out, model, tok, data_cfg, quant_cfg, formats, int8, cycles, artifacts, references,
                            windows, seq_len, calib_samples, calib_corpus, prefill_len, corpus_obj, log):
    """What the export does while the worker lowers the .pte programs: calibration and the int8 ONNX
    graphs (and the opt-in PT2E program), the depth dial's ONNX graphs and references, the .ort files."""
    from hrm_edge.quantize import parse_linear_names

    calibration = None
    if int8:
        calibration = _export_int8(out, model, tok, data_cfg, formats, artifacts, references, windows, seq_len,
                                   int8, calib_samples or quant_cfg.calib_samples, calib_corpus,
                                   quant_cfg.calib_seed, prefill_len, log, corpus_obj,
                                   parse_linear_names(quant_cfg.static_fp32_linears))
    depth_dial = export_depths(out, model, formats, cycles, artifacts, references, windows, log) if cycles else None
    if "onnx" in formats:
        export_ort_artifacts(out, artifacts, log)
    return calibration, depth_dial


def check_cycles(cycles: tuple, cfg) -> None:
    if cycles and cfg.arch != "hrm":
        raise UserError("--cycles: the depth dial needs an HRM model (model.arch = hrm)")
    bad = [k for k in cycles if not 1 <= k <= cfg.H_cycles]
    if bad:
        raise UserError(f"--cycles: {bad[0]} is not in 1..{cfg.H_cycles} (the model's outer cycles, H_cycles)")


def export_depths(out, model, formats, cycles, artifacts, references, windows, log) -> list:
    """The depth dial: the same weights run with K < H outer cycles (the model was trained with a readout
    after every outer cycle). Per depth: a full-sequence ONNX Loop graph (fp32) here, and the KV-cache
    .pte (pte_jobs) in the worker, each gated against the eager model at depth K (its reference goes into
    the parity bundle). Returns the manifest's record: each depth's quality against the full depth."""
    from functools import partial

    from hrm_edge.parity import eager_logits, perplexity

    cfg = model.cfg
    check_cycles(cycles, cfg)
    tokens, targets = windows[:, :-1], windows[:, 1:]
    full = eager_logits(model, tokens)
    record = []
    for k in sorted(set(cycles) | {cfg.H_cycles}):
        logits = full if k == cfg.H_cycles else eager_logits(partial(model, n_cycles=k), tokens)
        record.append({"cycles": k, "block_applications": k * (cfg.L_cycles + 1),
                       "perplexity": perplexity(logits, targets), "full_depth_perplexity": perplexity(full, targets),
                       "top1_vs_full_depth": float((logits.argmax(-1) == full.argmax(-1)).mean())})
        if k == cfg.H_cycles:
            continue  # the full depth is the export's main artifacts
        references[f"fp32.c{k}"] = logits
        if "onnx" in formats:
            from hrm_edge.export_onnx import export_onnx

            t = _stage(f"depth dial: ONNX graph with {k} of {cfg.H_cycles} outer cycles", log)
            path = export_onnx(model, out / f"hrm.fp32.c{k}.onnx", n_cycles=k)
            artifacts.append(_artifact(path, "onnx", "fp32", "full_sequence", "onnx_loop", cycles=k,
                                       fp32_reference=f"reference/fp32.c{k}"))
            log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
    return record


def _export_int8(out, model, tok, data_cfg, formats, artifacts, references, windows, seq_len, int8, calib_samples,
                 calib_corpus, calib_seed, prefill_len, log, corpus=None, static_fp32_linears=()) -> dict:
    """Calibrate, then write the static int8 ONNX graphs (and the opt-in PT2E program) next to the fp32
    ones; their eager int8 references go into `references` (for the parity bundle). The dynamic int8
    program is lowered by the .pte worker (pte_jobs). Returns the manifest's calibration record."""
    import torch

    from hrm_edge.calibrate import activation_ranges, make_calibration_set, save_calibration_set
    from hrm_edge.io import atomic_write_text
    from hrm_edge.parity import eager_logits
    from hrm_edge.quantize import (all_linear_int8_names, int8_weight_bytes, static_int8_names,
                                   static_int8_reference, static_plan)

    cfg = model.cfg
    t = _stage(f"calibrating: {calib_samples} windows of {seq_len} tokens, ranges per iteration step", log)
    calib_windows, record = make_calibration_set(tok, data_cfg, calib_samples, seq_len, calib_seed, calib_corpus, corpus)
    save_calibration_set(out / "calibration_set.npz", calib_windows)
    ranges = activation_ranges(model, calib_windows) if cfg.arch == "hrm" else None
    calibration = dataclasses.asdict(record) | {"set": "calibration_set.npz", "ranges": "calibration.json"}
    atomic_write_text(out / "calibration.json", json.dumps(calibration | {"activation_ranges": ranges}, indent=2) + "\n")
    tokens = windows[:, :-1]
    names = {a["path"] for a in artifacts}
    kv = {"prefill_len": prefill_len}
    embedding = "int8 per row, one table shared by gather and head (weight-only head)"

    if "static" in int8 and f"{cfg.arch}.fp32.onnx" in names:
        if cfg.arch != "hrm":
            log("[export] static int8 ONNX is built for the HRM Loop graph only; skipped for the transformer baseline")
        else:
            from hrm_edge.export_onnx import quantize_static_int8

            for scales in ("per_step", "shared"):
                t = _stage(f"static int8 ONNX, activation scales {scales.replace('_', ' ')}", log)
                plan = static_plan(model, ranges, per_step=scales == "per_step", fp32_linears=static_fp32_linears)
                stem = f"hrm.int8-static-{scales.replace('_', '')}"
                quant = {"mode": "static", "activation_scales": scales,
                         "activations": "uint8 asymmetric per tensor, calibrated",
                         "weights": f"int8 symmetric per output channel ({', '.join(plan.int8_linears)})",
                         "embedding": "int8 with per-row and per-column scales, one table shared by gather and "
                                      "head (weight-only head)",
                         "fp32": ", ".join(("gates", "attention scores") + plan.fp32_linears),
                         "calibration_sha256": record.tokens_sha256}
                extra = {"reference": f"{stem}.onnx", "weight_bytes": int8_weight_bytes(model, static_int8_names(plan)),
                         "quantization": quant}
                path = quantize_static_int8(out / "hrm.fp32.onnx", out / f"{stem}.onnx", model, plan)
                artifacts.append(_artifact(path, "onnx", "int8", "full_sequence", "onnx_loop", **extra))
                # per-tensor static scales make a position's result independent of the others: the
                # full-sequence reference is the decode program's reference too
                references[f"{stem}.onnx"] = eager_logits(static_int8_reference(model, plan), tokens)
                if scales == "per_step" and "hrm.fp32.kv.onnx" in names:
                    path = quantize_static_int8(out / "hrm.fp32.kv.onnx", out / f"{stem}.kv.onnx", model, plan)
                    artifacts.append(_artifact(path, "onnx", "int8", "kv_cache", "onnx_loop", **extra, **kv))

    if "pt2e" in int8 and "pte" in formats:
        from hrm_edge.export_executorch import export_pte
        from hrm_edge.quantize import static_int8_pt2e_model
        from hrm_edge.tokenizer import bos_id, eos_id

        bos, eos = bos_id(tok), eos_id(tok)
        t = _stage("static int8 ExecuTorch program (PT2E XNNPACKQuantizer, calibrated, XNNPACK)", log)
        graph = static_int8_pt2e_model(model, calib_windows)
        path = export_pte(model, out / f"{cfg.arch}.int8-static.pte", bos, eos, traced=graph)
        log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
        with torch.no_grad():  # batch 1, as the program runs
            references[path.name] = np.concatenate([graph(torch.from_numpy(tokens[i : i + 1])).numpy()
                                                    for i in range(len(tokens))])
        artifacts.append(_artifact(
            path, "pte", "int8", "full_sequence", "unrolled", reference=path.name,
            weight_bytes=int8_weight_bytes(model, all_linear_int8_names(model)),
            quantization={"mode": "static", "activation_scales": "per_step (one observer per unrolled node)",
                          "activations": "int8 per tensor, calibrated (PT2E XNNPACKQuantizer)",
                          "weights": "int8 symmetric per output channel (every linear: block and gates)",
                          "embedding": embedding, "calibration_sha256": record.tokens_sha256}))
    return calibration


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrm_edge.export", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="train this preset (name in export/presets/ or a .toml path), then export")
    src.add_argument("--checkpoint", type=Path, help="export this checkpoint folder (config.json, model.safetensors, "
                                                     "tokenizer.json) instead of training")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    p.add_argument("--corpus", help="text file or folder of UTF-8 text (default: the Python stdlib source); also "
                                    "the source of the held-out parity windows")
    p.add_argument("--steps", type=int, help="override the preset's training steps")
    p.add_argument("--parity-samples", type=int, default=8, help="validation windows for the parity gate (default 8)")
    p.add_argument("--formats", default="onnx,pte", help="comma-separated subset of onnx,pte (default: both)")
    p.add_argument("--int8",
                   help="int8 artifacts to add: comma-separated subset of static,dynamic,pt2e, or none (default: the "
                        "preset's [quant] int8_modes: static,dynamic for tiny and default). static: ONNX Loop graphs "
                        "with calibrated activation scales, per iteration step and shared; dynamic: ExecuTorch KV-cache "
                        "program with int8 dynamic activations (torchao); "
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
    ok = export_all(a.out, preset_name=a.preset, checkpoint=checkpoint, corpus=a.corpus, steps=a.steps,
                    parity_samples=a.parity_samples, formats=formats, int8=int8, calib_samples=a.calib_samples,
                    calib_corpus=a.calib_corpus, cycles=cycles, progress=not a.no_progress)
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(main)
