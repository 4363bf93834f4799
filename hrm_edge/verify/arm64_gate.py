"""The parity gate on emulated ARM64: the same artifacts and bundle, run by real aarch64 kernels under QEMU.

    python -m hrm_edge.parity DIR --target aarch64 [--cpu cortex-a76,max]   # check an export folder

The target gate (run_target_gate, and target_main, which the parity CLI runs for --target aarch64) starts one
emulated Python per CPU model (toolchain: hrm_edge.verify.arm64_toolchain), in which hrm_edge.verify.arm64_worker
checks each artifact against the parity bundle with hrm_edge.verify.parity's runtime side (no torch for ONNX/ORT),
exactly as on the host; the host then measures how far the ARM64 logits are from its own x86 logits of the same
artifact. It builds on hrm_edge.verify.parity, which never imports this module.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hrm_edge.errors import UserError
from hrm_edge.runtime.manifest import Artifact
from hrm_edge.verify.arm64_toolchain import TARGET, Toolchain, cache_dir, ensure_toolchain, qemu_cpu_models
from hrm_edge.verify.parity import (checked_bundle, gate_tolerances, host_target, run_artifact, target_rows, verdict,
                                   write_manifest)

# An emulated process is killed when no artifact has finished for this long (a hung process), not after a fixed
# total: the default export's 24 ONNX/ORT artifacts take over an hour on one emulated core (the slowest, the fp32
# draft graph with its speculative rounds, 823 s on the Intel Xeon of 2026-12-02), and exports grow.
STALL_TIMEOUT_S = 1800


# ---- running the checks on the target ----
# the emulated Python runs this (-c) with the package copy on its path
WORKER = "import sys; from hrm_edge.verify.arm64_worker import worker_main; sys.exit(worker_main(sys.argv[1]))"


@dataclass
class TargetRun:
    cpu_model: str
    results: dict  # artifact path -> parity result (as the host's parity entries, plus "seconds")
    logits: dict  # artifact path -> logits [N, S, V] the artifact produced on the target
    info: dict  # what the emulated Python saw: machine, CPU features, runtime versions
    seconds: float


def _copy_package(dest: Path) -> Path:
    """hrm_edge's .py files into dest/hrm_edge: the emulated Python gets the package, never the host's site-packages
    (where an installed hrm_edge lives beside x86 numpy)."""
    src = Path(__file__).resolve().parents[1]
    for f in src.rglob("*.py"):
        target = dest / "hrm_edge" / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    return dest


def run_on_target(out_dir: Path, manifest: dict, artifacts: list[Artifact], cpu_model: str, tc: Toolchain, log=print,
                  timeout: float = STALL_TIMEOUT_S) -> TargetRun:
    """Check `artifacts` (manifest entries) of out_dir in ONE emulated Python on `cpu_model` (torch, when needed,
    is imported once per process: ~20-40 s under emulation). The process is killed when it prints nothing (a line
    per finished artifact) for `timeout` seconds. An artifact the process did not get to (crash, stall) fails with
    the reason; none is left out."""
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hrm-aarch64-") as tmp:
        tmp = Path(tmp)
        pkg_root = _copy_package(tmp / "src")
        spec = {"out_dir": str(Path(out_dir).resolve()), "bundle": manifest["parity_bundle"]["path"],
                "unique_weight_bytes": manifest["unique_weight_bytes"], "tolerances": gate_tolerances(manifest),
                "artifacts": [a.to_json() for a in artifacts], "result_dir": str(tmp / "results"),
                "target": TARGET}
        (tmp / "spec.json").write_text(json.dumps(spec))
        (tmp / "results").mkdir()
        stderr_path = tmp / "stderr.txt"
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(tc.command(cpu_model, ["-c", WORKER, tmp / "spec.json"]), stdout=subprocess.PIPE,
                                    stderr=err, text=True, env=tc.env([pkg_root]), cwd=tmp)
            last_line = [time.monotonic()]
            threading.Thread(target=_kill_when_silent, args=(proc, last_line, timeout), daemon=True).start()
            for line in proc.stdout:
                last_line[0] = time.monotonic()
                log(f"  [{TARGET} {cpu_model}] {line.rstrip()}")
            proc.wait()
        results_file = tmp / "results" / "results.json"
        done = json.loads(results_file.read_text()) if results_file.is_file() else {"info": {}, "artifacts": {}}
        results, logits = {}, {}
        why = f"exit code {proc.returncode}"
        if proc.returncode != 0:
            tail = [ln for ln in stderr_path.read_text(errors="replace").splitlines() if ln.strip()][-3:]
            why = ("killed after %.0f s without a finished artifact" % timeout if proc.returncode == -9
                   else f"exit code {proc.returncode}") + (f": {' | '.join(tail)[:400]}" if tail else "")
        for art in artifacts:
            entry = done["artifacts"].get(art.path)
            if entry is None:
                results[art.path] = {"passed": False, "reason": f"the emulated process ended ({why}) before "
                                                                f"checking {art.path}"}
                continue
            results[art.path] = entry["result"]
            if entry.get("logits"):
                logits[art.path] = np.load(tmp / "results" / entry["logits"])
        # the bytecode of this run's package copy is of no use to the next run
        shutil.rmtree(cache_dir() / "pycache" / tmp.relative_to(tmp.anchor), ignore_errors=True)
    return TargetRun(cpu_model, results, logits, done.get("info", {}), round(time.time() - t0, 1))


def _kill_when_silent(proc: subprocess.Popen, last_line: list, timeout: float) -> None:
    """Kill proc once `timeout` seconds pass after its last output line (last_line[0], time.monotonic())."""
    while proc.poll() is None:
        if time.monotonic() - last_line[0] > timeout:
            proc.kill()
            return
        time.sleep(min(1.0, timeout / 4))


# ---- the parity gate on the target ----
def run_target_gate(out_dir: Path, manifest: dict, target: str, cpu_models: list[str], skip: dict | None = None,
                    recompute_reference: bool = True, log=print) -> bool:
    """Run every artifact of `manifest` on `target` once per CPU model (one emulated process each) and compare it
    with the parity bundle exactly as check_artifact does on the host, with the manifest's tolerances; also record
    how far the target's logits are from this host's logits of the same artifact (x86_vs_arm64_*). Writes
    art.targets[target][cpu_model] and manifest["targets"][target] (verdict, failures, versions, CPU
    features); the host's verdict (manifest["passed"]) is left as it is. skip: {format: reason}."""
    if target != TARGET:
        raise UserError(f"unknown target {target!r} (known: host, {TARGET})")
    skip = skip or {}
    failures, skipped, arts = [], [], []
    bundle = checked_bundle(out_dir, manifest, recompute_reference, failures)
    for art in manifest["artifacts"]:
        art.clear_target(target)  # this run's CPU models replace any earlier entries
        if art.format in skip:
            skipped.append({"path": art.path, "reason": skip[art.format]})
            log(f"  SKIP {art.path:<34} {skip[art.format]}")
        else:
            arts.append(art)
    summary = {"host": host_target(), "cpu_models": {}, "checked_unix": int(time.time())}
    if bundle is None:
        for art in arts:
            for cpu in cpu_models:
                art.targets[target][cpu] = {"passed": False, "reason": "no valid parity bundle"}
    elif arts:
        summary |= _check_on_cpu_models(out_dir, manifest, arts, cpu_models, bundle, log)
    for art in arts:
        for cpu, result in art.targets[target].items():
            if not result["passed"]:
                failures.append(f"{art.path} on {target} {cpu}: {result['reason']}")
    summary |= {"passed": not failures, "failures": failures, "skipped": skipped}
    manifest.setdefault("targets", {})[target] = summary
    write_manifest(out_dir, manifest)
    return not failures


def _check_on_cpu_models(out_dir: Path, manifest: dict, arts: list[Artifact], cpu_models: list[str], bundle: dict,
                         log) -> dict:
    """Each CPU model's emulated run of `arts`, recorded in art.targets[TARGET]; returns the summary's emulator,
    versions and per-CPU-model entries."""
    tc = ensure_toolchain(need_pte=any(a.format == "pte" for a in arts), log=log)
    known = qemu_cpu_models(tc)
    if set(cpu_models) - set(known):
        raise UserError(f"qemu-aarch64 {tc.versions['qemu']} has no CPU model {', '.join(sorted(set(cpu_models) - set(known)))}; "
                        f"it has: {', '.join(known)}")
    summary = {"emulator": f"QEMU user mode, qemu-aarch64 {tc.versions['qemu']}", "versions": tc.versions,
               "cpu_models": {}}
    host_logits = {}  # this host's logits of each artifact, computed once for all CPU models
    for cpu in cpu_models:
        log(f"[{TARGET} {cpu}] {len(arts)} artifact(s) in one emulated Python (qemu-aarch64 -cpu {cpu})")
        run = run_on_target(out_dir, manifest, arts, cpu, tc, log)
        summary["cpu_models"][cpu] = {"cpu_features": run.info.get("cpu_features", ""), "seconds": run.seconds,
                                      "runtime": run.info}
        for art in arts:
            result = run.results[art.path]
            if art.path in run.logits:
                if art.path not in host_logits:
                    try:
                        host_logits[art.path] = run_artifact(out_dir / art.path, art, bundle["windows"][:, :-1])
                    except Exception as e:  # recorded, not fatal: the target check itself is against the bundle
                        host_logits[art.path] = f"{type(e).__name__}: {str(e)[:200]}"
                _compare_with_host(result, run.logits[art.path], host_logits[art.path])
            art.targets[TARGET][cpu] = result
    return summary


def _compare_with_host(result: dict, got: np.ndarray, mine) -> None:
    """Record how far the target's logits `got` are from this host's (`mine`: logits, or why the host failed)."""
    if isinstance(mine, np.ndarray) and mine.shape == got.shape:
        result["x86_vs_arm64_max_abs"] = float(np.abs(got - mine).max())
        result["x86_vs_arm64_top1_agreement"] = float((got.argmax(-1) == mine.argmax(-1)).mean())
    else:
        result["x86_vs_arm64_max_abs"] = None
        result["x86_error"] = mine if isinstance(mine, str) else f"shape {list(mine.shape)} != {list(got.shape)}"


def target_main(a, manifest: dict, target: str, cpus: list[str], skip: dict) -> int:
    """`python -m hrm_edge.parity DIR --target aarch64`, after hrm_edge.verify.parity.main has parsed and checked the
    arguments `a`: the gate on each CPU model, a console table, the verdict. Exit code."""
    print(f"parity check of {a.dir} on {target} (emulated CPU models: {', '.join(cpus)})"
          f"{' (bundle only)' if a.bundle_only else ''}")
    t0 = time.time()
    ok = run_target_gate(a.dir, manifest, target, cpus, skip=skip, recompute_reference=not a.bundle_only)
    t = manifest["targets"][target]
    print(f"\n{'artifact':<34} {'CPU model':<11} {'compared with':<24} {'max abs':>9} {'tol':>9} {'top-1':>7} "
          f"{'x86 vs ' + target:>15} {'s':>6}  result")
    for row in target_rows(manifest, target):
        r, c = row["result"], row["check"]
        x86 = r.get("x86_vs_arm64_max_abs")
        cells = (f"{'–':<24} {'–':>9} {'–':>9} {'–':>7}" if c is None else
                 f"{c['reference'].split(' (')[0][:24]:<24} {c['max_abs_logit_error']:9.2e} "
                 f"{c['tolerance']['max_abs_logit_error']:9.2e} {c['top1_agreement']:7.4f}")
        if row["first"]:
            print(f"{row['artifact']:<34} {row['cpu']:<11} {cells} {'–' if x86 is None else f'{x86:.2e}':>15} "
                  f"{r.get('seconds', 0):6.1f}  {'PASS' if r['passed'] else 'FAIL: ' + r.get('reason', '')[:200]}")
        else:
            print(f"{'':<46} {cells}")
    return verdict(ok, f" on {target} in {time.time() - t0:.0f} s", a.dir, t["skipped"], t["failures"])
