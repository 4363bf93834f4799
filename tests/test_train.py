import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_module
from hrm_edge.config import DataConfig, ModelConfig, Preset, TrainConfig, load_preset
from hrm_edge.train.dataset import encode_documents, fixed_windows, load_corpus, random_batch
from hrm_edge.errors import UserError
from hrm_edge.train.loop import check_resume, native_bf16, train
from hrm_edge.train.tokenizer import load_tokenizer


def small_preset(corpus, steps=60, gate_dropout=0.0):
    return Preset(
        name="test",
        model=ModelConfig(vocab_size=300, d_model=32, n_heads=4, max_seq_len=64, H_cycles=2, L_cycles=1,
                          gate_dropout=gate_dropout),
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
    # bits per byte: the loss in bits over the UTF-8 bytes of the tokens the windows predict (the windows' targets
    # are the stream's tokens 1 .. n * seq_len), not over the split's mean bytes a token, which differs from theirs
    tok = load_tokenizer(tmp_path / "ckpt" / "tokenizer.json")
    tc = small_preset(text_corpus).train
    val_texts = load_corpus(DataConfig(corpus=str(text_corpus))).val
    stream = encode_documents(tok, val_texts)
    n_targets = fixed_windows(stream, tc.eval_batches * tc.batch_size, tc.seq_len)[:, 1:].size
    target_bytes = len(tok.decode(stream[1 : n_targets + 1].tolist()).encode("utf-8"))
    split_bytes_per_token = sum(len(t.encode("utf-8")) for t in val_texts) / len(stream)
    assert abs(target_bytes / n_targets / split_bytes_per_token - 1) > 0.01  # the two measures differ here
    for h in hist:
        assert h["val_bits_per_byte"] == pytest.approx(h["val_loss"] / math.log(2) * n_targets / target_bytes, rel=1e-9)


def test_resume_matches_uninterrupted(text_corpus, tmp_path):
    preset = lambda: small_preset(text_corpus, steps=40, gate_dropout=0.3)
    full = train(preset(), tmp_path / "a", progress=False, log=lambda *_: None)
    train(preset(), tmp_path / "b", progress=False, log=lambda *_: None, stop_at=17)
    resumed = train(preset(), tmp_path / "b", resume=True, progress=False, log=lambda *_: None)
    # batches and the gate dropout's masks are functions of (seed, step) and the optimizer state is saved: the
    # resumed run repeats the uninterrupted one bit for bit, in every recorded number but the measured speed, and
    # in its weights
    timeless = lambda hist: [{k: v for k, v in h.items() if k != "tokens_per_s"} for h in hist]
    assert [h["step"] for h in full["history"]] == [0, 30, 40]
    assert timeless(resumed["history"]) == timeless(full["history"])
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_file(tmp_path / run / name) for run in ("a", "b"))
        assert a.keys() == b.keys() and len(a) > 0, name
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_resume_refuses_other_settings_and_a_torn_checkpoint(text_corpus, tmp_path):
    """--resume went on with another seed or schedule than train_state.json records, from a checkpoint without its
    optimizer state, or from weights and optimizer of a step its state file was not (a run killed while saving)."""
    ckpt = tmp_path / "b"
    train(small_preset(text_corpus, steps=40), ckpt, progress=False, log=lambda *_: None, stop_at=17)
    seeded = small_preset(text_corpus, steps=40)
    seeded.train.seed = 99
    with pytest.raises(UserError, match=r"--resume: train.seed is 99, was 1337 when .* was started; a resumed run"):
        check_resume(seeded, ckpt)
    longer = small_preset(text_corpus, steps=50)  # a new end is allowed: recorded with the step it took effect at
    check_resume(longer, ckpt)
    state = train(longer, ckpt, resume=True, progress=False, log=lambda *_: None, stop_at=20)
    assert state["train"]["steps"] == 50 and state["steps_changed"] == [{"at_step": 17, "from": 40, "to": 50}]

    weights = load_file(ckpt / "model.safetensors")
    save_file(weights, ckpt / "model.safetensors", metadata={"step": "30"})  # killed before the state was written
    with pytest.raises(UserError, match="model.safetensors is of step 30, train_state.json of step 20: the run "
                                        "stopped while writing its checkpoint"):
        check_resume(longer, ckpt)
    save_file(weights, ckpt / "model.safetensors", metadata={"step": "20"})
    check_resume(longer, ckpt)
    (ckpt / "optimizer.safetensors").unlink()
    with pytest.raises(UserError, match="has no optimizer.safetensors"):
        check_resume(longer, ckpt)


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
