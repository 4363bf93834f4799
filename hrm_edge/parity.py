"""Parity gate: run every artifact in its real runtime and compare with the eager model's logits.

    python -m hrm_edge.parity DIR          # re-verify sha256 and parity of an export folder

The runtime side (load an artifact, run it, compare with expected arrays) imports numpy and the runtime
only: onnxruntime for .onnx, executorch for .pte (whose pybindings import torch themselves). Computing the
eager reference is the one part that needs torch, and it is imported only there.

The expected outputs live in the export folder's parity bundle (parity_bundle.npz): the held-out
validation token windows and the fp32 eager logits. Re-running parity on a folder also recomputes the
eager logits from model.safetensors and checks the bundle against them, so an edited bundle cannot
vouch for a wrong artifact.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hrm_edge.errors import UserError, run_cli
from hrm_edge.io import atomic_write_text, sha256_file

MANIFEST = "manifest.json"
REPORT = "parity_report.md"
BUNDLE = "parity_bundle.npz"
MANIFEST_FORMAT = 1


@dataclass
class Tolerance:
    """An artifact passes when max|logits - ref| <= rel_max_abs * (ref max - ref min), top-1 agreement
    >= min_top1 and its perplexity is within max_ppl_ratio of the reference's."""

    rel_max_abs: float
    min_top1: float
    max_ppl_ratio: float


# fp32: the issue asks for 1e-3 x logit range and 0.999 top-1; the runtimes reach ~1e-7 absolute on
# logits of range ~20 (measured), so 1e-4 still leaves two orders of margin for other CPUs' kernels.
FP32_TOLERANCE = Tolerance(rel_max_abs=1e-4, min_top1=0.999, max_ppl_ratio=1.001)


def host_target() -> str:
    return platform.machine() or "unknown"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    shifted = logits - m
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    """logits [N, S, V] float, targets [N, S] int -> exp(mean next-token NLL)."""
    lp = log_softmax(logits.astype(np.float64))
    nll = -np.take_along_axis(lp, targets[..., None], axis=-1).mean()
    return float(math.exp(nll))


def compare(logits: np.ndarray, reference: np.ndarray, targets: np.ndarray, tol: Tolerance,
            reference_name: str) -> dict:
    if logits.shape != reference.shape:
        return {"reference": reference_name, "passed": False,
                "reason": f"output shape {list(logits.shape)} != reference {list(reference.shape)}"}
    if not np.isfinite(logits).all():
        return {"reference": reference_name, "passed": False, "reason": "non-finite logits"}
    max_abs = float(np.abs(logits - reference).max())
    logit_range = float(reference.max() - reference.min())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    ppl, ref_ppl = perplexity(logits, targets), perplexity(reference, targets)
    ppl_ratio = ppl / ref_ppl
    abs_limit = tol.rel_max_abs * logit_range
    reasons = []
    if max_abs > abs_limit:
        reasons.append(f"max abs logit error {max_abs:.3g} > {abs_limit:.3g}")
    if top1 < tol.min_top1:
        reasons.append(f"top-1 agreement {top1:.4f} < {tol.min_top1}")
    if ppl_ratio > tol.max_ppl_ratio:
        reasons.append(f"perplexity ratio {ppl_ratio:.5f} > {tol.max_ppl_ratio}")
    return {
        "reference": reference_name,
        "samples": int(targets.shape[0]),
        "seq_len": int(targets.shape[1]),
        "max_abs_logit_error": max_abs,
        "logit_range": logit_range,
        "top1_agreement": top1,
        "perplexity": ppl,
        "reference_perplexity": ref_ppl,
        "tolerance": asdict(tol) | {"max_abs_logit_error": abs_limit},
        "passed": not reasons,
        "reason": "; ".join(reasons),
    }


# ---- runtimes (numpy in, numpy out) ----
def run_onnx(path: Path, tokens: np.ndarray) -> np.ndarray:
    """tokens [N, S] int64 -> logits [N, S, V] float32 with onnxruntime on the CPU."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return sess.run(None, {name: np.ascontiguousarray(tokens, dtype=np.int64)})[0]


def run_pte(path: Path, tokens: np.ndarray) -> np.ndarray:
    """tokens [N, S] int64 -> logits [N, S, V], one sequence at a time (the program has batch 1)."""
    import torch  # executorch's pybindings link libtorch and take torch tensors
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(path)).load_method("forward")
    outs = []
    for row in tokens:
        # contiguous inputs: non-contiguous ones gave silently wrong outputs in ExecuTorch 1.4 (#18562)
        t = torch.from_numpy(np.ascontiguousarray(row[None, :], dtype=np.int64)).contiguous()
        outs.append(method.execute([t])[0].detach().numpy().copy())
    return np.concatenate(outs, axis=0)


def run_artifact(path: Path, fmt: str, tokens: np.ndarray) -> np.ndarray:
    if fmt == "onnx":
        return run_onnx(path, tokens)
    if fmt == "pte":
        return run_pte(path, tokens)
    raise ValueError(f"unknown artifact format {fmt!r}")


# ---- eager reference (the only torch part) ----
def eager_logits(model, tokens: np.ndarray, batch_size: int = 4) -> np.ndarray:
    import torch

    outs = []
    with torch.no_grad():
        for i in range(0, len(tokens), batch_size):
            outs.append(model(torch.from_numpy(tokens[i : i + batch_size])).numpy())
    return np.concatenate(outs, axis=0).astype(np.float32)


def write_bundle(path: Path, windows: np.ndarray, fp32_logits: np.ndarray) -> None:
    """windows [N, S + 1] (inputs are [:, :-1], next-token targets [:, 1:]); logits [N, S, V]."""
    from hrm_edge.io import atomic_path

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, windows=windows, fp32_logits=fp32_logits)


def load_bundle(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


# ---- the gate over an export folder ----
def check_artifact(out_dir: Path, art: dict, bundle: dict, unique_weight_bytes: int) -> dict:
    """Verify one manifest entry: file present, sha256, size rule, numerical parity. Returns parity dict."""
    path = out_dir / art["path"]
    if not path.is_file():
        return {"passed": False, "reason": f"{art['path']} is missing"}
    digest = sha256_file(path)
    if digest != art["sha256"]:
        return {"passed": False, "reason": f"sha256 mismatch for {art['path']}: manifest {art['sha256'][:12]}…, "
                                          f"file {digest[:12]}… (the file was modified)"}
    size_limit = int(1.10 * unique_weight_bytes + 256 * 1024)
    windows = bundle["windows"]
    try:
        logits = run_artifact(path, art["format"], windows[:, :-1])
    except Exception as e:  # a runtime that cannot load or run the artifact fails it; it is not a crash
        return {"passed": False, "reason": f"{art['format']} runtime error: {type(e).__name__}: {str(e)[:300]}"}
    result = compare(logits, bundle["fp32_logits"], windows[:, 1:], FP32_TOLERANCE, "fp32 eager")
    result["bytes"] = path.stat().st_size
    result["size_limit_bytes"] = size_limit
    if result["bytes"] > size_limit:
        result["passed"] = False
        result["reason"] = "; ".join(filter(None, [result.get("reason"), f"{result['bytes']} bytes > size limit {size_limit}"]))
    return result


def verify_reference(out_dir: Path, bundle: dict) -> str | None:
    """Recompute eager fp32 logits from the folder's checkpoint; return a failure reason or None."""
    from hrm_edge.train import load_model

    model = load_model(out_dir)
    ref = eager_logits(model, bundle["windows"][:, :-1])
    err = float(np.abs(ref - bundle["fp32_logits"]).max())
    if err > 1e-5 * float(ref.max() - ref.min()):
        return f"parity bundle does not match the eager model in {out_dir} (max abs {err:.3g})"
    return None


def run_gate(out_dir: Path, manifest: dict, recompute_reference: bool = True, log=print) -> bool:
    """Check every artifact of `manifest` (edited in place); write manifest.json and parity_report.md."""
    target = host_target()
    failures = []
    bundle_path = out_dir / manifest["parity_bundle"]["path"]
    if not bundle_path.is_file() or sha256_file(bundle_path) != manifest["parity_bundle"]["sha256"]:
        failures.append(f"parity bundle {bundle_path.name} is missing or modified (sha256)")
        bundle = None
    else:
        bundle = load_bundle(bundle_path)
        if recompute_reference:
            reason = verify_reference(out_dir, bundle)
            if reason:
                failures.append(reason)
    tok_path = out_dir / manifest["tokenizer"]["path"]
    if not tok_path.is_file() or sha256_file(tok_path) != manifest["tokenizer"]["sha256"]:
        failures.append("tokenizer.json is missing or modified (sha256)")
    for art in manifest["artifacts"]:
        if bundle is None:
            result = {"passed": False, "reason": "no valid parity bundle"}
        else:
            result = check_artifact(out_dir, art, bundle, manifest["unique_weight_bytes"])
        art.setdefault("parity", {})[target] = result
        status = "PASS" if result["passed"] else "FAIL"
        detail = (f"max abs {result['max_abs_logit_error']:.2e}, top-1 {result['top1_agreement']:.4f}"
                  if "max_abs_logit_error" in result else "")
        log(f"  {status} {art['path']:<28} {detail} {result.get('reason', '')}".rstrip())
        if not result["passed"]:
            failures.append(f"{art['path']}: {result['reason']}")
    manifest["passed"] = not failures
    manifest["failures"] = failures
    write_manifest(out_dir, manifest)
    return not failures


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """The manifest and its readable twin are written together, the report first (the manifest is the contract)."""
    atomic_write_text(out_dir / REPORT, render_report(manifest))
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(out_dir: Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not Path(out_dir).is_dir():
        raise UserError(f"export folder not found: {out_dir}")
    if not path.is_file():
        raise UserError(f"{out_dir} has no {MANIFEST} (not an export folder, or the export did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format_version") != MANIFEST_FORMAT:
        raise UserError(f"{path}: unsupported manifest format {manifest.get('format_version')!r}")
    return manifest


def render_report(manifest: dict) -> str:
    m = manifest["model"]
    lines = [
        "# Parity report",
        "",
        f"Model: {m['arch']}, d_model {m['d_model']}, T = {manifest['block_applications']} block applications, "
        f"{manifest['parameters']['unique']:,} unique parameters "
        f"({manifest['parameters']['per_application']:,} counting each application), "
        f"unique weight bytes {manifest['unique_weight_bytes']:,}.",
        f"Reference: fp32 eager PyTorch on {manifest['parity_bundle']['samples']} held-out validation windows of "
        f"{manifest['parity_bundle']['seq_len']} tokens.",
        "",
        "| artifact | format | precision | program | target | bytes | max abs err | tol | top-1 | ppl / ref ppl | passed |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for art in manifest["artifacts"]:
        for target, r in art.get("parity", {}).items():
            if "max_abs_logit_error" in r:
                cells = (f"{r['max_abs_logit_error']:.2e} | {r['tolerance']['max_abs_logit_error']:.2e} | "
                         f"{r['top1_agreement']:.4f} | {r['perplexity']:.3f} / {r['reference_perplexity']:.3f}")
            else:
                cells = "– | – | – | –"
            ok = "yes" if r["passed"] else f"**NO**: {r.get('reason', '')}"
            lines.append(f"| {art['path']} | {art['format']} | {art['precision']} | {art['program']} | {target} | "
                         f"{art['bytes']:,} | {cells} | {ok} |")
    lines += ["", f"Overall: {'PASSED' if manifest.get('passed') else 'FAILED'}"]
    lines += [f"- {f}" for f in manifest.get("failures", [])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrm_edge.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="export folder (holds manifest.json)")
    p.add_argument("--skip-reference", action="store_true",
                   help="trust the parity bundle's expected logits instead of recomputing them with torch")
    a = p.parse_args(argv)
    manifest = read_manifest(a.dir)
    print(f"parity check of {a.dir} on {host_target()}")
    ok = run_gate(a.dir, manifest, recompute_reference=not a.skip_reference)
    print(f"{'PASSED' if ok else 'FAILED'}: report in {a.dir / REPORT}")
    if not ok:
        for f in manifest["failures"]:
            print(f"  {f}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(main)
