import pytest
import torch

from hrm_edge.config import ModelConfig
from hrm_edge.model.lm import (HRMLM, DecodeForm, FunctionalDecodeForm, KVCache, NoCache, StackedKVCache, TracedForm,
                               empty_cache, parameter_counts)

TINY = dict(vocab_size=97, d_model=32, n_heads=4, max_seq_len=32)


def make(arch="hrm", seed=0, **kw):
    torch.manual_seed(seed)
    model = HRMLM(ModelConfig(arch=arch, **(TINY | kw))).eval()
    # random gate biases and step embeddings so the checks do not pass only because of the init values
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", ["hrm", "transformer"])
def test_causal(arch):
    """Perturbing token j must leave the logits at every position < j unchanged."""
    model = make(arch)
    tokens = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        base = model(tokens)
        for j in (0, 7, 23):
            changed = tokens.clone()
            changed[:, j] = (changed[:, j] + 1) % 97
            out = model(changed)
            assert torch.equal(out[:, :j], base[:, :j]), f"position < {j} changed"
            assert not torch.allclose(out[:, j], base[:, j]), "the perturbed position itself must change"


@pytest.mark.parametrize("ablation", [{}, {"hierarchy": False}, {"gating": False}, {"use_step_embedding": False}])
def test_loop_forms_agree(ablation):
    """python loop (eager), while_loop (the ONNX Loop form) and the unrolled torch.export graph, for the
    full model and each ablation of the study."""
    model = make(H_cycles=2, L_cycles=2, **ablation)
    tokens = torch.randint(0, 97, (3, 17))
    with torch.no_grad():
        loop = model(tokens, form="loop")
        while_loop = model(tokens, form="while_loop")
        unrolled = torch.export.export(TracedForm(model, "loop"), (tokens,), strict=False).module()(tokens)
    assert (loop - while_loop).abs().max().item() <= 1e-5
    assert (loop - unrolled).abs().max().item() <= 1e-5
    assert loop.abs().max() > 0.1  # not trivially zero


def test_fewer_cycles_and_aux_readouts():
    model = make(H_cycles=3, L_cycles=1, aux_loss_weight=0.5)
    tokens = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        readouts = model(tokens, aux=True)
        assert len(readouts) == 3
        for k in (1, 2, 3):
            assert torch.allclose(model(tokens, n_cycles=k), readouts[k - 1], atol=1e-6)
            assert torch.allclose(model(tokens, form="while_loop", n_cycles=k), readouts[k - 1], atol=1e-5)
    loss, _ = model.loss(tokens, tokens)
    assert torch.isfinite(loss)


def test_parameters_are_one_block():
    model = make(d_model=64, n_heads=4)
    cfg = model.cfg
    block = sum(p.numel() for p in model.block.parameters())
    gates = sum(p.numel() for p in model.gate_fast.parameters()) + sum(p.numel() for p in model.gate_slow.parameters())
    assert gates < 0.15 * block, "the gates must stay a small fraction of the shared block"
    total, unique = parameter_counts(model)
    assert total - unique == (cfg.n_steps - 1) * block
    assert cfg.n_steps == 8
    baseline = make("transformer", d_model=64, n_heads=4, n_layers=8)
    assert sum(p.numel() for p in baseline.parameters()) > 4 * unique


def test_ablations_change_the_model():
    tokens = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        base = make()(tokens)
        plain = make(hierarchy=False)
        assert not hasattr(make(gating=False), "gate_fast")
        assert plain.level_mask[:, 1].sum().item() == 0  # every step is a fast step
        for other in (plain(tokens), make(gating=False)(tokens)):
            assert (other - base).abs().max().item() > 1e-3


def test_gate_init():
    model = HRMLM(ModelConfig(**TINY))
    assert torch.allclose(model.gate_slow.bias, torch.full_like(model.gate_slow.bias, -2.0))
    assert torch.allclose(model.gate_fast.bias, torch.zeros_like(model.gate_fast.bias))


@pytest.mark.parametrize("arch", ["hrm", "transformer"])
def test_kv_cache_decoding_matches_full_sequence(arch):
    """prefill 5 tokens, then decode one token at a time: the logits equal the full-sequence ones, with
    the in-place cache (eager decoding) and with the past/present cache (ONNX form, a Loop for HRM)."""
    model = make(arch, n_layers=3)
    tokens = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        full = model(tokens)
        dec = DecodeForm(model)
        fun = FunctionalDecodeForm(model)
        k, v = empty_cache(model.cfg)
        assert k.shape == (model.cfg.n_steps, 1, 4, 0, 8)  # no past before the prompt
        outs_a, outs_b = [dec(tokens[:, :5], torch.tensor([0]))], []
        logits, k, v = fun(tokens[:, :5], k, v)
        outs_b.append(logits)
        for p in range(5, 12):
            outs_a.append(dec(tokens[:, p : p + 1], torch.tensor([p])))
            logits, k, v = fun(tokens[:, p : p + 1], k, v)
            outs_b.append(logits)
    assert (torch.cat(outs_a, 1) - full).abs().max().item() <= 1e-5
    assert (torch.cat(outs_b, 1) - full).abs().max().item() <= 1e-5
    assert k.shape == (model.cfg.n_steps, 1, 4, 12, 8)  # the past grew by every call's tokens


def test_caches_share_one_interface():
    """update(t, positions, k, v) returns the keys/values block application t attends over: the in-place
    cache the whole buffer (later rows zero), the stacked cache its past plus the new rows."""
    cfg = make().cfg
    k, v = torch.randn(1, 3, cfg.n_heads, cfg.head_dim), torch.randn(1, 3, cfg.n_heads, cfg.head_dim)  # [B, S, H, hd]
    positions = torch.arange(2, 5)
    kv = KVCache(cfg)
    keys, _ = kv.update(1, positions, k, v)
    assert torch.equal(keys[:, :, 2:5], k.transpose(1, 2)) and keys[:, :, 5:].abs().sum() == 0
    past = torch.randn(cfg.n_steps, 1, cfg.n_heads, 2, cfg.head_dim)
    stacked = StackedKVCache(past, past.clone(), new_len=3)
    assert torch.equal(stacked.positions(3), positions)
    keys, _ = stacked.update(torch.tensor(1), positions, k, v)
    assert torch.equal(keys, torch.cat([past[1], k.transpose(1, 2)], dim=2))
    present_k, _ = stacked.present()
    assert torch.equal(present_k[1, :, :, 2:], k.transpose(1, 2)) and present_k[0, :, :, 2:].abs().sum() == 0
    keys, _ = NoCache().update(0, positions, k, v)
    assert torch.equal(keys, k.transpose(1, 2))


def test_gate_dropout_only_in_training():
    model = make(gate_dropout=0.5)
    tokens = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        a, b = model(tokens), model(tokens)
        assert torch.equal(a, b)  # eval: no dropout
        model.train()
        assert not torch.equal(model(tokens), model(tokens))
