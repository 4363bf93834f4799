"""Text completion with an exported model, the way a phone runs it: prefill the prompt once, then decode
one token at a time from the KV cache, streaming the text as it comes.

    python -m hrm_edge.complete --artifacts export/out --runtime executorch "def "
    echo "import os" | python -m hrm_edge.complete --artifacts export/out --runtime onnx --temperature 0.8

The prompt's last token is healed (hrm_edge.runtime.healing: taken back, and the first new token must start with its
bytes; --no-heal turns it off), and tokens already in the text are made less likely by --repetition-penalty.
The last line reports prefill and decode tokens/s. --runtime eager runs the PyTorch model from the same
folder (model.safetensors) with its KV cache. Before loading anything, the files it will load (tokenizer.json
and the program, or config.json and model.safetensors) are checked against the manifest's sha256;
--no-verify skips that check (for artifacts edited on purpose).
"""
from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

from hrm_edge.io import path_arg, refuse_flags, refuse_out_of_range, refuse_unused
from hrm_edge.errors import ArgumentParser, UserError, first_line, run_cli
from hrm_edge.model.checkpoint import load_model
from hrm_edge.quiet import native_stderr_to, quiet_third_party
from hrm_edge.runtime.adaptive import DEFAULT_EXIT_THRESHOLD, AdaptiveDecoder, TopProbRule
from hrm_edge.runtime.decoders import OnnxDecoder, PteDecoder, Sampling, generate
from hrm_edge.runtime.healing import DEFAULT_REPETITION_PENALTY, heal_prompt, prompt_end, token_bytes
from hrm_edge.runtime.speculative import (DEFAULT_DRAFT_LEN, DEFAULT_LOOKUP_LEN, OnnxSpeculativeDecoder,
                                          PteSpeculativeDecoder, RoundPlan, generate_speculative, speculative_set)
from hrm_edge.runtime.manifest import Artifact, read_manifest, verify_files
from hrm_edge.train.tokenizer import eos_id, load_tokenizer

RUNTIMES = ("executorch", "onnx", "eager")
MAX_THREADS = 256


def pick_artifact(manifest: dict, runtime: str, precision: str, program: str = "kv_cache") -> Artifact:
    fmt = {"executorch": "pte", "onnx": "onnx"}[runtime]
    kv = [a for a in manifest["artifacts"] if a.format == fmt and a.program == program and a.cycles is None]
    candidates = [a for a in kv if a.precision == precision]
    if not candidates:
        have = sorted({a.precision for a in kv})
        what = {"kv_cache": "KV-cache", "speculative": "self-speculative (--speculative, --exit-threshold)"}[program]
        how = " --int8 8da4w" if precision == "int4" and fmt == "pte" else ""  # not in a default export
        raise UserError(f"no {precision} {what} {fmt} program in this export (have: {', '.join(have) or 'none'}); "
                        f"re-run python -m hrm_edge.export{how}")
    # onnxruntime's weight-only MatMulNBits graphs decode faster than the static int8 ones (docs/quantization.md)
    return min(candidates, key=lambda a: (a.quantization or {}).get("mode") != "nbits")


def speculative_graphs(manifest: dict, kv: Artifact, flag: str) -> list[str]:
    """The draft and verify graphs that go with the KV graph kv (self-speculative decoding, adaptive depth), gate
    passed; flag: the option that needs them (for the error)."""
    arts = {a.path: a for a in manifest["artifacts"]}
    found = []
    for program, name in zip(("draft", "verify"), speculative_set(kv.path)[1:]):
        art = arts.get(name)
        if art is None:
            raise UserError(f"{flag}: no {program} graph for {kv.path} in this export; re-run python -m "
                            "hrm_edge.export")
        if not art.passed_gate():
            raise UserError(f"{art.path} did not pass the parity gate; refusing to run it")
        found.append(art.path)
    return found


def files_to_load(manifest: dict, runtime: str, precision: str, speculative: bool = False, adaptive: bool = False
                  ) -> list[str]:
    """What `runtime` loads from the export folder, as the manifest names it: the tokenizer, then the KV-cache
    program (or, for eager, the checkpoint's config and weights), then with speculative or adaptive (depth) its draft
    and verify graphs (ExecuTorch: the program with draft, verify and skip methods instead). User errors for what the
    export lacks."""
    if "tokenizer" not in manifest:
        raise UserError("the manifest names no tokenizer; re-run python -m hrm_edge.export")
    if runtime == "eager":
        if precision != "fp32":
            raise UserError("--runtime eager runs the fp32 model; use --precision fp32")
        ckpt = manifest.get("checkpoint") or {}
        if not {"config", "weights"} <= set(ckpt):
            raise UserError("the manifest names no checkpoint (config, weights); re-run python -m hrm_edge.export")
        return [manifest["tokenizer"]["path"], ckpt["config"], ckpt["weights"]]
    two_forms = speculative or adaptive  # the first outer cycle and the rest of the depth apart
    flag = "--speculative" if speculative else "--exit-threshold"
    model = manifest.get("model", {})
    if two_forms and (model.get("arch", "hrm") != "hrm" or model.get("H_cycles", 2) < 2):
        raise UserError(f"{flag} needs the looped HRM model with at least 2 outer cycles (the first one drafts); this "
                        f"export's model is {model.get('arch')!r} with H_cycles {model.get('H_cycles')}")
    one_program = two_forms and runtime == "executorch"  # its forward, draft, verify and skip methods
    art = pick_artifact(manifest, runtime, precision, "speculative" if one_program else "kv_cache")
    if not art.passed_gate():  # on every host it was checked on
        raise UserError(f"{art.path} did not pass the parity gate; refusing to run it")
    graphs = speculative_graphs(manifest, art, flag) if two_forms and not one_program else []
    return [manifest["tokenizer"]["path"], art.path] + graphs


def make_decoder(out_dir: Path, runtime: str, files: list[Path], threads: int, speculative: bool = False,
                 exit_threshold: float | None = None):
    """The decoder of the verified files (files_to_load's order: tokenizer first); with exit_threshold, adaptive depth
    (the artifacts: AdaptiveDecoder over their speculative decoder, the top-probability rule)."""
    if runtime == "eager":
        from hrm_edge.model.eager import EagerAdaptiveDecoder, EagerDecoder, EagerSpeculativeDecoder  # torch
        from hrm_edge.model.lm import HaltingRule

        if exit_threshold is not None:
            return EagerAdaptiveDecoder(load_model(out_dir), HaltingRule(exit_threshold), threads)
        return (EagerSpeculativeDecoder if speculative else EagerDecoder)(load_model(out_dir), threads)
    if exit_threshold is not None:
        return adaptive_decoder(make_decoder(out_dir, runtime, files, threads, speculative=True),
                                read_manifest(out_dir)["model"]["H_cycles"], exit_threshold, files[1].name)
    if speculative:
        if runtime == "executorch":
            return PteSpeculativeDecoder(files[1], threads)
        return OnnxSpeculativeDecoder(*files[1:4], threads)
    cls = PteDecoder if runtime == "executorch" else OnnxDecoder
    return cls(files[1], threads)


def adaptive_decoder(decoder, full_depth: int, exit_threshold: float, name: str) -> AdaptiveDecoder:
    """Adaptive depth over an artifact's speculative decoder; a .spec.pte exported before the skip method is refused."""
    if not decoder.can_skip:
        raise UserError(f"--exit-threshold: {name} has no skip method (adaptive depth); re-run python -m hrm_edge.export")
    return AdaptiveDecoder(decoder, full_depth, TopProbRule(exit_threshold))


def load_decoder(out_dir: Path, runtime: str, files: list[Path], threads: int, verbose: bool, speculative: bool,
                 exit_threshold: float | None = None):
    """make_decoder, with what the runtimes write to stderr while they load (ExecuTorch's C++ cpuinfo and threadpool
    lines, torch's log lines) kept out of the completion unless verbose or the load fails."""
    with tempfile.TemporaryDirectory(prefix="hrm-complete-") as tmp:
        with native_stderr_to(None if verbose else Path(tmp) / "stderr.txt"):
            return make_decoder(out_dir, runtime, files, threads, speculative, exit_threshold)


def read_prompt(arg: str | None) -> str:
    """The prompt from the argument or stdin (bytes, decoded here so that bad UTF-8 is one error line); a user
    error if it is empty or not valid Unicode (a lone surrogate from undecodable command-line bytes)."""
    if arg is None:
        raw = sys.stdin.buffer.read()
        try:
            arg = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on stdin is not UTF-8 text (bad byte at offset {e.start})") from None
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"the prompt is not valid UTF-8 text (undecodable character at offset {e.start})") from None
    if not arg:
        raise UserError("empty prompt (give it as an argument or on stdin)")
    return arg


class TextStream:
    """Streams decoded text token by token: a piece is written once its characters are complete (a multi-byte
    character split across tokens decodes to a trailing U+FFFD until its last byte arrives). vocab_bytes: each
    token id's bytes (hrm_edge.runtime.healing.token_bytes); the first `skip` bytes are not written (a healed
    first token re-spells the prompt's last token)."""

    def __init__(self, vocab_bytes: list[bytes], write, skip: int = 0):
        self.vocab_bytes, self.write, self.skip = vocab_bytes, write, skip
        self.data = b""
        self.printed = ""

    def text(self) -> str:
        return self.data[self.skip:].decode("utf-8", errors="replace")

    def add(self, token: int) -> None:
        self.data += self.vocab_bytes[token]
        text = self.text()
        if not text.endswith("\ufffd") and text.startswith(self.printed):
            self.write(text[len(self.printed):])
            self.printed = text

    def finish(self) -> None:
        """What is left (an incomplete character is written as U+FFFD)."""
        text = self.text()
        if text.startswith(self.printed):
            self.write(text[len(self.printed):])
            self.printed = text


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m hrm_edge.complete", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the text to complete (default: read from stdin)")
    p.add_argument("--artifacts", type=path_arg, default=Path("export/out"), help="export folder (default export/out)")
    p.add_argument("--runtime", choices=RUNTIMES, default="executorch",
                   help="which runtime runs the model (default executorch)")
    p.add_argument("--precision", choices=("fp32", "int8", "int4"), default="fp32",
                   help="which exported program (default fp32; int8 with onnx: the weight-only MatMulNBits graph "
                        "where the export has one, else the static int8 one; int4: 4-bit weights, the int4-nbits "
                        "ONNX graph or the opt-in 8da4w .pte)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--repetition-penalty", type=float, default=DEFAULT_REPETITION_PENALTY,
                   help="divide positive logits (multiply negative ones) of tokens already in the text by this "
                        f"(1 = off; default {DEFAULT_REPETITION_PENALTY}, measured: docs/demo.md)")
    p.add_argument("--no-heal", action="store_true",
                   help="no token healing (by default the prompt's last token is taken back and the first new token "
                        "must start with its text)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1, like one phone core; 0: the runtime's own default)")
    p.add_argument("--truncate", action="store_true",
                   help="keep the last tokens of a prompt longer than the context instead of refusing it")
    p.add_argument("--no-verify", action="store_true",
                   help="load the files without checking them against the manifest's sha256 (for artifacts edited on "
                        "purpose; they are still refused if they are missing or lie outside the folder)")
    p.add_argument("--speculative", action="store_true",
                   help="self-speculative decoding: the first outer cycle drafts, the full depth verifies (the same "
                        "text as without it when greedy; the full model's distribution when sampling)")
    p.add_argument("--draft-len", type=int, default=DEFAULT_DRAFT_LEN,
                   help=f"--speculative: tokens drafted per verification (default {DEFAULT_DRAFT_LEN})")
    p.add_argument("--lookup-len", type=int, default=DEFAULT_LOOKUP_LEN,
                   help="--speculative: a round whose context already holds its text (prompt lookup) takes at most this "
                        f"many proposals from it, verified in one call (default {DEFAULT_LOOKUP_LEN}; 0: never)")
    p.add_argument("--exit-threshold", type=float, metavar="P",
                   help="adaptive depth: a decoded token stops after the first outer cycle when that cycle's top "
                        "probability is >= P (P > 1: nothing exits, the full model's text); onnx and executorch run "
                        "the export's draft and verify programs, which must have passed the parity gate")
    p.add_argument("--adaptive", action="store_true",
                   help=f"adaptive depth at the default threshold, --exit-threshold {DEFAULT_EXIT_THRESHOLD:g} (on the "
                        "shipped model: about a quarter of tokens exit at <= 1.005x the held-out bits per byte)")
    p.add_argument("--verbose", action="store_true",
                   help="show the runtimes' own warnings and log lines (torch, torchao, ExecuTorch's C++ runtime)")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    quiet_third_party(a.verbose)
    sys.stdout.reconfigure(errors="replace")  # an output that cannot hold a character gets "?", not a traceback
    refuse_unused(p, a, ("--draft-len", "--lookup-len"), "--speculative")
    refuse_out_of_range(("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, ">= 1"),
                        ("--threads", a.threads, 0 <= a.threads <= MAX_THREADS, f"in 0..{MAX_THREADS}"),
                        ("--seed", a.seed, a.seed >= 0, ">= 0"))
    # (written so that NaN fails too) a positive temperature below 1e-4 overflows the scaled logits: 0 is greedy
    refuse_out_of_range(("--temperature", a.temperature, a.temperature == 0 or 1e-4 <= a.temperature <= 1e4,
                         "0 (greedy) or in [1e-4, 1e4]"), ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1]"),
                        ("--top-k", a.top_k, a.top_k >= 0, ">= 0"))
    refuse_out_of_range(("--draft-len", a.draft_len, 1 <= a.draft_len <= 16, "in 1..16"),
                        ("--lookup-len", a.lookup_len, 0 <= a.lookup_len <= 64, "in 0..64"))
    if not 1 <= a.repetition_penalty <= 10:
        raise UserError("--repetition-penalty must be in [1, 10] (1 = off)")
    sampling_flags = [flag for flag, value, off in (("--top-k", a.top_k, 0), ("--top-p", a.top_p, 1),
                                                    ("--seed", a.seed, 0)) if value != off]
    if a.temperature == 0:  # greedy would ignore them without a word
        refuse_flags(sampling_flags, ("applies only when sampling", "apply only when sampling"),
                     "add --temperature T > 0, or ")
    if a.adaptive and a.exit_threshold is not None:  # one threshold: --adaptive is --exit-threshold's default
        raise UserError(f"--adaptive is --exit-threshold {DEFAULT_EXIT_THRESHOLD:g}: give one of the two")
    prompt = read_prompt(a.prompt)
    manifest = read_manifest(a.artifacts, needs=("model", "tokenizer"))
    t_verify = time.perf_counter()
    if a.adaptive:
        a.exit_threshold = DEFAULT_EXIT_THRESHOLD
    if a.exit_threshold is not None and (a.speculative or not a.exit_threshold >= 0):
        raise UserError("--exit-threshold (--adaptive) must be >= 0, without --speculative")
    adaptive = a.exit_threshold is not None
    files = verify_files(a.artifacts, manifest,
                         files_to_load(manifest, a.runtime, a.precision, a.speculative, adaptive), a.no_verify)
    verify_ms = 1000 * (time.perf_counter() - t_verify)
    tok = load_tokenizer(files[0])
    ids = tok.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    max_len = manifest["model"]["max_seq_len"]
    if len(ids) > max_len - 1:  # at least one new token
        if not a.truncate:
            raise UserError(f"the prompt is {len(ids)} tokens, the context holds {max_len}; shorten it or pass "
                            "--truncate")
        ids = prompt_end(ids, max_len, a.max_new_tokens)  # room for the new tokens, half the context kept
    try:
        decoder = load_decoder(a.artifacts, a.runtime, files, a.threads, a.verbose, a.speculative, a.exit_threshold)
    except UserError:
        raise
    except Exception as e:  # a runtime that cannot load a file (edited and run with --no-verify): one line
        raise UserError(f"{a.runtime} cannot load {files[-1].name}: {first_line(e)}") from None

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    write(prompt)
    vocab_bytes = token_bytes(tok)
    context, heal = heal_prompt(ids, vocab_bytes) if not a.no_heal else (ids, None)
    stream = TextStream(vocab_bytes, write, skip=len(heal.prefix) if heal else 0)
    run = (functools.partial(generate_speculative, plan=RoundPlan(a.draft_len, a.lookup_len)) if a.speculative
           else generate)
    sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed, a.repetition_penalty)
    g = run(decoder, context, a.max_new_tokens, sampling, eos_id=eos_id(tok), on_token=stream.add, heal=heal)
    stream.finish()
    write("\n")
    name = files[1].name if len(files) > 1 and a.runtime != "eager" else files[-1].name
    if a.speculative:
        kept = f"{g.acceptance:.0%} of drafts kept" if g.proposed else "no drafts"
        name += f", speculative k={a.draft_len}, {kept}"
    if a.exit_threshold is not None:
        name += f", exit >= {a.exit_threshold:g}: {decoder.depths.count(1)}/{len(decoder.depths)} decode steps exited"
    stop = ("EOS" if g.stopped_at_eos else f"--max-new-tokens {a.max_new_tokens}" if len(g.tokens) >= a.max_new_tokens
            else f"the end of the {max_len}-token context")
    threads = f"{a.threads} thread(s)" if a.threads else "the runtime's default threads"
    print(f"[{a.runtime} {name}, {threads}] prefill {g.prompt_len} tokens at {g.prefill_tokens_per_s:.0f} "
          f"tokens/s, decode {len(g.tokens)} tokens at {g.decode_tokens_per_s:.0f} tokens/s (stopped at {stop}); "
          f"{'sha256 of' if not a.no_verify else 'unverified:'} {len(files)} files "
          f"({sum(f.stat().st_size for f in files) / 1e6:.1f} MB) in {verify_ms:.0f} ms")
    return 0
