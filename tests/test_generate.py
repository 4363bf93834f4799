"""Decoding: sampling (fast), and on the tiny export: the completion CLI in every runtime, and ExecuTorch's
own text-LLM runner on our KV-cache program and tokenizer.json (slow)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_module
from hrm_edge.model.checkpoint import load_model
from hrm_edge.model.eager import EagerDecoder
from hrm_edge.runtime.decoders import Sampling, generate, sample
from hrm_edge.train.tokenizer import load_tokenizer


def test_sampling():
    logits = np.array([0.0, 3.0, 1.0, 2.9])
    rng = np.random.default_rng(0)
    assert sample(logits, Sampling(), rng) == 1
    assert all(sample(logits, Sampling(temperature=1.0, top_k=1), rng) == 1 for _ in range(20))
    draws = [sample(logits, Sampling(temperature=1.0, top_k=2, seed=0), rng) for _ in range(200)]
    assert set(draws) == {1, 3}
    draws = [sample(logits, Sampling(temperature=1.0, top_p=0.4), rng) for _ in range(50)]
    assert set(draws) == {1}  # the top token alone holds 48% of the mass
    a = [sample(logits, Sampling(temperature=1.0), np.random.default_rng(7)) for _ in range(5)]
    b = [sample(logits, Sampling(temperature=1.0), np.random.default_rng(7)) for _ in range(5)]
    assert a == b


def completion(out, runtime, *extra):
    proc = run_module("hrm_edge.complete", "--artifacts", out, "--runtime", runtime, "--max-new-tokens", 24, *extra, "def ")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]  # the runtimes' load-time noise only with --verbose
    lines = proc.stdout.rstrip("\n").split("\n")
    assert "tokens/s" in lines[-1] and "decode" in lines[-1]
    return "\n".join(lines[:-1])


@pytest.mark.slow
def test_complete_greedy_is_identical_across_runtimes(tiny_export):
    texts = {rt: completion(tiny_export, rt) for rt in ("eager", "onnx", "executorch")}
    assert texts["eager"].startswith("def ") and len(texts["eager"]) > len("def ") + 10
    assert texts["onnx"] == texts["eager"] and texts["executorch"] == texts["eager"]
    # self-speculative decoding in every runtime (eager; the draft and verify graphs; the .spec.pte program's
    # draft and verify methods): the full depth's text
    for runtime in ("eager", "onnx", "executorch"):
        assert completion(tiny_export, runtime, "--speculative", "--temperature", "0") == texts["eager"], runtime
    int8 = completion(tiny_export, "executorch", "--precision", "int8")
    assert int8.startswith("def ")


@pytest.mark.slow
def test_complete_rejects_a_prompt_longer_than_the_context(tiny_export):
    long_prompt = "x = 1\n" * 400
    proc = run_module("hrm_edge.complete", "--artifacts", tiny_export, "--runtime", "onnx", long_prompt)
    assert proc.returncode == 2 and "context" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_module("hrm_edge.complete", "--artifacts", tiny_export, "--runtime", "onnx", "--truncate",
                      "--max-new-tokens", 4, long_prompt)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the kept end of the prompt leaves room for the tokens asked for (it left one: "decode 1 tokens (stopped at
    # max length)"), and the summary says what ended the completion
    summary = proc.stdout.rstrip("\n").split("\n")[-1]
    assert "decode 4 tokens" in summary and "(stopped at --max-new-tokens 4)" in summary, summary
    # an output that cannot encode a character gets "?" instead of a UnicodeEncodeError's traceback
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONIOENCODING="ascii")
    proc = subprocess.run([sys.executable, "-m", "hrm_edge.complete", "--artifacts", str(tiny_export), "--runtime",
                           "onnx", "--max-new-tokens", "3", "caf\u00e9 = 1"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("caf? = 1"), proc.stderr[-2000:]


def load_text_llm_runner():
    """executorch.extension.llm.runner's __init__ imports transformers (for its multimodal part); the text
    runner itself is the compiled _llm_runner module, loaded here directly after torch and the kernels."""
    import torch  # noqa: F401  libtorch must be loaded first
    import executorch  # kept lazy, in this order: after libtorch, before the runner's .so below
    import executorch.kernels.quantized  # noqa: F401
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  our KV program's cache/attention ops

    so = next((Path(list(executorch.__path__)[0]) / "extension" / "llm" / "runner").glob("_llm_runner*.so"))
    spec = importlib.util.spec_from_file_location("executorch.extension.llm.runner._llm_runner", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_executorch_text_llm_runner_runs_our_program(tiny_export):
    runner_mod = load_text_llm_runner()
    runner = runner_mod.TextLLMRunner(str(tiny_export / "hrm.fp32.kv.pte"), str(tiny_export / "tokenizer.json"))
    pieces, stats = [], []
    config = runner_mod.GenerationConfig(echo=False, max_new_tokens=20, temperature=0.0, num_bos=0, num_eos=0)
    runner.generate("def ", config, pieces.append, stats.append)
    tok = load_tokenizer(tiny_export / "tokenizer.json")
    ours = generate(EagerDecoder(load_model(tiny_export)), tok.encode("def ", add_special_tokens=False).ids, 20)
    # the runner's count leaves out the token its prefill samples (text_llm_runner.cpp: it generates
    # max_new_tokens - 1 after that one); the tiny model reaches no EOS within 20 tokens after "def "
    assert len(ours.tokens) == 20 and stats and stats[0].num_generated_tokens == 19, stats
    expected = tok.decode(ours.tokens)
    got = "".join(pieces)
    assert len(expected) > 10 and got == expected, (got, expected)  # the whole greedy text, token for token
