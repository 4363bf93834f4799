"""Benchmark the artifacts of an export folder side by side, on the same machine and thread count.

    python -m hrm_edge.bench export/out                 # 1 thread, tables on stdout, JSON in DIR/bench.json
    python -m hrm_edge.bench export/out --threads 2 --no-baseline

Each artifact (and the eager fp32 model) runs in a fresh process, so load time and peak RSS are its own.
Full-sequence programs: forward latency at batch 1 (median of --repeats after a warm-up), tokens/s, bytes
and the ratio to the fp32 artifact of the same format, with the quality columns (perplexity and top-1
agreement vs fp32 eager) read from the manifest's parity results.
KV-cache programs (and eager PyTorch with its KV cache): prefill tokens/s of a --prompt-len prompt, time to
first token, decode tokens/s over --new-tokens greedy tokens, load time, peak RSS, bytes. The baseline
(unless --no-baseline) is an unshared Transformer with T independent blocks of the same width (equal
compute per token, T times the block parameters), random weights, exported the same way into DIR/baseline/.
The full-sequence table also has onnxruntime's own int8 route for a Loop graph, quantize_dynamic with
EnableSubgraph, built into DIR/baseline/ and scored against the parity bundle (unless --no-baseline).
--peers adds, at the export's shape, the standard model each runtime's own tooling makes (hrm_edge.measure.peers:
ExecuTorch's export_llm Llama fp32 and 8da4w, Optimum's ONNX Llama fp32 and int8), timed the same way, and
leads the tables with our fastest program of each runtime and precision class against its peer.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hrm_edge.model.checkpoint import load_model
from hrm_edge.errors import UserError, run_cli
from hrm_edge.io import atomic_write_text, sha256_file
from hrm_edge.runtime.manifest import read_manifest, verify_files
from hrm_edge.verify.parity import host_target
from hrm_edge.runtime.xnnpack_options import child_flags


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over
    from the parent across fork + exec, so every child would report at least the parent's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _import_eager_model() -> None:
    """What load_model imports (torch, safetensors, the model), imported before a load clock starts."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    import hrm_edge.model.lm  # noqa: F401


def measure_one(out_dir: Path, artifact: str, threads: int, seq_len: int, repeats: int,
                weight_cache: bool = True) -> dict:
    """Runs inside the child process: load and time one artifact ("eager" = the fp32 eager model)."""
    manifest = read_manifest(out_dir)
    vocab = manifest["model"]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, size=(1, seq_len), dtype=np.int64)
    # load time starts after the imports: it is the artifact's cost, not the interpreter's
    if artifact == "eager":
        import torch

        _import_eager_model()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        model = load_model(out_dir)
        x = torch.from_numpy(tokens)

        def run():
            with torch.no_grad():
                return model(x)
    elif artifact.endswith((".onnx", ".ort")):
        import onnxruntime as ort

        t0 = time.perf_counter()
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(out_dir / artifact), so, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name

        def run():
            return sess.run(None, {name: tokens})
    elif artifact.endswith(".pte"):
        import torch
        import executorch.kernels.quantized  # noqa: F401
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
        from executorch.runtime import Runtime

        from hrm_edge.runtime.xnnpack_options import set_weight_cache

        _unsafe_reset_threadpool(threads)
        set_weight_cache(weight_cache)
        t0 = time.perf_counter()
        method = Runtime.get().load_program(str(out_dir / artifact)).load_method("forward")
        x = torch.from_numpy(tokens).contiguous()

        def run():
            return method.execute([x])
    else:
        raise UserError(f"unknown artifact type: {artifact}")
    run()  # first run: lazy initialisation (weight packing) counts as load
    load_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    latency = statistics.median(times)
    return {"artifact": artifact, "threads": threads, "seq_len": seq_len, "load_s": load_s,
            "latency_ms": latency * 1e3, "tokens_per_s": seq_len / latency, "peak_rss_mb": _peak_rss_mb()}


def measure_decode_one(out_dir: Path, artifact: str, threads: int, prompt_len: int, new_tokens: int, repeats: int,
                       weight_cache: bool = True) -> dict:
    """Runs inside the child process: prefill + greedy decode with one KV-cache program ("eager" = eager)."""
    from hrm_edge.model.eager import EagerDecoder
    from hrm_edge.runtime.decoders import OnnxDecoder, PteDecoder, generate

    # imports before the clock: load time is the artifact's, not the interpreter's
    if artifact == "eager":
        _import_eager_model()
    if artifact.endswith(".pte"):
        import torch  # noqa: F401
    if artifact.endswith(".pte"):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  the KV programs' cache and attention ops
        import executorch.kernels.quantized  # noqa: F401
        import executorch.runtime  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    t0 = time.perf_counter()
    if artifact == "eager":
        decoder = EagerDecoder(load_model(out_dir), threads)
    elif artifact.endswith((".onnx", ".ort")):
        decoder = OnnxDecoder(out_dir / artifact, threads)
    else:
        decoder = PteDecoder(out_dir / artifact, threads, weight_cache)
    vocab = decoder.prefill(np.zeros(1, dtype=np.int64)).shape[-1]  # also the lazy initialisation
    load_s = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, vocab, size=prompt_len).tolist()
    runs = [generate(decoder, prompt, new_tokens) for _ in range(repeats)]
    prefill_s = statistics.median(g.prefill_s for g in runs)
    decode = statistics.median(g.decode_tokens_per_s for g in runs)
    return {"artifact": artifact, "threads": threads, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "weight_cache": weight_cache, "load_s": load_s, "ttft_ms": prefill_s * 1e3,
            "prefill_tokens_per_s": prompt_len / prefill_s, "decode_tokens_per_s": decode,
            "peak_rss_mb": _peak_rss_mb()}


def _child(out_dir: Path, args: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "hrm_edge.bench", str(out_dir), *args, "--threads", str(threads)],
                          capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark child {args} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


BASELINE_SOURCES = ("model/lm.py", "export/onnx.py", "export/executorch.py", "export/onnx_passes.py", "export/quantize.py")


def export_baseline(out_dir: Path, manifest: dict, log=print) -> Path:
    """The unshared equal-compute baseline: arch transformer with n_layers = T, same width and vocabulary,
    random weights, exported as the same KV-cache programs (fp32 ONNX and .pte, dynamic int8 .pte)."""
    import dataclasses

    import torch

    from hrm_edge.model.checkpoint import save_model
    from hrm_edge.config import ModelConfig
    from hrm_edge.export.executorch import export_pte_decode, quantized_for_pte
    from hrm_edge.export.onnx import export_onnx_decode
    from hrm_edge.model.lm import HRMLM

    base = out_dir / "baseline"
    cfg = ModelConfig(**manifest["model"])
    cfg = dataclasses.replace(cfg, arch="transformer", n_layers=cfg.n_steps)
    marker = base / "baseline.json"
    # the exporting code's own bytes too: a baseline exported by an older model.py is not this one's
    code = {name: sha256_file(Path(__file__).resolve().parents[1] / name) for name in BASELINE_SOURCES}
    if marker.is_file() and json.loads(marker.read_text()) == {"model": dataclasses.asdict(cfg), "code": code}:
        return base  # exported earlier for this model shape, by this code
    log(f"  exporting the unshared baseline ({cfg.n_layers} independent blocks) into {base} ...")
    torch.manual_seed(0)
    model = HRMLM(cfg).eval()
    base.mkdir(parents=True, exist_ok=True)
    save_model(base, model)
    bos, eos = manifest["tokenizer"]["bos_id"], manifest["tokenizer"]["eos_id"]
    export_onnx_decode(model, base / "transformer.fp32.kv.onnx")
    export_pte_decode(model, base / "transformer.fp32.kv.pte", bos, eos)
    export_pte_decode(quantized_for_pte(model, "int8"), base / "transformer.int8-dynamic.kv.pte", bos, eos)
    atomic_write_text(marker, json.dumps({"model": dataclasses.asdict(cfg), "code": code}) + "\n")
    return base


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


@dataclass
class DecodeJob:
    """One program the decode benchmark times, in a fresh child process."""

    model: str  # "hrm" (ours), "baseline" (the unshared equal-compute model) or "peer" (hrm_edge.measure.peers)
    folder: Path
    name: str  # file name in folder, or "eager"
    format: str  # "eager" | "onnx" | "ort" | "pte"
    precision: str  # "fp32" | "int8" | "int4" (for peers: "8da4w" counts as int4)
    full_depth: bool = True  # False: a depth-dial program (fewer outer cycles), never compared with a peer
    passed: bool = True  # our artifact's parity verdict on this host: only a passing one leads the peer table

    def measure(self, t: DecodeTiming) -> dict:
        if self.model == "peer":
            from hrm_edge.measure.peers import measure_peer_decode_child

            return measure_peer_decode_child(self.folder / self.name, t.threads, t.prompt_len, t.new_tokens, t.repeats,
                                             t.weight_cache)
        return _child(self.folder, ["--one-decode", self.name, "--prompt-len", str(t.prompt_len), "--new-tokens",
                                    str(t.new_tokens), "--repeats", str(t.repeats), *child_flags(t.weight_cache)],
                      t.threads)


def decode_jobs(out_dir: Path, manifest: dict, baseline: bool, peers: bool, log=print) -> list[DecodeJob]:
    """Eager fp32, every KV-cache artifact, then the unshared baseline's and the peers' programs."""
    arch = manifest["model"]["arch"]
    jobs = [DecodeJob(arch, out_dir, "eager", "eager", "fp32")] + [
        DecodeJob(arch, out_dir, a.path, a.format, a.precision, a.cycles is None,
                  passed=(a.parity or {}).get(host_target(), {}).get("passed", False))
        for a in manifest["artifacts"] if a.program == "kv_cache"]
    if baseline:
        base = export_baseline(out_dir, manifest, log)
        jobs += [DecodeJob("baseline", base, "eager", "eager", "fp32")] + [
            DecodeJob("baseline", base, p.name, p.suffix[1:], "int8" if "int8" in p.name else "fp32")
            for p in sorted(base.glob("*.kv.*"))]
    if peers:
        from hrm_edge.measure.peers import PeerShape, build_peers

        for program in build_peers(PeerShape.from_model(manifest["model"]), out_dir / "peers", log):
            precision = {"8da4w": "int4"}.get(program.precision, program.precision)
            jobs.append(DecodeJob("peer", program.path.parent, program.name, program.path.suffix[1:], precision))
    return jobs


def run_decode_bench(out_dir: Path, timing: DecodeTiming, baseline: bool, peers: bool = False, log=print) -> dict:
    """Every decode job timed in `rounds` interleaved rounds (each a fresh child: `repeats` generations, medians);
    a row's figures are the median round's. Interleaving spreads a busy moment of the machine over all jobs."""
    manifest = read_manifest(out_dir)
    jobs = decode_jobs(out_dir, manifest, baseline, peers, log)
    measured: list[list[dict]] = [[] for _ in jobs]
    for r in range(timing.rounds):
        for job, runs in zip(jobs, measured):
            runs.append(job.measure(timing))
            log(f"  round {r + 1}/{timing.rounds} {job.model:<9} {job.name:<30} decode {runs[-1]['decode_tokens_per_s']:7.0f} tok/s")
    rows = []
    for job, runs in zip(jobs, measured):
        row = sorted(runs, key=lambda m: m["decode_tokens_per_s"])[len(runs) // 2]
        rows.append(row | {"model": job.model, "format": job.format, "precision": job.precision,
                           "full_depth": job.full_depth, "passed": job.passed, "rounds": timing.rounds,
                           "decode_tokens_per_s_rounds": [m["decode_tokens_per_s"] for m in runs],
                           "bytes": (job.folder / job.name).stat().st_size if job.name != "eager" else None})
    add_decode_ratios(rows)
    return {"prompt_len": timing.prompt_len, "new_tokens": timing.new_tokens, "rounds": timing.rounds,
            "weight_cache": timing.weight_cache, "rows": rows}


def add_decode_ratios(rows: list[dict]) -> None:
    """Each row's decode speed against eager fp32, its twin in the unshared baseline, and the peer a user of
    the same runtime would otherwise ship at its precision class (fp32 with fp32; int8 and 4-bit with the
    ExecuTorch Llama's 8da4w and Optimum's int8)."""
    eager = rows[0]["decode_tokens_per_s"]

    def kind(name):  # "hrm.int8-dynamic.kv.pte" and "transformer.int8-dynamic.kv.pte" are twins
        return name if name == "eager" else name.split(".", 1)[1]

    def runtime(fmt):
        return {"ort": "onnx"}.get(fmt, fmt)

    twins = {kind(r["artifact"]): r for r in rows if r["model"] == "baseline"}
    peers = {(runtime(r["format"]), r["precision"] == "fp32"): r for r in rows if r["model"] == "peer"}
    for row in rows:
        row["decode_vs_eager_fp32"] = row["decode_tokens_per_s"] / eager
        if row["model"] in ("baseline", "peer"):
            continue
        twin = twins.get(kind(row["artifact"]))
        if twin:
            row["decode_vs_baseline"] = row["decode_tokens_per_s"] / twin["decode_tokens_per_s"]
        peer = peers.get((runtime(row["format"]), row["precision"] == "fp32"))
        if peer and row.get("full_depth", True):  # the depth dial runs fewer block applications: not a peer's match
            row["peer"] = peer["artifact"]
            row["decode_vs_peer"] = row["decode_tokens_per_s"] / peer["decode_tokens_per_s"]


ORT_DYNAMIC_BASELINE = "baseline/hrm.int8-ortdynamic.onnx"


def ort_dynamic_baseline(out_dir: Path, manifest: dict, log=print) -> dict | None:
    """onnxruntime's own int8 path for a Loop graph, as the baseline our static int8 graphs are compared
    with: quantize_dynamic(hrm.fp32.onnx, EnableSubgraph) (it quantizes every MatMul with a constant
    weight, inside the Loop body too, as DynamicQuantizeLinear -> MatMulInteger; per-channel int8
    weights). Not a shipped artifact (it has no eager int8 reference); scored against the parity
    bundle's fp32 logits. Returns the quality record, or None without an fp32 ONNX graph."""
    fp32 = next((a for a in manifest["artifacts"] if a.path == "hrm.fp32.onnx"), None)
    if fp32 is None:
        return None
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    from hrm_edge.verify.parity import load_bundle, perplexity, run_onnx

    path = out_dir / ORT_DYNAMIC_BASELINE
    path.parent.mkdir(parents=True, exist_ok=True)
    log("  building onnxruntime quantize_dynamic(EnableSubgraph) baseline ...")
    logging.getLogger().setLevel(logging.ERROR)  # its "please run pre-processing" advice on every call
    quantize_dynamic(out_dir / fp32.path, path, weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"], extra_options={"EnableSubgraph": True})
    bundle = load_bundle(out_dir / manifest["parity_bundle"]["path"])
    windows, reference = bundle["windows"], bundle["fp32_logits"]
    logits = np.concatenate([run_onnx(path, windows[i : i + 1, :-1]) for i in range(len(windows))])
    targets = windows[:, 1:]
    return {"bytes": path.stat().st_size, "bytes_vs_fp32": path.stat().st_size / fp32.bytes,
            "perplexity": perplexity(logits, targets), "fp32_perplexity": perplexity(reference, targets),
            "top1_vs_fp32": float((logits.argmax(-1) == reference.argmax(-1)).mean())}


def _full_sequence_programs(manifest: dict, baseline: dict | None) -> list[tuple]:
    """What the full-sequence table times: (path, format, precision, quantization record, row fields known without
    timing it) for the eager model, every full-sequence artifact and onnxruntime's own int8 route (`baseline`)."""
    fp32_bytes = {a.format: a.bytes for a in manifest["artifacts"] if a.precision == "fp32"}
    programs = [("eager", "eager", "fp32", {}, {})]
    for art in manifest["artifacts"]:
        if art.program == "kv_cache":
            continue  # measured by the decode benchmark
        known = {"bytes": art.bytes,
                 "bytes_vs_fp32": art.bytes / fp32_bytes[art.format] if art.format in fp32_bytes else None}
        checks = next(iter((art.parity or {}).values()), {}).get("checks", [])
        vs_fp32 = next((c for c in checks if c.get("reference", "").startswith("fp32 eager")), None)
        if vs_fp32 and "perplexity" in vs_fp32:
            known.update(perplexity=vs_fp32["perplexity"], fp32_perplexity=vs_fp32["reference_perplexity"],
                         top1_vs_fp32=vs_fp32["top1_agreement"])
        programs.append((art.path, art.format, art.precision, art.quantization or {}, known))
    if baseline is not None:
        programs.append((ORT_DYNAMIC_BASELINE, "onnx", "int8",
                         {"mode": "ort quantize_dynamic", "activation_scales": "dynamic per tensor"}, baseline))
    return programs


def run_bench(out_dir: Path, threads: int = 1, seq_len: int | None = None, repeats: int = 10, log=print,
              ort_baseline: bool = True, weight_cache: bool = True) -> dict:
    manifest = read_manifest(out_dir)
    seq_len = seq_len or min(128, manifest["model"]["max_seq_len"])
    if not 1 <= seq_len <= manifest["model"]["max_seq_len"]:
        raise UserError(f"--seq-len must be in 1..{manifest['model']['max_seq_len']}")
    baseline = ort_dynamic_baseline(out_dir, manifest, log) if ort_baseline else None
    rows = []
    for path, fmt, precision, quantization, known in _full_sequence_programs(manifest, baseline):
        row = _child(out_dir, ["--one", path, "--seq-len", str(seq_len), "--repeats", str(repeats),
                               *child_flags(weight_cache)], threads)
        row.update(format=fmt, precision=precision, mode=quantization.get("mode", ""),
                   scales=quantization.get("activation_scales", "").split(" ")[0])
        row.update(known)
        rows.append(row)
        log(f"  {row['artifact']:<34} {row['latency_ms']:8.2f} ms")
    eager = rows[0]["latency_ms"]
    for row in rows:
        row["speedup_vs_eager"] = eager / row["latency_ms"]
    return {"target": host_target(), "threads": threads, "seq_len": seq_len, "repeats": repeats,
            "weight_cache": weight_cache,
            "model": {k: manifest["model"][k] for k in ("arch", "d_model", "vocab_size", "H_cycles", "L_cycles")},
            "rows": rows}


def weight_cache_words(on: bool) -> str:
    if on:
        return ".pte programs with XNNPACK's weight cache on, as ExecuTorch's Android and iOS builds run them"
    return ".pte programs with XNNPACK's weight cache off (--no-weight-cache: the pip wheel's default)"


def render_decode_table(result: dict) -> str:
    d = result["decode"]
    lines = [f"Generation with a KV cache, batch 1, {d['prompt_len']}-token prompt then {d['new_tokens']} greedy tokens, "
             f"{result['threads']} thread(s), {result['target']}; each program in a fresh process, median of "
             f"{max(1, result['repeats'] // 3)} generations, the median of {d['rounds']} interleaved round(s); "
             f"{weight_cache_words(d.get('weight_cache', False))}.", "",
             "| model | program | bytes | load s | time to first token ms | prefill tok/s | decode tok/s | "
             "decode vs eager fp32 | vs unshared baseline | vs peer (same runtime and precision class) | peak RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in d["rows"]:
        b = f"{r['bytes']:,}" if r.get("bytes") else "–"
        vb = f"{r['decode_vs_baseline']:.2f}x" if "decode_vs_baseline" in r else "–"
        vp = f"{r['decode_vs_peer']:.2f}x ({r['peer']})" if "decode_vs_peer" in r else "–"
        lines.append(f"| {r['model']} | {r['artifact']} | {b} | {r['load_s']:.2f} | {r['ttft_ms']:.1f} | "
                     f"{r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} | {r['decode_vs_eager_fp32']:.2f}x | "
                     f"{vb} | {vp} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def render_peer_ratios(result: dict) -> str:
    """The lead table: our fastest program per runtime and precision class against the peer of that class, among
    the programs that passed their parity gate (what an export ships; a failing opt-in program is not a choice)."""
    best: dict = {}
    for r in result["decode"]["rows"]:
        if "decode_vs_peer" in r and r.get("passed", True):
            key = (r["peer"], r["precision"] == "fp32")
            if key not in best or r["decode_tokens_per_s"] > best[key]["decode_tokens_per_s"]:
                best[key] = r
    if not best:
        return ""
    peers = {r["artifact"]: r for r in result["decode"]["rows"] if r["model"] == "peer"}
    lines = ["Decode against what each runtime's own tooling makes at the same shape (random weights):", "",
             "| runtime | ours (fastest of its class) | bytes | decode tok/s | peer | bytes | decode tok/s | ours / peer |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for (peer_name, _), r in sorted(best.items()):
        p = peers[peer_name]
        lines.append(f"| {'ExecuTorch' if p['format'] == 'pte' else 'onnxruntime'} | {r['artifact']} | {r['bytes']:,} | "
                     f"{r['decode_tokens_per_s']:.0f} | {peer_name} | {p['bytes']:,} | {p['decode_tokens_per_s']:.0f} | "
                     f"**{r['decode_vs_peer']:.2f}x** |")
    return "\n".join(lines) + "\n"


def depth_dial_rows(manifest: dict, decode: dict) -> list[dict]:
    """The depth dial (export --cycles): each depth's quality (manifest) beside the decode speed of its
    KV-cache program (the int8 one where the export built it, else fp32)."""
    H = manifest["model"]["H_cycles"]
    speed = {r["artifact"]: r["decode_tokens_per_s"] for r in decode["rows"] if r["model"] not in ("baseline", "peer")}
    rows = []
    for d in manifest.get("depth_dial") or []:
        depth = "" if d["cycles"] == H else f".c{d['cycles']}"
        program = next((p for p in (f"hrm.int8-dynamic{depth}.kv.pte", f"hrm.fp32{depth}.kv.pte") if p in speed), None)
        rows.append(d | {"program": program, "decode_tokens_per_s": speed.get(program)})
    return rows


def render_depth_table(rows: list[dict]) -> str:
    lines = ["Depth dial: the same weights with fewer outer cycles (validation windows of the parity bundle).", "",
             "| outer cycles | block applications | perplexity | vs full depth | top-1 vs full depth | program | decode tok/s |",
             "|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        tps = f"{r['decode_tokens_per_s']:.0f}" if r["decode_tokens_per_s"] else "–"
        lines.append(f"| {r['cycles']} | {r['block_applications']} | {r['perplexity']:.3f} | "
                     f"{r['perplexity'] / r['full_depth_perplexity']:.3f}x | {r['top1_vs_full_depth']:.4f} | "
                     f"{r['program'] or '–'} | {tps} |")
    return "\n".join(lines) + "\n"


def render_table(result: dict) -> str:
    lines = [f"Full-sequence forward, batch 1, {result['seq_len']} tokens, {result['threads']} thread(s), "
             f"{result['target']}; median of {result['repeats']}; "
             f"{weight_cache_words(result.get('weight_cache', False))}.", "",
             "| artifact | mode | act. scales | bytes | vs fp32 bytes | latency ms | tokens/s | vs eager | load s | "
             "peak RSS MB | ppl (fp32) | top-1 vs fp32 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        b = f"{r['bytes']:,}" if "bytes" in r else "–"
        ratio = f"{r['bytes_vs_fp32']:.2f}" if r.get("bytes_vs_fp32") else "–"
        ppl = f"{r['perplexity']:.3f} ({r['fp32_perplexity']:.3f})" if "perplexity" in r else "–"
        top1 = f"{r['top1_vs_fp32']:.4f}" if "top1_vs_fp32" in r else "–"
        lines.append(f"| {r['artifact']} | {r['mode'] or r['precision']} | {r['scales'] or '–'} | {b} | {ratio} | "
                     f"{r['latency_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup_vs_eager']:.2f}x | "
                     f"{r['load_s']:.2f} | {r['peak_rss_mb']:.0f} | {ppl} | {top1} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrm_edge.bench", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="export folder (holds manifest.json)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for every runtime (default 1)")
    p.add_argument("--seq-len", type=int, help="tokens per forward (default min(128, max_seq_len))")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per artifact after one warm-up (default 10)")
    p.add_argument("--prompt-len", type=int, help="decode benchmark prompt tokens (default min(128, context/2))")
    p.add_argument("--new-tokens", type=int, help="decode benchmark new tokens (default min(128, context - prompt))")
    p.add_argument("--no-baseline", action="store_true", help="skip the unshared equal-compute baseline and the "
                   "onnxruntime quantize_dynamic baseline")
    p.add_argument("--peers", action="store_true",
                   help="also build and time the standard model each runtime's own tooling makes at this export's shape "
                        "(random weights): ExecuTorch's export_llm Llama (fp32, 8da4w) and Hugging Face Optimum's ONNX "
                        "Llama (fp32, int8 by quantize_dynamic), into DIR/peers/ (reused when built for the same shape); "
                        "needs pip install '.[peers]'; the first build takes about 12 minutes")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every decode program this many times, interleaved, and report the median round (default 1; "
                        "3 steadies the ratios on a shared machine)")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="run the .pte programs with XNNPACK's weight cache off, as the pip wheel does by default (default: "
                        "on, as ExecuTorch's Android and iOS builds run them: a weight shared by several operators, such "
                        "as our block's, is packed once instead of once per operator)")
    p.add_argument("--json", type=Path, help="where to write the JSON results (default DIR/bench.json)")
    p.add_argument("--no-verify", action="store_true", help="run the artifacts without first checking them against "
                   "the manifest's sha256 (for artifacts edited on purpose)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one artifact in this process
    p.add_argument("--one-decode", help=argparse.SUPPRESS)  # internal: one KV-cache program
    a = p.parse_args(argv)
    if a.threads < 1 or a.repeats < 1 or a.rounds < 1:
        raise UserError("--threads, --repeats and --rounds must be >= 1")
    if a.one:
        print(json.dumps(measure_one(a.dir, a.one, a.threads, a.seq_len, a.repeats, not a.no_weight_cache)))
        return 0
    if a.one_decode:
        print(json.dumps(measure_decode_one(a.dir, a.one_decode, a.threads, a.prompt_len, a.new_tokens, a.repeats,
                                            not a.no_weight_cache)))
        return 0
    manifest = read_manifest(a.dir)
    verify_files(a.dir, manifest, no_verify=a.no_verify)  # every file it loads; its children trust this check
    context = manifest["model"]["max_seq_len"]
    prompt_len = a.prompt_len or min(128, context // 2)
    new_tokens = a.new_tokens or min(128, context - prompt_len)
    if prompt_len < 1 or new_tokens < 1 or prompt_len + new_tokens > context:
        raise UserError(f"--prompt-len + --new-tokens must fit the context of {context} tokens")
    if a.peers:
        from hrm_edge.measure.peers import require_peer_extra

        require_peer_extra()  # before minutes of benchmarking, not after
    if not a.no_weight_cache and any(art.format == "pte" for art in manifest["artifacts"]):
        from hrm_edge.runtime.xnnpack_options import weight_cache_enabled

        weight_cache_enabled()  # one clear error now if this ExecuTorch build offers no way to set it
    result = run_bench(a.dir, a.threads, a.seq_len, a.repeats, ort_baseline=not a.no_baseline,
                       weight_cache=not a.no_weight_cache)
    print("decode benchmark:")
    timing = DecodeTiming(a.threads, prompt_len, new_tokens, max(1, a.repeats // 3), a.rounds, not a.no_weight_cache)
    result["decode"] = run_decode_bench(a.dir, timing, baseline=not a.no_baseline, peers=a.peers)
    table = render_peer_ratios(result) + "\n" + render_table(result) + "\n" + render_decode_table(result)
    result["depth_dial"] = depth_dial_rows(manifest, result["decode"])
    if result["depth_dial"]:
        table += "\n" + render_depth_table(result["depth_dial"])
    print(table)
    path = a.json or a.dir / "bench.json"
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    atomic_write_text(path.with_suffix(".md"), table)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0
