"""The benchmark child: times one program in this fresh process and prints one JSON line (hrm_edge.measure.harness
starts it; bench, peers and study read the line).

    python -m hrm_edge.measure.child decode DIR ARTIFACT --threads 1 --prompt-len 64 --new-tokens 64 --repeats 3
    python -m hrm_edge.measure.child peer-decode DIR llama.8da4w.pte --threads 1 ...
    python -m hrm_edge.measure.child forward DIR ARTIFACT --threads 1 --seq-len 128 --repeats 10
    python -m hrm_edge.measure.child decode DIR hrm.fp32.kv.onnx --draft hrm.fp32.draft.onnx \
        --verify hrm.fp32.verify.onnx --draft-len 4 ...       # self-speculative (eager, .pte: --draft-len alone)
    python -m hrm_edge.measure.child decode DIR hrm.fp32.spec.pte --exit-threshold 0.8 ...   # adaptive depth

decode: a KV-cache program of ours (DIR/ARTIFACT, .onnx, .ort or .pte), or ARTIFACT "eager": the eager model
of the checkpoint or export folder DIR with its KV cache; peer-decode: a built peer (hrm_edge.measure.peers);
forward: a full-sequence program of the export folder DIR at batch 1, or "eager". The files are not checked
against the manifest here: the parent checked them before starting any child.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
from pathlib import Path

import numpy as np

from hrm_edge.io import path_arg
from hrm_edge.errors import UserError, run_cli
from hrm_edge.measure.harness import DecodeTiming, measure_decode, measure_forward
from hrm_edge.measure.peers import peer_decoder
from hrm_edge.model.checkpoint import load_model
from hrm_edge.runtime.adaptive import AdaptiveDecoder, TopProbRule, generate_adaptive
from hrm_edge.runtime.decoders import (OnnxDecoder, PteDecoder, generate, load_pte, ort_session,
                                      set_pte_threads)
from hrm_edge.runtime.speculative import OnnxSpeculativeDecoder, PteSpeculativeDecoder, RoundPlan, generate_speculative
from hrm_edge.runtime.manifest import read_manifest
from hrm_edge.runtime.xnnpack_options import set_weight_cache

# what loading each kind of program imports, done before the load clock starts: load time is the artifact's
# cost, not the interpreter's
EAGER_IMPORTS = ("torch", "safetensors.torch", "hrm_edge.model.lm", "hrm_edge.model.eager")
PTE_IMPORTS = ("torch", "executorch.kernels.quantized", "executorch.runtime",
               "executorch.extension.pybindings.portable_lib")
KV_PTE_IMPORTS = ("executorch.extension.llm.custom_ops.custom_ops",)  # the KV programs' cache and attention ops


def import_before_the_clock(kind: str, artifact: str) -> None:
    """onnxruntime is imported with hrm_edge.runtime.decoders; torch only by the eager and .pte programs."""
    names = EAGER_IMPORTS if artifact == "eager" else PTE_IMPORTS if artifact.endswith(".pte") else ()
    names += KV_PTE_IMPORTS if artifact.endswith(".pte") and kind != "forward" else ()
    for name in names:
        importlib.import_module(name)


def open_speculative_decoder(folder: Path, artifact: str, draft: str, verify: str, t: DecodeTiming):
    """Self-speculative decoding: the eager model's, the .pte program's (draft and verify methods), or the KV graph
    with its draft and verify graphs."""
    if artifact == "eager":
        from hrm_edge.model.eager import EagerSpeculativeDecoder  # torch: only the eager child loads it

        return EagerSpeculativeDecoder(load_model(folder), t.threads)
    if artifact.endswith(".pte"):
        return PteSpeculativeDecoder(folder / artifact, t.threads, t.weight_cache)
    if not (draft and verify):
        raise UserError("a speculative ONNX timing needs --draft and --verify")
    return OnnxSpeculativeDecoder(folder / artifact, folder / draft, folder / verify, t.threads)


def open_adaptive_decoder(folder: Path, artifact: str, draft: str, verify: str, t: DecodeTiming, threshold: float):
    """Adaptive depth (top-probability rule) over open_speculative_decoder's decoder; the eager model's own."""
    if artifact == "eager":
        from hrm_edge.model.eager import EagerAdaptiveDecoder  # torch: only the eager child loads it
        from hrm_edge.model.lm import HaltingRule

        return EagerAdaptiveDecoder(load_model(folder), HaltingRule(threshold), t.threads)
    inner = open_speculative_decoder(folder, artifact, draft, verify, t)
    return AdaptiveDecoder(inner, read_manifest(folder)["model"]["H_cycles"], TopProbRule(threshold))


def open_decoder(kind: str, folder: Path, artifact: str, t: DecodeTiming):
    """The decoder of one program: eager, ours (by format) or a peer (its own input contract)."""
    if kind == "peer-decode":
        return peer_decoder(folder / artifact, t.threads, t.weight_cache if artifact.endswith(".pte") else None)
    if artifact == "eager":
        from hrm_edge.model.eager import EagerDecoder  # torch: only the eager child loads it

        return EagerDecoder(load_model(folder), t.threads)
    if artifact.endswith((".onnx", ".ort")):
        return OnnxDecoder(folder / artifact, t.threads)
    if artifact.endswith(".pte"):
        return PteDecoder(folder / artifact, t.threads, t.weight_cache)
    raise UserError(f"unknown artifact type: {artifact}")


def forward_loader(folder: Path, artifact: str, threads: int, tokens: np.ndarray, weight_cache: bool):
    """A load function for measure_forward: loads the full-sequence program, returns its call on tokens [1, S]."""
    if artifact.endswith((".onnx", ".ort")):
        def load():
            sess = ort_session(folder / artifact, threads)
            name = sess.get_inputs()[0].name
            return lambda: sess.run(None, {name: tokens})
        return load
    import torch  # the eager model and the .pte programs take torch tensors

    if artifact == "eager":
        torch.set_num_threads(threads)
        x = torch.from_numpy(tokens)

        def load():
            model = load_model(folder)
            return lambda: _no_grad(torch, model, x)
    elif artifact.endswith(".pte"):
        from executorch.runtime import Runtime

        set_pte_threads(threads)
        set_weight_cache(weight_cache)
        x = torch.from_numpy(tokens).contiguous()

        def load():
            _, method = load_pte(Runtime.get(), folder / artifact)
            return lambda: method.execute([x])
    else:
        raise UserError(f"unknown artifact type: {artifact}")
    return load


def _no_grad(torch, model, x):
    with torch.no_grad():
        return model(x)


def main(argv=None) -> int:
    # argparse's own parser: the parent builds these arguments, so a refusal is its bug and keeps the whole stderr
    p = argparse.ArgumentParser(prog="python -m hrm_edge.measure.child", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("decode", "peer-decode", "forward"),
                   help="decode: one of our programs, greedy; peer-decode: a peer Llama program; forward: "
                        "full-sequence calls")
    p.add_argument("dir", type=path_arg, help="the folder holding the program (export, checkpoint, baseline or peers)")
    p.add_argument("artifact", help="file name in DIR, or eager")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the runtime (default: 1)")
    p.add_argument("--repeats", type=int, default=3, help="decode: generations; forward: timed calls after one")
    p.add_argument("--prompt-len", type=int, default=16, help="decode: prompt tokens, prefilled in one call "
                   "(default: 16)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode: greedy tokens timed after it (default: 16)")
    p.add_argument("--seq-len", type=int, default=128, help="forward: tokens per call")
    p.add_argument("--no-weight-cache", action="store_true", help="XNNPACK's weight cache off for .pte programs")
    p.add_argument("--prompts", default="", help="decode: .npy [n, prompt-len] of real-text prompts (default: random)")
    p.add_argument("--draft-len", type=int, default=0, help="decode: self-speculative with this many drafts a round")
    p.add_argument("--lookup-len", type=int, default=0,
                   help="decode, speculative: at most this many proposals a round from the context (0: none)")
    p.add_argument("--draft", default="", help="decode, speculative ONNX: the draft graph's file name in DIR "
                                               "(a .pte program has draft and verify methods)")
    p.add_argument("--verify", default="", help="decode, speculative ONNX: the verify graph's file name in DIR")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="decode: adaptive depth at this top-probability threshold, over the draft and verify graphs "
                        "(--draft, --verify) or the .pte program's draft, verify and skip methods")
    a = p.parse_args(argv)
    import_before_the_clock(a.kind, a.artifact)
    if a.kind == "forward":
        vocab = read_manifest(a.dir)["model"]["vocab_size"]
        tokens = np.random.default_rng(0).integers(0, vocab, size=(1, a.seq_len), dtype=np.int64)  # [1, S]
        load = forward_loader(a.dir, a.artifact, a.threads, tokens, not a.no_weight_cache)
        row = measure_forward(load, a.artifact, a.threads, a.seq_len, a.repeats)
    else:
        t = DecodeTiming(a.threads, a.prompt_len, a.new_tokens, a.repeats, weight_cache=not a.no_weight_cache,
                         prompts=a.prompts)
        if a.exit_threshold is not None:
            row = measure_decode(lambda: open_adaptive_decoder(a.dir, a.artifact, a.draft, a.verify, t, a.exit_threshold),
                                 a.artifact, t, generate_adaptive)
            row["exit_threshold"] = a.exit_threshold
        elif a.draft_len:
            row = measure_decode(lambda: open_speculative_decoder(a.dir, a.artifact, a.draft, a.verify, t),
                                 a.artifact, t, functools.partial(generate_speculative,
                                                                  plan=RoundPlan(a.draft_len, a.lookup_len)))
            row |= {"draft_len": a.draft_len, "lookup_len": a.lookup_len}
        else:
            row = measure_decode(lambda: open_decoder(a.kind, a.dir, a.artifact, t), a.artifact, t, generate)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    run_cli(main)
