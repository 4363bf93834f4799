"""Text completion with an exported model, the way a phone runs it: prefill the prompt once, then decode
one token at a time from the KV cache, streaming the text as it comes.

    python -m hrm_edge.complete --artifacts export/out --runtime executorch "def "
    echo "import os" | python -m hrm_edge.complete --artifacts export/out --runtime onnx --temperature 0.8

The last line reports prefill and decode tokens/s. --runtime eager runs the PyTorch model from the same
folder (model.safetensors) with its KV cache.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hrm_edge.errors import UserError, run_cli
from hrm_edge.generate import Sampling, generate
from hrm_edge.manifest import Artifact, read_manifest

RUNTIMES = ("executorch", "onnx", "eager")


def pick_artifact(manifest: dict, runtime: str, precision: str) -> Artifact:
    fmt = {"executorch": "pte", "onnx": "onnx"}[runtime]
    kv = [a for a in manifest["artifacts"] if a.format == fmt and a.program == "kv_cache"]
    candidates = [a for a in kv if a.precision == precision]
    if not candidates:
        have = sorted({a.precision for a in kv})
        raise UserError(f"no {precision} KV-cache {fmt} program in this export (have: {', '.join(have) or 'none'}); "
                        f"re-run python -m hrm_edge.export")
    return candidates[0]


def make_decoder(out_dir: Path, manifest: dict, runtime: str, precision: str, threads: int):
    from hrm_edge.generate import EagerDecoder, OnnxDecoder, PteDecoder

    if runtime == "eager":
        if precision != "fp32":
            raise UserError("--runtime eager runs the fp32 model; use --precision fp32")
        from hrm_edge.checkpoint import load_model

        return EagerDecoder(load_model(out_dir), threads), "model.safetensors"
    art = pick_artifact(manifest, runtime, precision)
    if not next(iter((art.parity or {}).values()), {}).get("passed"):
        raise UserError(f"{art.path} did not pass the parity gate; refusing to run it")
    cls = PteDecoder if runtime == "executorch" else OnnxDecoder
    return cls(out_dir / art.path, threads), art.path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrm_edge.complete", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the text to complete (default: read from stdin)")
    p.add_argument("--artifacts", type=Path, default=Path("export/out"), help="export folder (default export/out)")
    p.add_argument("--runtime", choices=RUNTIMES, default="executorch", help="which runtime runs the model")
    p.add_argument("--precision", choices=("fp32", "int8"), default="fp32", help="which exported program (default fp32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1, like one phone core)")
    p.add_argument("--truncate", action="store_true",
                   help="keep the last tokens of a prompt longer than the context instead of refusing it")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        raise UserError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    prompt = a.prompt if a.prompt is not None else sys.stdin.read()
    if not prompt:
        raise UserError("empty prompt (give it as an argument or on stdin)")

    from hrm_edge.tokenizer import eos_id, load_tokenizer

    manifest = read_manifest(a.artifacts)
    tok = load_tokenizer(a.artifacts / manifest["tokenizer"]["path"])
    ids = tok.encode(prompt, add_special_tokens=False).ids
    context = manifest["model"]["max_seq_len"]
    room = context - 1  # at least one new token
    if len(ids) > room:
        if not a.truncate:
            raise UserError(f"the prompt is {len(ids)} tokens, the context holds {context}; shorten it or pass --truncate")
        ids = ids[-room:]
    decoder, name = make_decoder(a.artifacts, manifest, a.runtime, a.precision, a.threads)

    new_ids: list[int] = []
    printed = ""
    sys.stdout.write(prompt)

    def on_token(token: int):
        nonlocal printed
        new_ids.append(token)
        text = tok.decode(new_ids)
        if not text.endswith("\ufffd"):  # wait until a multi-byte character is complete
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    g = generate(decoder, ids, a.max_new_tokens, Sampling(a.temperature, a.top_k, a.top_p, a.seed),
                 eos_id=eos_id(tok), on_token=on_token)
    sys.stdout.write(tok.decode(new_ids)[len(printed):] + "\n")
    stop = "EOS" if g.stopped_at_eos else "max length"
    print(f"[{a.runtime} {name}, {a.threads} thread(s)] prefill {len(ids)} tokens at {g.prefill_tokens_per_s:.0f} "
          f"tokens/s, decode {len(g.tokens)} tokens at {g.decode_tokens_per_s:.0f} tokens/s (stopped at {stop})")
    return 0


if __name__ == "__main__":
    run_cli(main)
