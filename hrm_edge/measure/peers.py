"""The peers: the standard model each runtime's own tooling makes at our export's shape, timed like our programs.

    python -m hrm_edge.peers export/out                  # build into export/out/peers/, print decode tok/s
    python -m hrm_edge.peers export/out --shape d_model=256 --shape ffn_hidden=704 --out runs/peers256

What a user would otherwise ship at this size: a Llama (pre-norm, RoPE, RMSNorm, SwiGLU, no biases, untied
head) with n_layers = our block applications T, random weights (speed only), built by
- ExecuTorch's `export_llm` (XNNPACK with its extended ops, as ExecuTorch's own llama_xnnpack.yaml; KV cache +
  custom sdpa): llama.fp32.pte and llama.8da4w.pte (int8 dynamic activations x int4 weights, group 32), and
- Hugging Face Optimum's `optimum-cli export onnx --task text-generation-with-past`: llama.fp32.onnx, and
  llama.int8.onnx from onnxruntime's `quantize_dynamic(weight_type=QInt8)`.
Both start from one random-init `transformers.LlamaForCausalLM` (kept in peers/hf/), so all four programs hold
the same weights. A marker (peers.json) records the shape, the tool versions and the build recipe; a later call with
the same ones reuses the build. Building needs the optional extra: pip install '.[peers]'. Running the built programs
needs only the base install (executorch, onnxruntime).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from hrm_edge.config import ModelConfig, from_dict
from hrm_edge.errors import ArgumentParser, UserError
from hrm_edge.io import (atomic_write_text, check_writable_dir, check_writable_file, flags_given, path_arg,
                         refuse_flags, refuse_out_of_range)
from hrm_edge.measure.harness import DecodeTiming, cpu_info, decode_in_child, describe_cpu
from hrm_edge.quiet import quiet_third_party
from hrm_edge.runtime.decoders import Decoder, PteDecoder, ort_session
from hrm_edge.runtime.manifest import read_manifest

MARKER = "peers.json"
PEER_FILES = ("llama.fp32.pte", "llama.8da4w.pte", "llama.fp32.onnx", "llama.int8.onnx")
GROUP_SIZE = 32  # 8da4w weight groups, as in ExecuTorch's Llama instructions
# export_llm's options. extended_ops: XNNPACK takes the norms, activations and elementwise ops too, as ExecuTorch's
# own llama_xnnpack.yaml sets it; without it (the peers built until 2026-12-05) only the linears were delegated and
# some 480 other kernel calls a token ran outside XNNPACK, where our programs run inside it
EXPORT_LLM_OPTIONS = ("model.use_kv_cache=True", "model.use_sdpa_with_kv_cache=True", "backend.xnnpack.enabled=True",
                      "backend.xnnpack.extended_ops=True")
RECIPE = {"export_llm": list(EXPORT_LLM_OPTIONS), "group_size": GROUP_SIZE,
          "onnx_int8": "quantize_dynamic(weight_type=QInt8), per tensor"}  # a changed recipe builds again
# what building needs beyond the base install (hydra-core and omegaconf come with executorch; export_llm needs them)
EXTRA_MODULES = ("transformers", "optimum.exporters.onnx", "hydra", "omegaconf")
VERSIONED = ("torch", "executorch", "torchao", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime")


@dataclass(frozen=True)
class PeerShape:
    d_model: int
    n_heads: int
    ffn_hidden: int
    n_layers: int  # our block applications per token (T), so the peer does the same compute per token
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        small = [f"{k}={v}" for k, v in dataclasses.asdict(self).items() if not v > 0]
        if small:
            raise UserError(f"peer shape: {', '.join(small)}: every size must be positive")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise UserError(f"peer shape: d_model ({self.d_model}) / n_heads ({self.n_heads}) must be an even head size")

    @classmethod
    def from_model(cls, model: dict) -> "PeerShape":
        """From an export manifest's "model" dict (hrm: T = H_cycles * (L_cycles + 1); transformer: n_layers)."""
        cfg = from_dict(ModelConfig, model, "the model config")
        return cls(cfg.d_model, cfg.n_heads, cfg.ffn_hidden, cfg.n_steps, cfg.vocab_size, cfg.max_seq_len,
                   cfg.rope_theta, cfg.norm_eps)


@dataclass
class PeerProgram:
    name: str  # file name in the peers folder, e.g. "llama.8da4w.pte"
    path: Path
    runtime: str  # "executorch" | "onnxruntime"
    precision: str  # "fp32" | "8da4w" | "int8"
    bytes: int
    build_s: float


def require_peer_extra() -> None:
    missing = []
    for name in EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name.split(".")[0])
    if missing:
        raise UserError(f"building the peers needs {', '.join(missing)}: pip install '.[peers]'")


def tool_versions() -> dict:
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _programs(folder: Path, build_s: dict) -> list[PeerProgram]:
    return [PeerProgram(name, folder / name, "executorch" if name.endswith(".pte") else "onnxruntime",
                        name.split(".")[1], (folder / name).stat().st_size, build_s.get(name, 0.0))
            for name in PEER_FILES]


def build_peers(shape: PeerShape, folder: Path, log=print) -> list[PeerProgram]:
    """Build the four peer programs into `folder` (reused when its marker records the same shape, versions and
    recipe)."""
    folder = Path(folder).resolve()  # the tools run in other working directories
    marker = folder / MARKER
    record = {"shape": dataclasses.asdict(shape), "versions": tool_versions(), "recipe": RECIPE}
    if marker.is_file() and all((folder / n).is_file() for n in PEER_FILES):
        old = json.loads(marker.read_text())
        if {k: old.get(k) for k in record} == record:
            return _programs(folder, old.get("build_s", {}))
    if shape.d_model % GROUP_SIZE or shape.ffn_hidden % GROUP_SIZE:
        raise UserError(f"the 8da4w peer needs d_model and ffn_hidden divisible by {GROUP_SIZE}, got {shape}")
    require_peer_extra()
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # a half-rebuilt folder must never pass for a finished one
    build_s = {}
    with tempfile.TemporaryDirectory(prefix=".build-", dir=folder) as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        hf_dir = _save_hf_llama(shape, folder / "hf", work / "meta.pth")
        log(f"  peers: random-init Llama ({shape.n_layers} layers, d {shape.d_model}) in {time.perf_counter() - t:.1f} s")
        steps = [("llama.fp32.pte", lambda out: _export_llm(shape, work / "meta.pth", None, out)),
                 ("llama.8da4w.pte", lambda out: _export_llm(shape, work / "meta.pth", "8da4w", out)),
                 ("llama.fp32.onnx", lambda out: _optimum_export(hf_dir, out)),
                 ("llama.int8.onnx", lambda out: _quantize_dynamic(folder / "llama.fp32.onnx", out))]
        for name, build in steps:
            t = time.perf_counter()
            build(work / name)
            os.replace(work / name, folder / name)  # every file lands whole, under its final name
            build_s[name] = time.perf_counter() - t
            log(f"  peers: {name} built in {build_s[name]:.1f} s")
    atomic_write_text(marker, json.dumps(record | {"build_s": build_s}, indent=2) + "\n")
    return _programs(folder, build_s)


def _save_hf_llama(shape: PeerShape, hf_dir: Path, meta_path: Path) -> Path:
    """One random-init LlamaForCausalLM (seed 0): saved with save_pretrained for Optimum, and as a Meta-layout
    state dict for export_llm, so the ExecuTorch and ONNX peers hold the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=shape.d_model, intermediate_size=shape.ffn_hidden, num_hidden_layers=shape.n_layers,
                      num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_heads, vocab_size=shape.vocab_size,
                      max_position_embeddings=shape.max_seq_len, rope_theta=shape.rope_theta,
                      rms_norm_eps=shape.norm_eps, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    shutil.rmtree(hf_dir, ignore_errors=True)
    model.save_pretrained(hf_dir)
    torch.save(meta_state_dict(model.state_dict(), shape.n_heads), meta_path)
    return hf_dir


def meta_state_dict(hf: dict, n_heads: int) -> dict:
    """transformers' Llama names -> ExecuTorch's (Meta's) Llama names. HF rotates the two halves of each head
    (rotate_half); Meta rotates adjacent pairs, so wq and wk rows go back from [head, half, i] to [head, i, pair]."""
    def unpermute(w):  # [H * hd, D]
        return w.view(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
           "output.weight": hf["lm_head.weight"]}
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    for key, w in hf.items():
        if not key.startswith("model.layers."):
            continue
        i, rest = key[len("model.layers."):].split(".", 1)
        module = rest.rsplit(".", 1)[0]
        w = unpermute(w) if module in ("self_attn.q_proj", "self_attn.k_proj") else w
        out[f"layers.{i}.{names[module]}.weight"] = w.contiguous()
    return out


def _run_tool(args: list[str], cwd: Path, what: str) -> None:
    """Run a build tool quietly in a subprocess; a failure is a RuntimeError with the tail of its stderr."""
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _export_llm(shape: PeerShape, checkpoint: Path, qmode: str | None, out: Path) -> None:
    """ExecuTorch's Llama recipe: XNNPACK, KV cache with the custom sdpa / update_cache ops, prompts up to the
    context (max_seq_length = max_context_length = ours)."""
    work = Path(tempfile.mkdtemp(dir=out.parent))  # export_llm writes into its cwd (hydra's outputs/ too)
    params = {"dim": shape.d_model, "n_layers": shape.n_layers, "n_heads": shape.n_heads, "n_kv_heads": shape.n_heads,
              "vocab_size": shape.vocab_size, "hidden_dim": shape.ffn_hidden, "norm_eps": shape.norm_eps,
              "rope_theta": shape.rope_theta}
    (work / "params.json").write_text(json.dumps(params))
    args = ["-m", "executorch.extension.llm.export.export_llm", "base.model_class=llama3",
            f"base.params={work / 'params.json'}", f"base.checkpoint={checkpoint}", *EXPORT_LLM_OPTIONS,
            f"export.max_seq_length={shape.max_seq_len}", f"export.max_context_length={shape.max_seq_len}",
            "export.output_name=out.pte"]
    if qmode:
        args += [f"quantization.qmode={qmode}", f"quantization.group_size={GROUP_SIZE}"]
    _run_tool(args, work, f"ExecuTorch export_llm ({qmode or 'fp32'})")
    os.replace(work / "out.pte", out)
    shutil.rmtree(work, ignore_errors=True)


def _optimum_export(hf_dir: Path, out: Path) -> None:
    import onnx  # only here: the timing child imports this module and times programs without onnx loaded

    work = Path(tempfile.mkdtemp(dir=out.parent))
    _run_tool(["-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(hf_dir), "--task",
               "text-generation-with-past", str(work / "onnx")], work, "Optimum ONNX export")
    exported = work / "onnx" / "model.onnx"
    if (work / "onnx" / "model.onnx_data").exists():  # over 2 GB: weights beside the graph, renamed with it
        onnx.save(onnx.load(str(exported)), str(out), save_as_external_data=True, location=out.name + ".data")
    else:
        os.replace(exported, out)
    shutil.rmtree(work, ignore_errors=True)


def _quantize_dynamic(fp32: Path, out: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # its "please run pre-processing" advice
    try:
        quantize_dynamic(fp32, out, weight_type=QuantType.QInt8)
    finally:
        logging.getLogger().setLevel(level)


class PeerPteDecoder(PteDecoder):
    """export_llm's Llama: forward(tokens [1, S], input_pos [1]) -> logits [1, V] of the last position only
    (generate_full_logits=False), caches in the program's buffers."""

    def __init__(self, path: Path, threads: int = 0, weight_cache: bool | None = None):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  llama::custom_sdpa, llama::update_cache

        super().__init__(path, threads, weight_cache)

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        return np.atleast_2d(super()._run(tokens))  # [1, V] (or [S, V]); the last row is the next-token logits


class PeerOnnxDecoder(Decoder):
    """Optimum's text-generation-with-past graph: (input_ids, attention_mask, position_ids,
    past_key_values.N.key/value [1, H, P, hd]) -> (logits [1, S, V], present.N.key/value [1, H, P + S, hd]).
    The presents are the next call's pasts, as Optimum's own ORTModelForCausalLM does."""

    def __init__(self, path: Path, max_seq_len: int, threads: int = 0):
        self.session = ort_session(path, threads)
        self.inputs = {i.name: i.shape for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]  # logits, present.N.key, present.N.value, ...
        self.max_seq_len = max_seq_len  # the graph has no limit of its own; ours, so generate() stops where ours do
        self.reset()

    def reset(self):
        self.past = {name: np.zeros((1, shape[1], 0, shape[3]), np.float32)
                     for name, shape in self.inputs.items() if name.startswith("past_key_values.")}
        self.pos = 0

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        s = len(tokens)
        feeds = {"input_ids": np.asarray(tokens, dtype=np.int64)[None, :],
                 "attention_mask": np.ones((1, self.pos + s), np.int64),
                 "position_ids": np.arange(self.pos, self.pos + s, dtype=np.int64)[None, :]}
        feeds = {k: v for k, v in feeds.items() if k in self.inputs} | self.past
        out = dict(zip(self.outputs, self.session.run(None, feeds)))
        self.past = {name.replace("present.", "past_key_values."): v
                     for name, v in out.items() if name.startswith("present.")}
        self.pos += s
        return out["logits"][0]


def peer_decoder(path: Path, threads: int = 0, weight_cache: bool | None = None) -> Decoder:
    path = Path(path)
    if not path.is_file() or not (path.parent / MARKER).is_file():
        raise UserError(f"not a built peer program (no {path.name}, or no {MARKER} beside it): {path}")
    if path.suffix == ".pte":
        return PeerPteDecoder(path, threads, weight_cache)
    return PeerOnnxDecoder(path, json.loads((path.parent / MARKER).read_text())["shape"]["max_seq_len"], threads)


def parse_shape_overrides(shape: PeerShape, items: list[str]) -> PeerShape:
    """--shape KEY=VALUE (repeatable) on top of the export's shape."""
    fields = {f.name: f for f in dataclasses.fields(PeerShape)}
    changes = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise UserError(f"--shape wants KEY=VALUE with KEY one of {', '.join(fields)}, got {item!r}")
        try:
            changes[key] = float(value) if fields[key].type == "float" else int(value)
        except ValueError:
            raise UserError(f"--shape {item!r}: not a number") from None
    return dataclasses.replace(shape, **changes)


def render_peer_table(shape: PeerShape, rows: list[dict], programs: list[PeerProgram], cpu: dict | None = None) -> str:
    r0 = rows[0]
    lines = [f"Peers at d_model {shape.d_model}, {shape.n_layers} layers, {shape.n_heads} heads, ffn {shape.ffn_hidden}, "
             f"vocab {shape.vocab_size}, context {shape.max_seq_len}: {r0['prompt_len']}-token prompt then "
             f"{r0['new_tokens']} greedy tokens, {r0['threads']} thread(s); .pte programs with XNNPACK's weight cache "
             f"{'on' if r0.get('weight_cache', True) else 'off'}." + (f" {describe_cpu(cpu)}." if cpu else ""), "",
             "| program | bytes | build s | load s | time to first token ms | prefill tok/s | decode tok/s | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r, p in zip(rows, programs):
        lines.append(f"| {p.name} | {p.bytes:,} | {p.build_s:.0f} | {r['load_s']:.2f} | {r['ttft_ms']:.1f} | "
                     f"{r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def _model_dict(folder: Path) -> dict:
    """The model config of an export folder (its manifest) or of a checkpoint folder (its config.json)."""
    if (folder / "config.json").is_file() and not (folder / "manifest.json").is_file():
        return ModelConfig.load(folder / "config.json").to_dict()
    return read_manifest(folder, needs=("model",))["model"]


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m hrm_edge.peers", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=path_arg, nargs="?", help="export folder (manifest.json) or checkpoint folder "
                   "(config.json): the peers take its model's shape")
    p.add_argument("--out", type=path_arg, help="where to build the peers (default DIR/peers for an export folder; "
                                                "required for a checkpoint folder)")
    p.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE",
                   help="change one field of the shape (d_model, n_heads, ffn_hidden, n_layers, vocab_size, max_seq_len, "
                        "rope_theta, norm_eps); repeatable")
    p.add_argument("--build-only", action="store_true", help="build (or reuse) the peers, time nothing")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for every runtime (default 1)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default min(128, context/2))")
    p.add_argument("--new-tokens", type=int, help="greedy new tokens (default min(128, context - prompt))")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per program after the load (default 3)")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="run the .pte programs with XNNPACK's weight cache off (the pip wheel's default; default: on, "
                        "as ExecuTorch's Android and iOS builds)")
    p.add_argument("--json", type=path_arg, help="also write the timings, the shape and the CPU to this JSON file")
    p.add_argument("--verbose", action="store_true", help="show the build tools' and runtimes' own log lines")
    a = p.parse_args(argv)
    if a.build_only:  # they shape the timing, which --build-only leaves out
        timing = ("--threads", "--prompt-len", "--new-tokens", "--repeats", "--no-weight-cache", "--json")
        refuse_flags(flags_given(p, a, timing), ("times nothing with --build-only", "time nothing with --build-only"))
    refuse_out_of_range(("--threads", a.threads, 1 <= a.threads <= 256, "in 1..256"),
                        ("--repeats", a.repeats, a.repeats >= 1, ">= 1"))
    if a.json:
        check_writable_file(a.json)  # before minutes of building
    quiet_third_party(a.verbose)
    if a.dir is None:
        raise UserError("give the export folder whose shape the peers take (see --help)")
    shape = parse_shape_overrides(PeerShape.from_model(_model_dict(a.dir)), a.shape)
    prompt_len = a.prompt_len if a.prompt_len is not None else min(128, shape.max_seq_len // 2)
    new_tokens = a.new_tokens if a.new_tokens is not None else min(128, shape.max_seq_len - prompt_len)
    if prompt_len < 1 or new_tokens < 1 or prompt_len + new_tokens > shape.max_seq_len:
        raise UserError(f"--prompt-len and --new-tokens must be >= 1 and together fit the context of "
                        f"{shape.max_seq_len} tokens")
    if a.out is None and not (a.dir / "manifest.json").is_file():  # not into a checkpoint (the shipped one's package)
        raise UserError(f"{a.dir} is a checkpoint folder: give --out, the folder to build the peers in")
    folder = check_writable_dir(a.out or a.dir / "peers")
    programs = build_peers(shape, folder)
    if a.build_only:
        return 0
    timing = DecodeTiming(a.threads, prompt_len, new_tokens, a.repeats, weight_cache=not a.no_weight_cache)
    rows = []
    for prog in programs:
        rows.append(decode_in_child("peer-decode", prog.path.parent, prog.name, timing, a.verbose))
        print(f"  {prog.name:<16} prefill {rows[-1]['prefill_tokens_per_s']:8.0f} tok/s, "
              f"decode {rows[-1]['decode_tokens_per_s']:7.0f} tok/s")
    cpu = cpu_info(a.threads)
    print(render_peer_table(shape, rows, programs, cpu))
    if a.json:
        record = {"shape": dataclasses.asdict(shape), "cpu": cpu, "rows": rows}
        atomic_write_text(a.json, json.dumps(record, indent=2) + "\n")
    return 0
