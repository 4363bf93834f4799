"""The peers (hrm_edge.measure.peers): ExecuTorch's and Optimum's own Llama at our shape, decoded like our programs."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, built_once
from test_cli_errors import assert_user_error

from hrm_edge.measure.harness import DecodeTiming, decode_in_child
from hrm_edge.measure.peers import PEER_FILES, PeerShape, build_peers, parse_shape_overrides, peer_decoder
from hrm_edge.runtime.decoders import decode_logits, generate

TINY = PeerShape(d_model=64, n_heads=4, ffn_hidden=192, n_layers=2, vocab_size=512, max_seq_len=64)
# what hrm_edge.measure.harness's measure_decode returns for every program, so a peer row sits in bench's table
BENCH_DECODE_KEYS = {"artifact", "threads", "prompt_len", "new_tokens", "weight_cache", "load_s", "ttft_ms",
                     "prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mb", "prompts", "generations"}


@pytest.fixture(scope="module")
def tiny_peers(tmp_path_factory):
    """The four peers at a tiny shape (~5 min on the 2-core box: export_llm lowers for ~1.5 min per program)."""
    folder = built_once(tmp_path_factory, "peers", lambda out: build_peers(TINY, out, log=lambda *_: None))
    return folder, build_peers(TINY, folder, log=lambda *_: None)  # what the build made, read back (nothing rebuilt)


@pytest.fixture(scope="module")
def eager_reference(tiny_peers):
    """The transformers Llama the peers were built from, on one random window: tokens [1, 40], logits [1, 40, V]."""
    from transformers import LlamaForCausalLM  # kept lazy: an optional extra (pip install '.[peers]')

    model = LlamaForCausalLM.from_pretrained(tiny_peers[0] / "hf").eval()
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, size=(1, 40))
    with torch.no_grad():
        return tokens, model(torch.from_numpy(tokens)).logits.numpy()


def test_shape_from_manifest_model():
    hrm = {"arch": "hrm", "d_model": 128, "n_heads": 4, "ffn_hidden": 352, "vocab_size": 4096, "max_seq_len": 256,
           "H_cycles": 2, "L_cycles": 3}
    assert PeerShape.from_model(hrm) == PeerShape(128, 4, 352, 8, 4096, 256, 10000.0, 1e-5)  # T = 2 * (3 + 1)
    assert PeerShape.from_model(hrm | {"arch": "transformer", "n_layers": 5}).n_layers == 5
    assert parse_shape_overrides(TINY, ["d_model=256", "norm_eps=1e-6"]) == PeerShape(256, 4, 192, 2, 512, 64, 10000.0, 1e-6)


def test_missing_extra_is_one_line_naming_it(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"d_model": 64, "n_heads": 4, "vocab_size": 512, "max_seq_len": 64}')
    # `import transformers` raises ImportError in this interpreter, as where the extra is not installed
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from hrm_edge.errors import run_cli\nfrom hrm_edge.measure.peers import main\n"
            f"run_cli(main, [{str(tmp_path / 'ckpt')!r}, '--out', {str(tmp_path / 'peers')!r}])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert_user_error(proc, "transformers", "pip install '.[peers]'")
    assert not any((tmp_path / "peers").glob("llama.*")) and not (tmp_path / "peers" / "peers.json").exists()


@pytest.mark.slow
def test_build_is_reused(tiny_peers):
    folder, programs = tiny_peers
    assert [p.name for p in programs] == list(PEER_FILES)
    assert all(p.bytes > 10_000 for p in programs)
    fp32, int8 = (p.bytes for p in programs if p.runtime == "onnxruntime")
    assert int8 < 0.5 * fp32  # quantize_dynamic stored the weights in int8
    logged = []
    again = build_peers(TINY, folder, log=logged.append)
    assert logged == [] and [p.build_s for p in again] == [p.build_s for p in programs]  # nothing rebuilt
    # the marker holds the recipe, so that a peer built another way (export_llm's options) is not reused
    recipe = json.loads((folder / "peers.json").read_text())["recipe"]
    assert recipe["export_llm"][-1] == "backend.xnnpack.extended_ops=True"


@pytest.mark.slow
@pytest.mark.parametrize("name", PEER_FILES)
def test_peer_greedy_continuation_is_deterministic(tiny_peers, name):
    decoder = peer_decoder(tiny_peers[0] / name, threads=1)
    prompt = np.random.default_rng(2).integers(0, TINY.vocab_size, size=16).tolist()
    first = generate(decoder, prompt, 32).tokens
    assert len(first) == 32 and generate(decoder, prompt, 32).tokens == first
    assert generate(peer_decoder(tiny_peers[0] / name, threads=1), prompt, 32).tokens == first  # a fresh load too


@pytest.mark.slow
def test_onnx_peer_past_matches_full_sequence(tiny_peers, eager_reference):
    """Prefill 24 tokens, then 16 single-token steps fed the previous presents as pasts: every position's logits
    equal one full-sequence run of the transformers model (measured 2e-7 on logits of range ~1.2)."""
    tokens, reference = eager_reference
    logits = decode_logits(peer_decoder(tiny_peers[0] / "llama.fp32.onnx"), tokens, prefill_len=24)
    assert logits.shape == reference.shape
    assert np.abs(logits - reference).max() < 1e-4


@pytest.mark.slow
def test_executorch_peer_matches_transformers(tiny_peers, eager_reference):
    """The export_llm program (last-position logits only) after a 24-token prefill and 16 decode steps, against
    the transformers model it was converted from. Measured 1.8e-7 (XNNPACK vs ATen summation order, 2 layers);
    the tolerance 1e-5 still catches a wrong q/k layout, which costs ~1e-2 on these logits (range ~1.2)."""
    tokens, reference = eager_reference
    logits = decode_logits(peer_decoder(tiny_peers[0] / "llama.fp32.pte"), tokens, prefill_len=24)
    assert logits.shape == (1, 1 + 16, TINY.vocab_size)  # the prefill's last row, then one row per step
    assert np.abs(logits - reference[:, 23:]).max() < 1e-5


@pytest.mark.slow
def test_measure_peer_decode_has_the_bench_row_keys(tiny_peers):
    timing = DecodeTiming(threads=1, prompt_len=16, new_tokens=8, repeats=2)
    row = decode_in_child("peer-decode", tiny_peers[0], "llama.int8.onnx", timing)
    assert set(row) == BENCH_DECODE_KEYS
    assert row["artifact"] == "llama.int8.onnx" and row["prompt_len"] == 16 and row["new_tokens"] == 8
    assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["load_s"] > 0
    assert row["peak_rss_mb"] > 10
