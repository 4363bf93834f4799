"""The one timing harness of bench, peers and study: every program is measured in a fresh child process
(`python -m hrm_edge.measure.child`, one JSON line on stdout), with its imports done before the clock, a
warm-up run counted as load, medians of the timed runs, the process's peak RSS, and a description of the CPU
it ran on. Also the "build unless a marker says it is up to date" rule of the programs bench and study lower
themselves (the unshared baseline, the study's int8 programs).

numpy and the runtime layer at module level only: a child that times an ONNX program loads no torch.
"""
from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_text, sha256_file
from hrm_edge.runtime.decoders import Decoder, generate
from hrm_edge.runtime.manifest import BUNDLE
from hrm_edge.runtime.speculative import DEFAULT_LOOKUP_LEN
from hrm_edge.verify.parity import load_bundle

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding hrm_edge/, for the children's PYTHONPATH
CHILD_MODULE = "hrm_edge.measure.child"


# ---------------------------------------------------------------- the process


def peak_rss_mb(status: Path = Path("/proc/self/status")) -> float:
    """This process's peak resident memory in MiB. VmHWM where /proc has it: Linux carries getrusage's
    ru_maxrss over from the parent across fork + exec, so every child would report at least the parent's
    size. Elsewhere (no /proc) ru_maxrss (kB on Linux)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# x86 /proc/cpuinfo "flags" and ARM "Features" names of the instructions the int8 and fp32 kernels use
X86_ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")
ARM_ISA = ("neon", "asimd", "asimddp", "i8mm", "sve")


def _cache_bytes(text: str) -> int:
    """sysfs cache sizes: "48K", "2048K", "105M"."""
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip())
    if not m:
        return 0
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]


def _caches(cache_dir: Path) -> dict[int, int]:
    """{level: bytes} of cpu0's data/unified caches (index*/level, type, size)."""
    sizes = {}
    for index in sorted(cache_dir.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            sizes[int((index / "level").read_text())] = _cache_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return sizes


def cpu_info(threads: int | None = None, cpuinfo: Path = Path("/proc/cpuinfo"),
             cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict:
    """model (name), family (x86's "cpu family", "model" and "stepping" as "25/1/1": a virtual machine's model name
    is often just "AMD EPYC", and these tell its generations apart), isa (the int8/fp32 instruction sets present, see
    X86_ISA and ARM_ISA), l2_bytes (cpu0's L2: per core on current x86, per cluster where cores share one), l3_bytes
    (the L3 cpu0 shares with the other cores of its socket or cluster: one socket's total), cores (the CPUs this
    process may run on), threads (the measurement's thread count, where given). Missing files leave their fields
    None or empty."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    caches = _caches(cache_dir)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    family = [fields.get(key) for key in ("cpu family", "model", "stepping")]
    info = {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "family": "/".join(family) if all(family) else None,
            "isa": [name for name in X86_ISA + ARM_ISA if name in flags],
            "l2_bytes": caches.get(2), "l3_bytes": caches.get(3), "cores": cores}
    return info | ({"threads": threads} if threads is not None else {})


def _isa_words(isa: list[str]) -> list[str]:
    """The caption's short names: the widest x86 vector set, then the int8 dot-product and matrix units."""
    has = set(isa)
    words = ["AVX-512"] if "avx512f" in has else ["AVX2"] if "avx2" in has else []
    words += ["VNNI"] if has & {"avx512_vnni", "avx_vnni"} else []
    words += ["AMX"] if has & {"amx_int8", "amx_bf16"} else []
    words += ["NEON"] if has & {"neon", "asimd"} else []
    words += [w for name, w in (("asimddp", "dotprod"), ("i8mm", "i8mm"), ("sve", "SVE")) if name in has]
    return words


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def describe_cpu(cpu: dict) -> str:
    """One caption line: "CPU: Intel Xeon (family 6 model 167 stepping 8; AVX-512, VNNI, AMX), L2 2 MiB/core, L3 105
    MiB, 2 cores; 1 thread" (no family for a record made before it was kept, or off x86)."""
    words = ", ".join(_isa_words(cpu.get("isa", [])))
    if cpu.get("family"):
        words = "family {} model {} stepping {}".format(*cpu["family"].split("/")) + (f"; {words}" if words else "")
    text = f"CPU: {cpu.get('model') or '?'}" + (f" ({words})" if words else "")
    text += f", L2 {_mib(cpu['l2_bytes'])}/core" if cpu.get("l2_bytes") else ""
    text += f", L3 {_mib(cpu['l3_bytes'])}" if cpu.get("l3_bytes") else ""
    text += f", {cpu.get('cores', '?')} cores"
    if cpu.get("threads") is not None:
        text += f"; {cpu['threads']} thread{'s' if cpu['threads'] != 1 else ''}"
    return text


def run_child(args: list[str], threads: int, verbose: bool = False) -> dict:
    """`python -m hrm_edge.measure.child ARGS --threads N` in a fresh process (its own load time and peak RSS);
    its last JSON line on stdout. Its stderr (the runtimes' C++ logging) is shown on failure, or with verbose."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", CHILD_MODULE, *map(str, args), "--threads", str(threads)],
                          capture_output=True, text=True, env=env)
    if verbose and proc.stderr:
        sys.stderr.write(proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if proc.returncode == 2 and errors:  # the child's user error (a file it cannot load): its line, not its log
        raise UserError(errors[-1].removeprefix("error: "))
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark child {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------- the measurements (run inside the child)


@dataclass
class DecodeTiming:
    """How every decode program is timed: one thread count, prompt and continuation, `repeats` generations per
    child process, `rounds` interleaved rounds, XNNPACK's weight cache on or off for the .pte programs."""

    threads: int
    prompt_len: int
    new_tokens: int
    repeats: int
    rounds: int = 1
    weight_cache: bool = True
    prompts: str = ""  # .npy [n, prompt_len] of real text (text_prompts); "": random ids (a shape-only timing)
    lookup_len: int = DEFAULT_LOOKUP_LEN  # speculative rounds' most proposals from the context (0: first cycle only)

    def child_args(self) -> list[str]:
        return ["--prompt-len", str(self.prompt_len), "--new-tokens", str(self.new_tokens), "--repeats",
                str(self.repeats), *([] if self.weight_cache else ["--no-weight-cache"]),
                *(["--prompts", self.prompts] if self.prompts else [])]


def text_prompts(export_dir: Path, prompt_len: int, path: Path) -> str:
    """Prompts cut from the export's validation windows (its parity bundle: held-out code, tokenized) into
    path, [n, prompt_len] int64: the speed of self-speculative decoding depends on the text, so every program,
    the peers' too (same vocabulary size), is timed on the same real prompts. Returns str(path)."""
    windows = load_bundle(export_dir / BUNDLE)["windows"]  # [N, S + 1]
    if windows.shape[1] < prompt_len:
        raise UserError(f"the parity bundle's windows hold {windows.shape[1]} tokens; --prompt-len {prompt_len} "
                        "does not fit")
    np.save(path, np.ascontiguousarray(windows[:, :prompt_len], dtype=np.int64))
    return str(path)


def decode_in_child(kind: str, folder: Path, artifact: str, t: DecodeTiming, verbose: bool = False,
                    extra: tuple = ()) -> dict:
    """One decode measurement (measure_decode) of folder/artifact in a fresh child. kind: "decode" (ours, or
    artifact "eager": the eager model of folder) or "peer-decode" (hrm_edge.measure.peers' programs); extra: the
    child's speculative or adaptive flags (--draft-len or --exit-threshold, --draft, --verify)."""
    return run_child([kind, folder, artifact, *t.child_args(), *extra], t.threads, verbose)


def measure_decode(open_decoder: Callable[[], Decoder], artifact: str, t: DecodeTiming,
                   generate_fn: Callable = generate) -> dict:
    """Load time includes a one-token prefill (lazy initialisation: weight packing), then `repeats` runs of a
    prompt_len prompt (t.prompts' rows in turn, each at least once: a speculative decoder's speed depends on the
    text; else random ids) + new_tokens greedy tokens; medians. The caller has done the imports. generate_fn: generate, a speculative decoder's generate_speculative, or an adaptive
    decoder's generate_adaptive."""
    t0 = time.perf_counter()
    decoder = open_decoder()
    vocab = decoder.prefill(np.zeros(1, dtype=np.int64)).shape[-1]
    load_s = time.perf_counter() - t0
    prompts = (np.load(t.prompts)[:, : t.prompt_len] if t.prompts
               else np.random.default_rng(0).integers(0, vocab, size=(1, t.prompt_len)))
    count = max(t.repeats, len(prompts)) if t.prompts else t.repeats
    runs = [generate_fn(decoder, prompts[i % len(prompts)].tolist(), t.new_tokens) for i in range(count)]
    prefill_s = statistics.median(g.prefill_s for g in runs)
    decode = statistics.median(g.decode_tokens_per_s for g in runs)
    row = {"artifact": artifact, "threads": t.threads, "prompt_len": t.prompt_len, "new_tokens": t.new_tokens,
           "weight_cache": t.weight_cache, "load_s": load_s, "ttft_ms": prefill_s * 1e3,
           "prefill_tokens_per_s": t.prompt_len / prefill_s, "decode_tokens_per_s": decode,
           "peak_rss_mb": peak_rss_mb(), "prompts": "text" if t.prompts else "random", "generations": count}
    if hasattr(runs[0], "exit_rate"):  # adaptive depth: decoded tokens that exited after the first cycle
        row["exit_rate"] = statistics.median(g.exit_rate for g in runs)
    if hasattr(runs[0], "acceptance"):  # speculative: how often the first cycle's draft was kept
        row |= {"acceptance": statistics.median(g.acceptance for g in runs),
                "tokens_per_round": statistics.median(g.tokens_per_round for g in runs),
                "lookup_share": statistics.median(g.lookup_rounds / max(1, g.rounds) for g in runs)}
    return row


def measure_forward(load: Callable[[], Callable[[], object]], artifact: str, threads: int, seq_len: int,
                    repeats: int) -> dict:
    """load() returns the forward call; its first call (lazy initialisation) counts as load, then the median
    of `repeats` timed calls."""
    t0 = time.perf_counter()
    run = load()
    run()
    load_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    latency = statistics.median(times)
    return {"artifact": artifact, "threads": threads, "seq_len": seq_len, "load_s": load_s,
            "latency_ms": latency * 1e3, "tokens_per_s": seq_len / latency, "peak_rss_mb": peak_rss_mb()}


# ---------------------------------------------------------------- programs built for a benchmark

# the code that lowers a KV-cache program: a program lowered by an older version of these is not this one's
EXPORT_SOURCES = ("model/lm.py", "export/onnx.py", "export/executorch.py", "export/onnx_passes.py",
                  "export/quantize.py")


def export_code_digest() -> dict:
    return {name: sha256_file(PACKAGE_ROOT / "hrm_edge" / name) for name in EXPORT_SOURCES}


def build_unless_current(marker: Path, inputs: dict, build: Callable[[], list[Path]]) -> tuple[dict, bool]:
    """Run build() (it writes files beside `marker` and returns their paths) unless the marker records the same
    inputs, the same exporting code, and files that still hold the bytes it recorded. Returns the marker's
    record ({"inputs", "code", "build_s", "files": [{path, bytes, sha256}]}) and whether it built."""
    folder = marker.parent
    code = export_code_digest()
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        record = None
    if (record and record.get("inputs") == inputs and record.get("code") == code and record.get("files")
            and all((folder / f["path"]).is_file() and sha256_file(folder / f["path"]) == f["sha256"]
                    for f in record["files"])):
        return record, False
    marker.unlink(missing_ok=True)  # a half-rebuilt set must never pass for a finished one
    t = time.perf_counter()
    paths = build()
    record = {"inputs": inputs, "code": code, "build_s": time.perf_counter() - t,
              "files": [{"path": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]}
    atomic_write_text(marker, json.dumps(record, indent=2) + "\n")
    return record, True


def lower_kv_pte(model, path: Path, precision: str, bos: int, eos: int) -> Path:
    """A KV-cache ExecuTorch program as `python -m hrm_edge.export` lowers one (XNNPACK; int8: torchao int8
    dynamic activations x int8 weights)."""
    from hrm_edge.export.executorch import export_pte_decode, quantized_for_pte  # torch, executorch: optional here

    return export_pte_decode(model if precision == "fp32" else quantized_for_pte(model, precision), path, bos, eos)
