import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hrm_edge.config import DataConfig, ModelConfig, Preset, TrainConfig, load_preset
from hrm_edge.train.dataset import load_corpus, random_batch
from hrm_edge.errors import UserError
from hrm_edge.train.loop import train


def small_preset(corpus, steps=60):
    return Preset(
        name="test",
        model=ModelConfig(vocab_size=300, d_model=32, n_heads=4, max_seq_len=64, H_cycles=2, L_cycles=1),
        data=DataConfig(corpus=str(corpus)),
        train=TrainConfig(seq_len=32, batch_size=8, steps=steps, lr=3e-3, warmup_steps=5, eval_every=30,
                          eval_batches=2, checkpoint_every=30),
    )


def test_training_lowers_validation_loss(text_corpus, tmp_path):
    state = train(small_preset(text_corpus), tmp_path / "ckpt", progress=False, log=lambda *_: None)
    hist = state["history"]
    assert hist[0]["step"] == 0 and hist[-1]["step"] == 60
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] - 0.5, hist
    assert 0 < hist[-1]["val_bits_per_byte"] < hist[0]["val_bits_per_byte"]
    saved = json.loads((tmp_path / "ckpt" / "train_state.json").read_text())
    assert saved["step"] == 60


def test_resume_matches_uninterrupted(text_corpus, tmp_path):
    full = train(small_preset(text_corpus, steps=40), tmp_path / "a", progress=False, log=lambda *_: None)
    train(small_preset(text_corpus, steps=40), tmp_path / "b", progress=False, log=lambda *_: None, stop_at=17)
    resumed = train(small_preset(text_corpus, steps=40), tmp_path / "b", resume=True, progress=False,
                    log=lambda *_: None)
    # batches are a function of (seed, step) and the optimizer state is saved: the resumed run repeats the
    # uninterrupted one bit for bit, in every recorded number but the measured speed, and in its weights
    timeless = lambda hist: [{k: v for k, v in h.items() if k != "tokens_per_s"} for h in hist]
    assert [h["step"] for h in full["history"]] == [0, 30, 40]
    assert timeless(resumed["history"]) == timeless(full["history"])
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_file(tmp_path / run / name) for run in ("a", "b"))
        assert a.keys() == b.keys() and len(a) > 0, name
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_splits_are_deterministic_and_disjoint(text_corpus):
    c1, c2 = load_corpus(DataConfig(corpus=str(text_corpus))), load_corpus(DataConfig(corpus=str(text_corpus)))
    assert c1.names_sha256 == c2.names_sha256
    assert c1.train and c1.val and c1.calib
    assert not set(c1.val) & set(c1.train) and not set(c1.val) & set(c1.calib)


def test_default_corpus_is_the_stdlib():
    c = load_corpus(DataConfig(max_corpus_bytes=300_000))
    assert c.source.startswith("python-stdlib")
    assert sum(map(len, c.train)) > 100_000 and c.val


def test_batches_are_a_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    x1, y1 = random_batch(stream, 4, 16, seed=1, step=5)
    x2, _ = random_batch(stream, 4, 16, seed=1, step=5)
    x3, _ = random_batch(stream, 4, 16, seed=1, step=6)
    assert np.array_equal(x1, x2) and not np.array_equal(x1, x3)
    assert np.array_equal(x1[:, 1:], y1[:, :-1])


def test_presets_load():
    assert load_preset("tiny").model.d_model == 64
    assert load_preset("default").model.arch == "hrm"
    with pytest.raises(UserError, match="unknown preset"):
        load_preset("nope")


@pytest.mark.slow
def test_training_speed_choices_are_measured(tmp_path):
    """--speed-test measures every CPU speed-up choice (fp32, torch.compile, bf16 where native) and writes them."""
    from conftest import run_module

    proc = run_module("hrm_edge.train", "--preset", "tiny", "--speed-test", "--steps", "2", "--threads", "1",
                      "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = json.loads((tmp_path / "train_speed.json").read_text())
    rows, tc = saved["rows"], load_preset("tiny").train
    assert saved["preset"] == "tiny" and saved["threads"] == 1
    assert [r["variant"] for r in rows] == ["fp32", "fp32 + torch.compile", "bf16 autocast",
                                             "bf16 autocast + torch.compile"]
    assert all(r.get("tokens_per_s", 0) > 0 for r in rows[:2]), rows
    assert rows[0]["vs_fp32"] == 1.0
    from hrm_edge.train.loop import native_bf16
    import torch
    for row in rows[2:]:  # measured where the CPU has native bf16, listed with the reason where it has not
        assert (row.get("tokens_per_s", 0) > 0) if native_bf16(torch.device("cpu")) else \
            row["skipped"] == "no native bf16 on this CPU", row
    for row in rows:
        assert row["batch_size"] == tc.batch_size, row
        if "tokens_per_s" in row:  # a median step of one preset batch: tokens/s is batch x seq_len / step time
            assert 0 < row["step_s"] < 60, row
            assert row["tokens_per_s"] == pytest.approx(tc.batch_size * tc.seq_len / row["step_s"], rel=1e-12)
            assert row["vs_fp32"] == pytest.approx(row["tokens_per_s"] / rows[0]["tokens_per_s"], rel=1e-12)
            assert f"| {row['variant']} | {tc.batch_size} | {row['tokens_per_s']:.0f} | {row['vs_fp32']:.2f}x |" \
                in proc.stdout, proc.stdout
