"""hrm_edge.model.checkpoint: saving and loading a model, the train state and the configs a checkpoint records."""
import json

import pytest
import torch

from hrm_edge.model.checkpoint import (CONFIG, STATE, WEIGHTS, configs_for, load_model, load_train_state, save_checkpoint)
from hrm_edge.config import DataConfig, ModelConfig, QuantConfig
from hrm_edge.errors import UserError
from hrm_edge.model.lm import HRMLM


def tiny_model():
    torch.manual_seed(0)
    return HRMLM(ModelConfig(vocab_size=64, d_model=32, n_heads=4, max_seq_len=16, H_cycles=1, L_cycles=1)).eval()


def test_save_then_load_gives_the_same_model(tmp_path):
    model = tiny_model()
    save_checkpoint(tmp_path, model, None, {"step": 3})
    loaded = load_model(tmp_path)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert loaded.cfg == model.cfg and not loaded.training
    assert load_train_state(tmp_path) == {"step": 3}


def test_missing_or_broken_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=f"missing {CONFIG}"):
        load_model(tmp_path)
    save_checkpoint(tmp_path, tiny_model(), None, {})
    (tmp_path / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(UserError, match=f"cannot load {WEIGHTS}"):
        load_model(tmp_path)


def test_configs_for_reads_the_recorded_configs(tmp_path):
    assert load_train_state(tmp_path) == {}
    data, quant = configs_for(tmp_path)  # no train state: the defaults
    assert data == DataConfig() and quant == QuantConfig()
    (tmp_path / STATE).write_text(json.dumps({"data": {"corpus": "a.txt", "val_percent": 7},
                                              "quant": {"int8_min_top1": 0.9}}))
    data, quant = configs_for(tmp_path, corpus="b.txt")
    assert data.corpus == "b.txt" and data.val_percent == 7 and quant.int8_min_top1 == 0.9
    (tmp_path / STATE).write_text(json.dumps({"data": {"nope": 1}}))
    with pytest.raises(UserError, match="nope"):
        configs_for(tmp_path)
