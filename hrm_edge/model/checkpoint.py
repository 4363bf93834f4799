"""A checkpoint folder: its file names, saving and loading it, and the configs it was trained with.

    config.json            ModelConfig
    model.safetensors      the weights
    tokenizer.json         the BPE tokenizer
    optimizer.safetensors  AdamW state (training only; flattened, see save_checkpoint)
    train_state.json       step, preset, data / train / quant configs, metrics
    halting.safetensors    optional: the adaptive-depth halting head (python -m hrm_edge.train --halting-head)

The parity gate loads a model from here to re-derive its reference, so this module is light: importing it
needs no torch (torch, safetensors and the model are imported by the functions that load or save tensors).
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from hrm_edge.config import DataConfig, ModelConfig, QuantConfig, from_dict
from hrm_edge.errors import UserError, first_line
from hrm_edge.io import atomic_path, atomic_write_text

CONFIG, WEIGHTS, TOKENIZER, OPTIMIZER, STATE = (
    "config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors", "train_state.json")
HALTING = "halting.safetensors"  # the adaptive-depth halting head (hrm_edge.train.halting), apart from the model


def _save_tensors(files: dict, metadata: dict | None = None) -> None:
    """Each {path: tensors} into a temporary file, and all of them renamed into place after the last is written."""
    from safetensors.torch import save_file  # imports torch: only where tensors are saved

    with contextlib.ExitStack() as renames:
        for path, tensors in files.items():
            save_file(tensors, str(renames.enter_context(atomic_path(path))), metadata=metadata)


def _load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file  # imports torch: only where tensors are loaded

    return load_file(str(path))


def _weights(model) -> dict:
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def save_model(out: Path, model) -> None:
    """config.json and model.safetensors: what load_model reads."""
    model.cfg.save(out / CONFIG)
    _save_tensors({out / WEIGHTS: _weights(model)})


def save_checkpoint(out: Path, model, opt, state: dict) -> None:
    """Weights and optimizer first (written, then renamed into place together), state last: a state file always
    points at complete tensors, and a run killed while writing them leaves the last checkpoint whole. Both tensor
    files record the step (check_checkpoint_step): one killed between the renames leaves files of two steps, which
    --resume refuses instead of applying the optimizer state of one step to the weights of another."""
    model.cfg.save(out / CONFIG)
    files = {out / WEIGHTS: _weights(model)}
    if opt is not None:
        files[out / OPTIMIZER] = {f"{i}.{k}": v.reshape(1) if v.dim() == 0 else v.contiguous()
                                  for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    _save_tensors(files, {"step": str(state.get("step", 0))})
    atomic_write_text(out / STATE, json.dumps(state, indent=2) + "\n")


def tensor_file_step(path: Path) -> int | None:
    """The step a checkpoint's tensor file records in its safetensors header (None: an older file without it)."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        step = header.get("__metadata__", {}).get("step")
        return None if step is None else int(step)
    except (OSError, ValueError, AttributeError, MemoryError) as e:
        raise UserError(f"cannot read {path}: {first_line(e) or type(e).__name__}") from None


def check_checkpoint_step(ckpt: Path, step: int) -> None:
    """A checkpoint to go on from at `step` (train_state.json's): it has the optimizer state, and its tensor files
    are of that step (a run stopped while saving leaves a newer weights file beside the older state)."""
    ckpt = Path(ckpt)
    if step > 0 and not (ckpt / OPTIMIZER).is_file():
        raise UserError(f"--resume: {ckpt} has no {OPTIMIZER} (weights alone cannot go on as the run would have); "
                        "train into a new folder instead")
    for name in (WEIGHTS, OPTIMIZER):
        saved = tensor_file_step(ckpt / name) if (ckpt / name).is_file() else None
        if saved is not None and saved != step:
            raise UserError(f"--resume: {ckpt / name} is of step {saved}, {STATE} of step {step}: the run stopped "
                            "while writing its checkpoint, which cannot be continued; train into a new folder")


def check_checkpoint(ckpt: Path) -> None:
    """A user error (one line) for a checkpoint folder that is not there or lacks a file a model and its tokenizer
    are loaded from: what a command that reads checkpoints checks before its long work."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint folder not found: {ckpt}")
    for name in (CONFIG, WEIGHTS, TOKENIZER):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint {ckpt} is missing {name}")


def load_model(ckpt: Path):
    """The HRMLM of a checkpoint folder, in eval mode. A user error (one line) for a missing file, unreadable
    weights, or weights that do not fit config.json (the first mismatching tensor, both shapes, the file)."""
    from hrm_edge.model.lm import HRMLM  # imports torch: this module stays importable without it

    ckpt = Path(ckpt)
    for name in (CONFIG, WEIGHTS):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint {ckpt} is missing {name}")
    model = HRMLM(ModelConfig.load(ckpt / CONFIG))
    try:
        weights = _load_tensors(ckpt / WEIGHTS)
    except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
        raise UserError(f"checkpoint {ckpt}: cannot load {WEIGHTS}: {first_line(e)}") from None
    check_weights_fit(model.state_dict(), weights, ckpt)
    model.load_state_dict(weights)
    return model.eval()


def save_halting_head(ckpt: Path, head) -> None:
    _save_tensors({Path(ckpt) / HALTING: _weights(head)})


def load_halting_head(ckpt: Path, d_model: int):
    """The HaltingHead of a checkpoint folder; a user error if it has none."""
    from hrm_edge.model.lm import HaltingHead  # torch

    path = Path(ckpt) / HALTING
    if not path.is_file():
        raise UserError(f"checkpoint {ckpt} has no {HALTING}; train one with python -m hrm_edge.train --halting-head {ckpt}")
    head = HaltingHead(d_model)
    try:
        head.load_state_dict(_load_tensors(path))
    except Exception as e:  # a foreign or truncated file, or one for another model width
        raise UserError(f"cannot load {path}: {first_line(e)}") from None
    return head.eval()


def check_weights_fit(expected: dict, weights: dict, ckpt: Path) -> None:
    """Every tensor config.json implies is in the weights file with its shape, and nothing else is: otherwise a
    user error naming the first tensor that differs (torch's own message is a multi-line dump of them all)."""
    where = f"{ckpt / WEIGHTS} does not match {ckpt / CONFIG}"
    for name, tensor in expected.items():
        if name not in weights:
            raise UserError(f"{where}: tensor {name!r} ({list(tensor.shape)} from the config) is not in the file")
        if weights[name].shape != tensor.shape:
            raise UserError(f"{where}: tensor {name!r} has shape {list(weights[name].shape)} in the file, "
                            f"{list(tensor.shape)} from the config")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise UserError(f"{where}: the file has tensor {extra[0]!r} {list(weights[extra[0]].shape)}, which the "
                        f"config has no place for" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def load_optimizer(opt, path: Path) -> None:
    """Inverse of save_checkpoint's flattening: "<param index>.<state key>" -> optimizer state."""
    sd = opt.state_dict()
    try:
        tensors = _load_tensors(path)
    except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
        raise UserError(f"cannot load {path}: {first_line(e)}") from None
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        sd["state"].setdefault(int(index), {})[name] = value.reshape(()) if name == "step" else value
    opt.load_state_dict(sd)


def load_train_state(ckpt: Path) -> dict:
    """train_state.json of a checkpoint folder; {} for a folder without one (e.g. the weights alone). A user error
    (one line) for a file that is not a JSON object: one cut short, or another file under that name."""
    path = Path(ckpt) / STATE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({first_line(e)})") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a JSON object")
    return state


def configs_for(ckpt: Path, corpus: str | None = None) -> tuple[DataConfig, QuantConfig]:
    """The data and quant configs a checkpoint was trained with (its validation split is the parity set);
    `corpus` replaces the recorded corpus."""
    state, where = load_train_state(ckpt), str(Path(ckpt) / STATE)
    data = from_dict(DataConfig, state.get("data", {}), where)
    quant = from_dict(QuantConfig, state.get("quant", {}), where)
    if corpus:
        data.corpus = corpus
    return data, quant


def copy_model_files(src: Path, dest: Path) -> None:
    """config.json, model.safetensors and tokenizer.json of checkpoint `src` into `dest` (atomically, each)."""
    for name in (CONFIG, WEIGHTS, TOKENIZER):
        with atomic_path(dest / name) as tmp:
            shutil.copyfile(src / name, tmp)
