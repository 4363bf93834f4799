"""The worker that runs INSIDE the emulated ARM64 Python (hrm_edge.verify.arm64_gate starts it under qemu-aarch64).

It checks each artifact against the parity bundle with hrm_edge.verify.parity's runtime side, exactly as on the
host (adaptive depth against the bundle's stored eager reference, never an emulated eager model), and leaves results
and logits in a folder the host reads. Its imports are what the emulated Python has:
numpy and onnxruntime (torch and executorch only once a .pte file is checked, inside the parity runtime).
"""
from __future__ import annotations

import contextlib
import json
import platform
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from hrm_edge.io import atomic_write_text
from hrm_edge.runtime.manifest import Artifact
from hrm_edge.verify.parity import check_artifact, check_summary, load_bundle


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("Features"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def worker_main(spec_path: str) -> int:
    """Runs INSIDE the emulated Python: hrm_edge.verify.parity's runtime side on each artifact, results and logits to
    spec["result_dir"] after every artifact (a crash later keeps what was done). numpy + onnxruntime only;
    executorch (and torch) only once a .pte comes, and the .pte files come last."""
    spec = json.loads(Path(spec_path).read_text())
    out_dir, result_dir = Path(spec["out_dir"]), Path(spec["result_dir"])
    info = {"machine": platform.machine(), "python": platform.python_version(), "cpu_features": _cpu_features(),
            "onnxruntime": version("onnxruntime"), "numpy": np.__version__}
    done = {"info": info, "artifacts": {}}
    bundle = load_bundle(out_dir / spec["bundle"])
    arts = sorted(map(Artifact.from_json, spec["artifacts"]), key=lambda a: a.format == "pte")  # stable: ONNX/ORT first
    print(f"{info['machine']}, Python {info['python']}, onnxruntime {info['onnxruntime']}; {len(arts)} artifact(s)",
          flush=True)
    for i, art in enumerate(arts):
        t0 = time.perf_counter()
        kept = {}
        try:
            # eager=False: adaptive depth is compared with the bundle's stored eager reference (no emulated eager model)
            result = check_artifact(out_dir, art, bundle, spec["unique_weight_bytes"], spec["tolerances"], logits_out=kept,
                                    eager=False)
        except Exception as e:  # a failure of one artifact is its result, not the end of the others
            result = {"passed": False,
                      "reason": f"{art.format} error on {spec['target']}: {type(e).__name__}: {str(e)[:300]}"}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        entry = {"result": result}
        if "logits" in kept:
            entry["logits"] = f"logits-{i}.npy"
            np.save(result_dir / entry["logits"], kept["logits"])
        if art.format == "pte" and "executorch" not in info:
            with contextlib.suppress(Exception):
                info["executorch"], info["torch"] = version("executorch"), version("torch")
        done["artifacts"][art.path] = entry
        atomic_write_text(result_dir / "results.json", json.dumps(done))
        print(f"{'PASS' if result['passed'] else 'FAIL'} {art.path:<34} {result['seconds']:6.1f} s  {check_summary(result)} "
              f"{result.get('reason', '')}".rstrip(), flush=True)
    return 0
