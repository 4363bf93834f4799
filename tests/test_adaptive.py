"""Adaptive depth: a token exits after the first outer cycle when a halting rule says so, its skipped applications'
keys/values taken from the same role's first-cycle ones. The token-by-token eager decoder and the teacher-forced
all-positions pass must compute the same logits and depths."""
import numpy as np
import pytest
import torch

from hrm_edge.config import ModelConfig
from hrm_edge.model.eager import EagerAdaptiveDecoder, EagerDecoder
from hrm_edge.model.lm import HRMLM, HaltingHead, HaltingRule, adaptive_forward
from hrm_edge.runtime.decoders import decode_logits, generate

TOKENS = [4, 8, 15, 16, 23, 42, 7, 1, 30, 2, 9, 60, 33, 5, 5, 12, 50, 3, 21, 44]


def tiny_model(seed: int = 0, H: int = 2, L: int = 2) -> HRMLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, H_cycles=H, L_cycles=L, max_seq_len=64, ffn_hidden=64)
    model = HRMLM(cfg).eval()
    with torch.no_grad():  # sharper readouts than the init's, so that top probabilities spread over (0, 1)
        model.embed.weight.mul_(40.0)
        model.block.attn.wo.weight.mul_(20.0)  # and attention that matters, so that copied keys/values show
    return model


def middle_threshold(model, rule_head=None) -> float:
    """A threshold that some positions pass and some do not: the median score."""
    rule = HaltingRule(0.0, rule_head)
    with torch.no_grad():
        from hrm_edge.model.lm import run_first_cycle

        first = run_first_cycle(model, torch.tensor([TOKENS]))
        return float(rule.scores(model, first.output_state(model), first.logits)[0, 2:].median())


def sequential(model, rule, prefill: int):
    dec = EagerAdaptiveDecoder(model, rule)
    logits = decode_logits(dec, np.array([TOKENS]), prefill)[0]
    return logits, [model.cfg.H_cycles] * prefill + dec.depths


@pytest.mark.parametrize("H, L, with_head", [(2, 2, False), (3, 1, False), (2, 3, True)])
def test_parallel_equals_sequential(H, L, with_head):
    model = tiny_model(1, H, L)
    head = None
    if with_head:
        torch.manual_seed(3)
        head = HaltingHead(model.cfg.d_model).eval()
    rule = HaltingRule(middle_threshold(model, head), head)
    seq_logits, seq_depths = sequential(model, rule, prefill=2)
    with torch.no_grad():
        par_logits, par_depths = adaptive_forward(model, torch.tensor([TOKENS]), rule, prefix=2)
    assert seq_depths == par_depths[0].tolist()
    assert 4 <= seq_depths.count(1) <= len(TOKENS) - 6  # both kinds of token
    np.testing.assert_allclose(par_logits[0].numpy(), seq_logits, atol=1e-5, rtol=0)
    with torch.no_grad():  # and exiting changes the later tokens' logits: the copied keys/values are read
        full = model(torch.tensor([TOKENS]))[0].numpy()
    deep = np.array(seq_depths) == H
    assert np.abs(full[deep] - seq_logits[deep]).max() > 1e-3


def test_nothing_exits_is_full_depth():
    model = tiny_model(2)
    rule = HaltingRule(1.5)
    logits, depths = sequential(model, rule, prefill=3)
    assert depths == [2] * len(TOKENS)
    np.testing.assert_allclose(logits, decode_logits(EagerDecoder(model), np.array([TOKENS]), 3)[0], atol=1e-5, rtol=0)
    prompt = TOKENS[:5]
    assert generate(EagerAdaptiveDecoder(model, rule), prompt, 30).tokens == generate(EagerDecoder(model), prompt, 30).tokens


def test_everything_exits_is_the_first_cycle():
    """Threshold 0: every decoded token's logits are the one-cycle model's (its first cycle never reads deeper keys)."""
    model = tiny_model(3)
    logits, depths = sequential(model, HaltingRule(0.0), prefill=1)
    assert depths == [2] + [1] * (len(TOKENS) - 1)
    with torch.no_grad():
        one_cycle = model(torch.tensor([TOKENS]), n_cycles=1)[0].numpy()
    np.testing.assert_allclose(logits[1:], one_cycle[1:], atol=1e-5, rtol=0)
