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
import json
import platform
import shutil
import sys
import time
from pathlib import Path

from hrm_edge.errors import UserError, run_cli
from hrm_edge.io import check_writable_dir, sha256_file
from hrm_edge.parity import BUNDLE, MANIFEST, MANIFEST_FORMAT, REPORT, run_gate

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


def _data_config_for(checkpoint: Path, corpus: str | None):
    """The data config a checkpoint was trained with (its validation split is the parity set)."""
    from hrm_edge.config import DataConfig, from_dict

    state_path = checkpoint / "train_state.json"
    data = DataConfig()
    if state_path.is_file():
        data = from_dict(DataConfig, json.loads(state_path.read_text()).get("data", {}), str(state_path))
    if corpus:
        data.corpus = corpus
    return data


def export_all(out: Path, preset_name: str | None = None, checkpoint: Path | None = None,
               corpus: str | None = None, steps: int | None = None, parity_samples: int = 8,
               formats: tuple[str, ...] = ("onnx", "pte"), progress: bool = True, log=print) -> bool:
    """The whole pipeline into `out`. Returns True when every artifact passed the parity gate."""
    from hrm_edge.config import load_preset
    from hrm_edge.data import encode_documents, fixed_windows, load_corpus
    from hrm_edge.model import parameter_counts, unique_weight_bytes
    from hrm_edge.parity import eager_logits, write_bundle
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
        data_cfg = _data_config_for(checkpoint, corpus)
        seq_len = None
    else:
        preset = load_preset(preset_name or "default")
        if corpus:
            preset.data.corpus = corpus
        if steps is not None:
            if steps < 1:
                raise UserError("--steps must be >= 1")
            preset.train.steps = steps
        checkpoint = out / "checkpoint"
        t = _stage(f"training preset {preset.name!r} into {checkpoint}", log)
        train(preset, checkpoint, progress=progress, log=log)
        log(f"[export] trained in {time.perf_counter() - t:.0f} s")
        data_cfg, seq_len = preset.data, preset.train.seq_len

    model = load_model(checkpoint)
    tok = load_tokenizer(checkpoint / TOKENIZER)
    cfg = model.cfg
    if tok.get_vocab_size() != cfg.vocab_size:
        raise UserError(f"checkpoint {checkpoint}: tokenizer has {tok.get_vocab_size()} tokens, model {cfg.vocab_size}")
    if checkpoint.resolve() != out.resolve():
        for name in (CONFIG, WEIGHTS, TOKENIZER):
            shutil.copyfile(checkpoint / name, out / name)

    # Parity inputs: held-out validation windows (never training or calibration text).
    t = _stage("building the parity set from the validation split", log)
    corpus_obj = load_corpus(data_cfg)
    if seq_len is None:
        state = json.loads((checkpoint / "train_state.json").read_text()) if (checkpoint / "train_state.json").is_file() else {}
        seq_len = state.get("train", {}).get("seq_len", 128)
    seq_len = min(seq_len, cfg.max_seq_len)
    windows = fixed_windows(encode_documents(tok, corpus_obj.val), parity_samples, seq_len)
    reference = eager_logits(model, windows[:, :-1])
    write_bundle(out / BUNDLE, windows, reference)

    total, unique = parameter_counts(model)
    stem = f"{cfg.arch}"
    artifacts = []
    if "onnx" in formats:
        from hrm_edge.export_onnx import export_onnx

        t = _stage("exporting fp32 ONNX (iteration as an ONNX Loop)" if cfg.arch == "hrm" else "exporting fp32 ONNX", log)
        path = export_onnx(model, out / f"{stem}.fp32.onnx")
        log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
        artifacts.append({"path": path.name, "format": "onnx", "runtime": "onnxruntime", "precision": "fp32",
                          "program": "full_sequence", "iteration": "onnx_loop" if cfg.arch == "hrm" else "unrolled"})
    if "pte" in formats:
        from hrm_edge.export_executorch import export_pte

        t = _stage("exporting fp32 ExecuTorch program (unrolled, XNNPACK)", log)
        path = export_pte(model, out / f"{stem}.fp32.pte", bos_id(tok), eos_id(tok))
        log(f"[export] wrote {path.name} in {time.perf_counter() - t:.0f} s")
        artifacts.append({"path": path.name, "format": "pte", "runtime": "executorch", "backend": "xnnpack",
                          "precision": "fp32", "program": "full_sequence", "iteration": "unrolled"})
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
        "artifacts": artifacts,
    }
    t = _stage(f"parity gate on {len(artifacts)} artifact(s), {windows.shape[0]} x {seq_len} tokens", log)
    # The reference was computed just above from the same model: no need to recompute it.
    ok = run_gate(out, manifest, recompute_reference=False, log=log)
    log(f"[export] {'PASSED' if ok else 'FAILED'}: {out / MANIFEST}, {out / REPORT}")
    return ok


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
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    formats = tuple(f.strip() for f in a.formats.split(",") if f.strip())
    bad = sorted(set(formats) - {"onnx", "pte"})
    if bad or not formats:
        raise UserError(f"--formats: unknown format(s) {', '.join(bad) or '(none given)'}; choose from onnx, pte")
    if a.parity_samples < 1:
        raise UserError("--parity-samples must be >= 1")
    checkpoint = a.checkpoint
    if checkpoint is None and a.preset is None and SHIPPED_CHECKPOINT.is_dir():
        checkpoint = SHIPPED_CHECKPOINT
    ok = export_all(a.out, preset_name=a.preset, checkpoint=checkpoint, corpus=a.corpus, steps=a.steps,
                    parity_samples=a.parity_samples, formats=formats, progress=not a.no_progress)
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(main)
