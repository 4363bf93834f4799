"""Self-speculative decoding (hrm_edge.runtime.speculative): the first outer cycle drafts, the full depth verifies.
Greedy output must equal full-depth greedy decoding token for token; sampling must keep the full model's
distribution."""
import functools

import numpy as np
import pytest
import torch

from conftest import REPO
from hrm_edge.config import ModelConfig
from hrm_edge.model.checkpoint import load_model
from hrm_edge.model.eager import EagerDecoder, EagerSpeculativeDecoder
from hrm_edge.model.lm import HRMLM
from hrm_edge.runtime.decoders import Sampling, generate
from hrm_edge.runtime.speculative import accept_greedy, accept_sampled, generate_speculative
from hrm_edge.train.tokenizer import load_tokenizer

SHIPPED = REPO / "hrm_edge" / "default_model"


@functools.cache
def shipped():
    """The shipped model: a random one's greedy output is one token repeated, and its drafts are always kept;
    on real code the first cycle is kept most of the time and corrected some of the time."""
    torch.set_num_threads(1)
    return load_model(SHIPPED), load_tokenizer(SHIPPED / "tokenizer.json")


def code_prompt(start: int, n_bytes: int = 200) -> list[int]:
    text = (REPO / "hrm_edge" / "runtime" / "decoders.py").read_text()[start: start + n_bytes]
    return shipped()[1].encode(text).ids


def tiny_model(seed: int = 0) -> HRMLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, H_cycles=2, L_cycles=3, max_seq_len=96, ffn_hidden=64)
    return HRMLM(cfg).eval()


@pytest.mark.parametrize("draft_len, start", [(1, 0), (2, 900), (4, 1800), (7, 2700)])
def test_greedy_equals_full_depth_greedy(draft_len, start):
    model, prompt = shipped()[0], code_prompt(start)
    full = generate(EagerDecoder(model), prompt, 60)
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 60, draft_len=draft_len)
    assert spec.tokens == full.tokens and len(full.tokens) == 60
    assert spec.rounds == len(spec.round_tokens) and sum(spec.round_tokens) == 60 - 1
    assert 0 < spec.accepted < spec.proposed  # both paths ran: kept drafts and corrections
    assert max(spec.round_tokens) <= draft_len + 1


def test_verified_logits_equal_the_full_models():
    """The verify call's logits at every drafted position are the full-depth logits of those positions."""
    model = tiny_model(1)
    tokens = [4, 8, 15, 16, 23, 42, 7, 1, 30]
    dec = EagerSpeculativeDecoder(model)
    dec.prefill(np.array(tokens[:5]))
    for t in tokens[5:]:
        dec.draft(t)
    verified = dec.verify()  # [4, V]
    with torch.no_grad():
        reference = model(torch.tensor([tokens]))[0, 5:].numpy()
    np.testing.assert_allclose(verified, reference, atol=2e-4, rtol=0)


def test_stops_at_eos_and_context():
    model = tiny_model()  # a random model: its drafts are all kept, which the other tests do not cover
    prompt = [3, 17, 5]
    full = generate(EagerDecoder(model), prompt, 500)  # the context (96) ends it
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 500, draft_len=4)
    assert spec.tokens == full.tokens and len(spec.tokens) == 96 - 3
    eos = full.tokens[10]
    full = generate(EagerDecoder(model), prompt, 500, eos_id=eos)
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 500, eos_id=eos, draft_len=4)
    assert spec.tokens == full.tokens and spec.stopped_at_eos and spec.tokens[-1] == eos


def test_accept_greedy():
    full = np.eye(5)[[1, 2, 3, 4]]  # argmax 1, 2, 3, 4
    assert accept_greedy(full, [1, 2, 3]) == [1, 2, 3, 4]  # all kept, plus the bonus token
    assert accept_greedy(full, [1, 0, 3]) == [1, 2]  # the first disagreement ends the round, corrected


def test_speculative_sampling_keeps_the_target_distribution():
    """One position: proposal d ~ q, kept with min(1, p/q), else drawn from max(0, p - q). The first token's
    empirical distribution over 20,000 draws matches p (not q) within 0.015 per token."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(p)[None, :].repeat(2, 0)  # the verify logits at two positions
    s = Sampling(temperature=1.0)
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    for _ in range(20000):
        d = int(rng.choice(4, p=q))
        counts[accept_sampled(logits, [q], [d], s, rng)[0]] += 1
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.015)
    assert not np.allclose(counts / counts.sum(), q, atol=0.1)


def test_sampled_generation_runs_to_the_budget():
    model = tiny_model()
    g = generate_speculative(EagerSpeculativeDecoder(model), [3, 17, 5], 40, Sampling(temperature=0.8, seed=3))
    assert len(g.tokens) == 40 and g.rounds >= 40 // 5
