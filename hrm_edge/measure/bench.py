"""Benchmark the artifacts of an export folder side by side, on the same machine and thread count.

    python -m hrm_edge.bench export/out                 # 1 thread, tables on stdout, JSON in DIR/bench.json
    python -m hrm_edge.bench export/out --threads 2 --no-baseline

Each artifact (and the eager fp32 model) runs in a fresh process, so load time and peak RSS are its own
(hrm_edge.measure.harness, shared with peers and study; every caption names the CPU, bench.json records it).
The runtimes' own log lines and the export stack's warnings are shown with --verbose only.
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
import dataclasses
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hrm_edge.config import ModelConfig
from hrm_edge.errors import ArgumentParser, UserError
from hrm_edge.export.names import artifact_name
from hrm_edge.io import atomic_write_text, check_writable_file, path_arg, refuse_out_of_range
from hrm_edge.measure.harness import (DecodeTiming, build_unless_current, cpu_info, decode_in_child, describe_cpu,
                                      lower_kv_pte, run_child, text_prompts)
from hrm_edge.quiet import quiet_third_party
from hrm_edge.measure.peers import PeerShape, build_peers, require_peer_extra
from hrm_edge.model.checkpoint import save_model
from hrm_edge.runtime.manifest import Artifact, read_manifest, verify_files
from hrm_edge.runtime.adaptive import DEFAULT_EXIT_THRESHOLD
from hrm_edge.runtime.speculative import DEFAULT_DRAFT_LEN as DRAFT_LEN, DEFAULT_LOOKUP_LEN, speculative_set
from hrm_edge.runtime.xnnpack_options import child_flags, weight_cache_enabled
from hrm_edge.verify.parity import host_target, load_bundle, perplexity, run_onnx

BASELINE_ARCH = "transformer"
BASELINE_MARKER = "baseline.json"


def baseline_programs() -> list[Artifact]:
    """The unshared baseline's KV-cache programs, recorded as an export records its own (fp32 ONNX and .pte,
    dynamic int8 .pte)."""
    def kv(precision_name, fmt, precision):
        name = artifact_name(BASELINE_ARCH, precision_name, fmt, "kv_cache")
        return Artifact.new(name, fmt, precision, "kv_cache", "unrolled")

    return [kv("fp32", "onnx", "fp32"), kv("fp32", "pte", "fp32"), kv("int8-dynamic", "pte", "int8")]


def export_baseline(out_dir: Path, manifest: dict, log=print) -> Path:
    """The unshared equal-compute baseline: arch transformer with n_layers = T, same width and vocabulary,
    random weights, exported as the same KV-cache programs (baseline_programs) into DIR/baseline/; reused while
    its marker records this model shape and the same exporting code (hrm_edge.measure.harness.build_unless_current)."""
    base = out_dir / "baseline"
    cfg = ModelConfig(**manifest["model"])
    cfg = dataclasses.replace(cfg, arch=BASELINE_ARCH, n_layers=cfg.n_steps)
    bos, eos = manifest["tokenizer"]["bos_id"], manifest["tokenizer"]["eos_id"]

    def build() -> list[Path]:
        import torch  # the export stack: only when the baseline is (re)built

        from hrm_edge.export.onnx import export_onnx_decode
        from hrm_edge.model.lm import HRMLM

        log(f"  exporting the unshared baseline ({cfg.n_layers} independent blocks) into {base} ...")
        torch.manual_seed(0)
        model = HRMLM(cfg).eval()
        base.mkdir(parents=True, exist_ok=True)
        save_model(base, model)
        paths = []
        for art in baseline_programs():
            if art.format == "onnx":
                export_onnx_decode(model, base / art.path)
            else:
                lower_kv_pte(model, base / art.path, art.precision, bos, eos)
            paths.append(base / art.path)
        return paths

    build_unless_current(base / BASELINE_MARKER, {"model": dataclasses.asdict(cfg)}, build)
    return base


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
    # "full"; "speculative" (exact: the first cycle drafts, the full depth verifies); "adaptive" (not exact: a token
    # whose first-cycle top probability is >= DEFAULT_EXIT_THRESHOLD exits there, hrm_edge.runtime.adaptive)
    mode: str = "full"
    draft: str = ""  # speculative and adaptive ONNX: the draft and verify graphs beside `name` (a .pte holds both)
    verify: str = ""

    def measure(self, t: DecodeTiming, verbose: bool = False) -> dict:
        kind = "peer-decode" if self.model == "peer" else "decode"
        graphs = ("--draft", self.draft, "--verify", self.verify) if self.draft else ()
        flag = {"full": (), "speculative": ("--draft-len", DRAFT_LEN, "--lookup-len", t.lookup_len),
                "adaptive": ("--exit-threshold", DEFAULT_EXIT_THRESHOLD)}[self.mode]
        extra = (*flag, *graphs) if flag else ()
        return decode_in_child(kind, self.folder, self.name, t, verbose, tuple(map(str, extra)))

    @property
    def label(self) -> str:
        return self.name + (f" ({self.mode})" if self.mode != "full" else "")


def passed_here(a: Artifact) -> bool:
    return (a.parity or {}).get(host_target(), {}).get("passed", False)


def speculative_jobs(out_dir: Path, manifest: dict, mode: str = "speculative") -> list[DecodeJob]:
    """Self-speculative decoding (or adaptive depth, mode "adaptive") of the eager model, of each ExecuTorch program
    with draft and verify methods (adaptive: where the gate checked its skip method), and of each full-depth ONNX KV
    graph that has a draft and a verify graph of its precision (it passes where all three passed)."""
    arts = {a.path: a for a in manifest["artifacts"]}
    jobs = [DecodeJob(manifest["model"]["arch"], out_dir, "eager", "eager", "fp32", mode=mode)]
    jobs += [DecodeJob(a.path.split(".")[0], out_dir, a.path, a.format, a.precision, mode=mode,
                       passed=passed_here(a)) for a in arts.values() if a.program == "speculative"
             and (mode != "adaptive" or (a.parity or {}).get(host_target(), {}).get("adaptive", {}).get("checked"))]
    for kv in [a for a in arts.values() if a.program == "kv_cache" and a.format == "onnx" and a.cycles is None]:
        pair = [arts.get(name) for name in speculative_set(kv.path)[1:]]
        if all(pair):
            jobs.append(DecodeJob(kv.path.split(".")[0], out_dir, kv.path, kv.format, kv.precision, mode=mode,
                                  passed=all(passed_here(a) for a in (kv, *pair)), draft=pair[0].path,
                                  verify=pair[1].path))
    return jobs


def decode_jobs(out_dir: Path, manifest: dict, baseline: bool, peers: bool, log=print) -> list[DecodeJob]:
    """Eager fp32, every KV-cache artifact, the speculative modes, then the unshared baseline's and the peers'
    programs."""
    arch = manifest["model"]["arch"]
    jobs = [DecodeJob(arch, out_dir, "eager", "eager", "fp32")] + [
        DecodeJob(arch, out_dir, a.path, a.format, a.precision, a.cycles is None, passed=passed_here(a))
        for a in manifest["artifacts"] if a.program == "kv_cache"]
    jobs += speculative_jobs(out_dir, manifest) + speculative_jobs(out_dir, manifest, "adaptive") if arch == "hrm" else []
    if baseline:
        base = export_baseline(out_dir, manifest, log)
        jobs += [DecodeJob("baseline", base, "eager", "eager", "fp32")] + [
            DecodeJob("baseline", base, a.path, a.format, a.precision) for a in baseline_programs()]
    if peers:
        for program in build_peers(PeerShape.from_model(manifest["model"]), out_dir / "peers", log):
            precision = {"8da4w": "int4"}.get(program.precision, program.precision)
            jobs.append(DecodeJob("peer", program.path.parent, program.name, program.path.suffix[1:], precision))
    return jobs


def run_decode_bench(out_dir: Path, timing: DecodeTiming, baseline: bool, peers: bool = False, log=print,
                     verbose: bool = False) -> dict:
    """Every decode job timed in `rounds` interleaved rounds (each a fresh child: `repeats` generations, medians);
    a row's figures are the median round's. Interleaving spreads a busy moment of the machine over all jobs."""
    manifest = read_manifest(out_dir)
    jobs = decode_jobs(out_dir, manifest, baseline, peers, log)
    measured: list[list[dict]] = [[] for _ in jobs]
    with tempfile.TemporaryDirectory(prefix="hrm-bench-") as tmp:
        timing = dataclasses.replace(timing, prompts=text_prompts(out_dir, timing.prompt_len, Path(tmp) / "p.npy"))
        for r in range(timing.rounds):
            for job, runs in zip(jobs, measured):
                runs.append(job.measure(timing, verbose))
                log(f"  round {r + 1}/{timing.rounds} {job.model:<9} {job.label:<44} "
                    f"decode {runs[-1]['decode_tokens_per_s']:7.0f} tok/s")
    rows = []
    for job, runs in zip(jobs, measured):
        row = sorted(runs, key=lambda m: m["decode_tokens_per_s"])[len(runs) // 2]
        rows.append(row | {"model": job.model, "format": job.format, "precision": job.precision, "mode": job.mode,
                           "full_depth": job.full_depth, "passed": job.passed, "rounds": timing.rounds,
                           "decode_tokens_per_s_rounds": [m["decode_tokens_per_s"] for m in runs],
                           "bytes": (job.folder / job.name).stat().st_size if job.name != "eager" else None})
    add_decode_ratios(rows)
    add_adaptive_speedups(rows)
    return {"prompt_len": timing.prompt_len, "new_tokens": timing.new_tokens, "rounds": timing.rounds,
            "weight_cache": timing.weight_cache, "prompts": "text", "draft_len": DRAFT_LEN, "rows": rows,
            "lead": lead_rows(rows)}


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
        twin = twins.get(kind(row["artifact"])) if row.get("mode", "full") == "full" else None
        if twin:
            row["decode_vs_baseline"] = row["decode_tokens_per_s"] / twin["decode_tokens_per_s"]
        peer = peers.get((runtime(row["format"]), row["precision"] == "fp32"))
        if peer and row.get("full_depth", True):  # the depth dial runs fewer block applications: not a peer's match
            row["peer"] = peer["artifact"]
            row["decode_vs_peer"] = row["decode_tokens_per_s"] / peer["decode_tokens_per_s"]


def full_depth_program(artifact: str) -> str:
    """The program an adaptive row is compared with: the same program at full depth, the plain KV program of its
    format and precision (an ONNX set's row is named by its KV graph; hrm.fp32.spec.pte -> hrm.fp32.kv.pte)."""
    return artifact.replace(".spec.pte", ".kv.pte")


def add_adaptive_speedups(rows: list[dict]) -> None:
    """Each adaptive row's decode speed against the same program's at full depth (speedup_vs_full_depth)."""
    full = {(r["model"], r["artifact"]): r for r in rows if r.get("mode", "full") == "full"}
    for row in rows:
        base = full.get((row["model"], full_depth_program(row["artifact"]))) if row.get("mode") == "adaptive" else None
        if base:
            row["full_depth_artifact"] = base["artifact"]
            row["speedup_vs_full_depth"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]


ORT_DYNAMIC_BASELINE = "baseline/" + artifact_name("hrm", "int8-ortdynamic", "onnx")


def ort_dynamic_baseline(out_dir: Path, manifest: dict, log=print) -> dict | None:
    """onnxruntime's own int8 path for a Loop graph, as the baseline our static int8 graphs are compared
    with: quantize_dynamic(hrm.fp32.onnx, EnableSubgraph) (it quantizes every MatMul with a constant
    weight, inside the Loop body too, as DynamicQuantizeLinear -> MatMulInteger; per-channel int8
    weights). Not a shipped artifact (it has no eager int8 reference); scored against the parity
    bundle's fp32 logits. Returns the quality record, or None without an fp32 ONNX graph."""
    fp32 = next((a for a in manifest["artifacts"] if (a.format, a.precision, a.program, a.iteration, a.cycles)
                 == ("onnx", "fp32", "full_sequence", "onnx_loop", None)), None)
    if fp32 is None:
        return None
    from onnxruntime.quantization import QuantType, quantize_dynamic  # its onnx and sympy: only when built here

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
    full = [a for a in manifest["artifacts"] if a.program == "full_sequence"]  # the others: the decode benchmark's
    fp32_bytes = {a.format: a.bytes for a in full if a.precision == "fp32"}
    programs = [("eager", "eager", "fp32", {}, {})]
    for art in full:
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
              ort_baseline: bool = True, weight_cache: bool = True, verbose: bool = False) -> dict:
    manifest = read_manifest(out_dir)
    seq_len = seq_len or min(128, manifest["model"]["max_seq_len"])  # in 1..max_seq_len: main checks it
    baseline = ort_dynamic_baseline(out_dir, manifest, log) if ort_baseline else None
    rows = []
    for path, fmt, precision, quantization, known in _full_sequence_programs(manifest, baseline):
        args = ["forward", out_dir, path, "--seq-len", seq_len, "--repeats", repeats, *child_flags(weight_cache)]
        row = run_child(args, threads, verbose)
        row.update(format=fmt, precision=precision, mode=quantization.get("mode", ""),
                   scales=quantization.get("activation_scales", "").split(" ")[0])
        row.update(known)
        rows.append(row)
        log(f"  {row['artifact']:<34} {row['latency_ms']:8.2f} ms")
    eager = rows[0]["latency_ms"]
    for row in rows:
        row["speedup_vs_eager"] = eager / row["latency_ms"]
    return {"target": host_target(), "cpu": cpu_info(threads), "threads": threads, "seq_len": seq_len,
            "repeats": repeats, "weight_cache": weight_cache,
            "model": {k: manifest["model"][k] for k in ("arch", "d_model", "vocab_size", "H_cycles", "L_cycles")},
            "rows": rows}


def cpu_words(result: dict) -> str:
    """The CPU sentence every table caption ends with (empty for a result recorded before it was measured)."""
    return f" {describe_cpu(result['cpu'])}." if result.get("cpu") else ""


def weight_cache_words(on: bool) -> str:
    if on:
        return ".pte programs with XNNPACK's weight cache on, as ExecuTorch's Android and iOS builds run them"
    return ".pte programs with XNNPACK's weight cache off (--no-weight-cache: the pip wheel's default)"


def generations(result: dict) -> int:
    """Generations per program and round: a row's own count (every prompt once at least), or, in a bench.json
    written before rows held it, --repeats // 3."""
    rows = result["decode"]["rows"]
    return rows[0].get("generations", max(1, result["repeats"] // 3)) if rows else max(1, result["repeats"] // 3)


def render_decode_table(result: dict) -> str:
    d = result["decode"]
    lines = [f"Generation with a KV cache, batch 1, {d['prompt_len']}-token prompts cut from the validation text then "
             f"{d['new_tokens']} greedy tokens, "
             f"{result['threads']} thread(s), {result['target']}; each program in a fresh process, median of "
             f"{generations(result)} generations (every prompt at least once), the median of {d['rounds']} interleaved "
             f"round(s); "
             f"{weight_cache_words(d.get('weight_cache', False))}.{cpu_words(result)}", "",
             "| model | program | bytes | load s | time to first token ms | prefill tok/s | decode tok/s | "
             "decode vs eager fp32 | vs unshared baseline | vs peer (same runtime and precision class) | peak RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in d["rows"]:
        b = f"{r['bytes']:,}" if r.get("bytes") else "–"
        vb = f"{r['decode_vs_baseline']:.2f}x" if "decode_vs_baseline" in r else "–"
        vp = f"{r['decode_vs_peer']:.2f}x ({r['peer']})" if "decode_vs_peer" in r else "–"
        program = r["artifact"] + mode_words(r)
        lines.append(f"| {r['model']} | {program} | {b} | {r['load_s']:.2f} | {r['ttft_ms']:.1f} | "
                     f"{r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} | {r['decode_vs_eager_fp32']:.2f}x | "
                     f"{vb} | {vp} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


MODES = ("full", "speculative", "adaptive")  # decode modes, in the order the tables list them


def mode_words(r: dict) -> str:
    """What a decode row's mode adds to its program's name."""
    if r.get("mode") == "speculative":
        lookup = (f", context lookup <= {r['lookup_len']} in {r['lookup_share']:.0%} of rounds"
                  if r.get("lookup_len") else "")
        return f" speculative k={r['draft_len']}, {r['acceptance']:.0%} kept{lookup}"
    if r.get("mode") == "adaptive":
        vs = f", {r['speedup_vs_full_depth']:.2f}x full depth" if "speedup_vs_full_depth" in r else ""
        return f" adaptive, top prob >= {r['exit_threshold']:g}: {r['exit_rate']:.0%} exited{vs}"
    return ""


def lead_rows(rows: list[dict]) -> list[dict]:
    """Per runtime, precision class and mode ("full"; "speculative": exact, the full model's tokens; "adaptive": not
    exact, <= 1.005x held-out bits per byte at the default threshold), our fastest
    program that passed its parity gate (what an export ships) against the peer of that runtime and class."""
    best: dict = {}
    for r in rows:
        if "decode_vs_peer" in r and r.get("passed", True):
            key = (r["peer"], r["precision"] == "fp32", r.get("mode", "full"))
            if key not in best or r["decode_tokens_per_s"] > best[key]["decode_tokens_per_s"]:
                best[key] = r
    peers = {r["artifact"]: r for r in rows if r["model"] == "peer"}
    return [{"runtime": "executorch" if peers[peer]["format"] == "pte" else "onnxruntime",
             "precision": "fp32" if fp32 else "int8", "mode": mode, "ours": r["artifact"],
             "ours_tokens_per_s": r["decode_tokens_per_s"], "peer": peer,
             "peer_tokens_per_s": peers[peer]["decode_tokens_per_s"], "ratio": r["decode_vs_peer"],
             "ours_bytes": r["bytes"], "peer_bytes": peers[peer]["bytes"]}
            for (peer, fp32, mode), r in sorted(best.items(), key=lambda kv: (MODES.index(kv[0][2]), kv[0][:2]))]


def render_peer_ratios(result: dict) -> str:
    """The lead table (lead_rows): full depth, self-speculative decoding and adaptive depth apart."""
    lead = result["decode"].get("lead", [])
    if not lead:
        return ""
    lines = ["Decode against what each runtime's own tooling makes at the same shape (random weights), on prompts "
             "cut from the validation text." + cpu_words(result), "",
             "| runtime | class | mode | ours (fastest passing) | bytes | decode tok/s | peer | bytes | decode tok/s "
             "| ours / peer |", "|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    for x in lead:
        lines.append(f"| {x['runtime']} | {x['precision']} | {x['mode']} | {x['ours']} | {x['ours_bytes']:,} | "
                     f"{x['ours_tokens_per_s']:.0f} | {x['peer']} | {x['peer_bytes']:,} | {x['peer_tokens_per_s']:.0f} | "
                     f"**{x['ratio']:.2f}x** |")
    return "\n".join(lines) + "\n"


def depth_dial_rows(manifest: dict, decode: dict) -> list[dict]:
    """The depth dial (export --cycles): each depth's quality (manifest) beside the decode speed of its
    KV-cache program (the int8 one where the export built it, else fp32)."""
    H = manifest["model"]["H_cycles"]
    speed = {r["artifact"]: r["decode_tokens_per_s"] for r in decode["rows"] if r["model"] not in ("baseline", "peer")}
    rows = []
    for d in manifest.get("depth_dial") or []:
        cycles = None if d["cycles"] == H else d["cycles"]
        kv_ptes = {a.precision: a.path for a in manifest["artifacts"]
                   if (a.format, a.program, a.cycles) == ("pte", "kv_cache", cycles) and a.path in speed}
        program = kv_ptes.get("int8") or kv_ptes.get("fp32")
        rows.append(d | {"program": program, "decode_tokens_per_s": speed.get(program)})
    return rows


def render_depth_table(rows: list[dict], result: dict | None = None) -> str:
    lines = [f"Depth dial: the same weights with fewer outer cycles (validation windows of the parity bundle)."
             f"{cpu_words(result or {})}", "",
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
             f"{weight_cache_words(result.get('weight_cache', False))}.{cpu_words(result)}", "",
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
    p = ArgumentParser(prog="python -m hrm_edge.bench", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=path_arg, help="export folder (holds manifest.json)")
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
    p.add_argument("--lookup-len", type=int, default=DEFAULT_LOOKUP_LEN,
                   help="self-speculative decoding: a round whose context already holds its text (prompt lookup) takes "
                        f"at most this many proposals from it, verified in one call (default {DEFAULT_LOOKUP_LEN}; 0: the "
                        "first cycle drafts every round)")
    p.add_argument("--json", type=path_arg, help="where to write the JSON results (default DIR/bench.json); the "
                                                 "markdown table goes beside it, the same name ending in .md")
    p.add_argument("--no-verify", action="store_true", help="run the artifacts without first checking them against "
                   "the manifest's sha256 (for artifacts edited on purpose)")
    p.add_argument("--verbose", action="store_true", help="show the runtimes' and the export stack's own log lines "
                   "and warnings (the benchmark processes' stderr too)")
    a = p.parse_args(argv)
    refuse_out_of_range(("--threads", a.threads, 1 <= a.threads <= 256, "in 1..256"),
                        ("--repeats", a.repeats, a.repeats >= 1, ">= 1"), ("--rounds", a.rounds, a.rounds >= 1, ">= 1"),
                        ("--seq-len", a.seq_len, a.seq_len is None or a.seq_len >= 1, ">= 1"),  # None: the default
                        ("--lookup-len", a.lookup_len, a.lookup_len >= 0, ">= 0"))
    if a.json is not None and a.json.suffix == ".md":  # the table would overwrite the results
        raise UserError(f"--json {a.json} ends in .md, the name of the table written beside it; give a .json name")
    quiet_third_party(a.verbose)
    manifest = read_manifest(a.dir, needs=("model", "tokenizer", "parity_bundle"))
    verify_files(a.dir, manifest, no_verify=a.no_verify)  # every file it loads; its children trust this check
    context = manifest["model"]["max_seq_len"]
    prompt_len = a.prompt_len if a.prompt_len is not None else min(128, context // 2)
    new_tokens = a.new_tokens if a.new_tokens is not None else min(128, context - prompt_len)
    if prompt_len < 1 or new_tokens < 1 or prompt_len + new_tokens > context:
        raise UserError(f"--prompt-len and --new-tokens must be >= 1 and together fit the context of "
                        f"{context} tokens")
    if a.seq_len is not None and not 1 <= a.seq_len <= context:
        raise UserError(f"--seq-len must be in 1..{context}")
    # before minutes of benchmarking, after the refusals above (its folder is made here)
    json_path = check_writable_file(a.json or a.dir / "bench.json")
    if a.peers:
        require_peer_extra()  # before minutes of benchmarking, not after
    if not a.no_weight_cache and any(art.format == "pte" for art in manifest["artifacts"]):
        weight_cache_enabled()  # one clear error now if this ExecuTorch build offers no way to set it
    result = run_bench(a.dir, a.threads, a.seq_len, a.repeats, ort_baseline=not a.no_baseline,
                       weight_cache=not a.no_weight_cache, verbose=a.verbose)
    print("decode benchmark:")
    timing = DecodeTiming(a.threads, prompt_len, new_tokens, max(1, a.repeats // 3), a.rounds, not a.no_weight_cache,
                          lookup_len=a.lookup_len)
    result["decode"] = run_decode_bench(a.dir, timing, baseline=not a.no_baseline, peers=a.peers, verbose=a.verbose)
    table = render_peer_ratios(result) + "\n" + render_table(result) + "\n" + render_decode_table(result)
    result["depth_dial"] = depth_dial_rows(manifest, result["decode"])
    if result["depth_dial"]:
        table += "\n" + render_depth_table(result["depth_dial"], result)
    print(table)
    atomic_write_text(json_path, json.dumps(result, indent=2) + "\n")
    atomic_write_text(json_path.with_suffix(".md"), table)
    print(f"wrote {json_path} and {json_path.with_suffix('.md')}")
    return 0
