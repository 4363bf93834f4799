"""Training: AdamW, warmup + cosine, grad clipping, periodic validation, resumable checkpoints.

    python -m hrm_edge.train --preset tiny --out runs/tiny
    python -m hrm_edge.train --preset tiny --out runs/tiny --resume      # continue from its checkpoint

A checkpoint folder holds config.json (ModelConfig), model.safetensors, tokenizer.json, optimizer.safetensors
and train_state.json (step, preset, metrics). Batches are a pure function of (seed, step), so a resumed
run sees the same data as an uninterrupted one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from hrm_edge.config import ModelConfig, Preset, load_preset
from hrm_edge.data import bytes_per_token, encode_documents, fixed_windows, load_corpus, random_batch
from hrm_edge.errors import UserError, run_cli
from hrm_edge.io import atomic_path, atomic_write_text, check_writable_dir
from hrm_edge.model import HRMLM, parameter_counts
from hrm_edge.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

CONFIG, WEIGHTS, TOKENIZER, OPTIMIZER, STATE = (
    "config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors", "train_state.json")


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    bits_per_byte: float


def lr_at(step: int, tc) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: HRMLM, windows: np.ndarray, bytes_per_tok: float, batch_size: int) -> EvalResult:
    """Mean next-token loss over fixed windows [N, S + 1]; bits per byte via the split's bytes/token."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = torch.from_numpy(windows[i : i + batch_size])
        logits = model(w[:, :-1])
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    loss = total / count
    return EvalResult(loss, math.exp(loss), loss / math.log(2) / bytes_per_tok)


def save_checkpoint(out: Path, model: HRMLM, opt, state: dict) -> None:
    """Weights and optimizer first, state last: a state file always points at complete tensors."""
    model.cfg.save(out / CONFIG)
    with atomic_path(out / WEIGHTS) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    if opt is not None:
        flat = {}
        for i, s in opt.state_dict()["state"].items():
            for k, v in s.items():
                flat[f"{i}.{k}"] = v.reshape(1) if v.dim() == 0 else v.contiguous()
        with atomic_path(out / OPTIMIZER) as tmp:
            save_file(flat, str(tmp))
    atomic_write_text(out / STATE, json.dumps(state, indent=2) + "\n")


def load_model(ckpt: Path) -> HRMLM:
    ckpt = Path(ckpt)
    for name in (CONFIG, WEIGHTS):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint {ckpt} is missing {name}")
    model = HRMLM(ModelConfig.load(ckpt / CONFIG))
    try:
        model.load_state_dict(load_file(str(ckpt / WEIGHTS)))
    except Exception as e:
        raise UserError(f"checkpoint {ckpt}: cannot load {WEIGHTS}: {e}") from None
    return model.eval()


def make_optimizer(model: HRMLM, tc):
    """AdamW; weight decay on matrices only (not norms, gate biases, init states)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=tc.lr, betas=(0.9, 0.95))


def _load_optimizer(opt, path: Path) -> None:
    """Inverse of save_checkpoint's flattening: "<param index>.<state key>" -> optimizer state."""
    sd = opt.state_dict()
    for key, value in load_file(str(path)).items():
        index, name = key.split(".", 1)
        sd["state"].setdefault(int(index), {})[name] = value.reshape(()) if name == "step" else value
    opt.load_state_dict(sd)


def train(preset: Preset, out: Path, resume: bool = False, progress: bool = True, log=print,
          stop_at: int | None = None) -> dict:
    """Train preset into `out` (a checkpoint folder). Returns the final train state.

    stop_at: checkpoint and stop after this step, as an interrupted run would (resume continues it)."""
    tc, mc = preset.train, preset.model
    out = check_writable_dir(out)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)

    corpus = load_corpus(preset.data)
    if resume:
        if not (out / STATE).is_file():
            raise UserError(f"--resume: no checkpoint in {out} (missing {STATE})")
        tok = load_tokenizer(out / TOKENIZER)
    else:
        sample, n = [], 0
        for text in corpus.train:  # the tokenizer sees training text only
            if n >= preset.data.tokenizer_sample_bytes:
                break
            sample.append(text)
            n += len(text)
        tok = train_tokenizer(sample, mc.vocab_size)
        save_tokenizer(tok, out / TOKENIZER)
    train_stream = encode_documents(tok, corpus.train)
    val_stream = encode_documents(tok, corpus.val)
    val_windows = fixed_windows(val_stream, tc.eval_batches * tc.batch_size, tc.seq_len)
    val_bpt = bytes_per_token(corpus.val, len(val_stream))

    if resume:
        model = load_model(out).train()
        state = json.loads((out / STATE).read_text())
        if state.get("corpus_split_sha256") != corpus.names_sha256:
            raise UserError(f"--resume: the corpus differs from the one {out} was trained on")
    else:
        mc = dataclasses.replace(mc, vocab_size=tok.get_vocab_size(), max_seq_len=max(mc.max_seq_len, tc.seq_len))
        model = HRMLM(mc)
        state = {"step": 0, "preset": preset.name, "train": dataclasses.asdict(tc), "data": dataclasses.asdict(preset.data),
                 "quant": dataclasses.asdict(preset.quant),
                 "corpus": corpus.source, "corpus_split_sha256": corpus.names_sha256,
                 "train_tokens": int(len(train_stream)), "val_tokens": int(len(val_stream)), "history": []}
    opt = make_optimizer(model, tc)
    if resume and (out / OPTIMIZER).is_file():
        _load_optimizer(opt, out / OPTIMIZER)
    total, unique = parameter_counts(model)
    log(f"model: {model.cfg.arch}, {unique:,} unique parameters ({total:,} counting each block application), "
        f"T={model.cfg.n_steps}; train {len(train_stream):,} tokens, val {len(val_stream):,} tokens")

    model.train()
    start = state["step"]
    if start == 0:  # the untrained baseline, so the history shows what training bought
        ev = evaluate(model, val_windows, val_bpt, tc.batch_size)
        state["history"].append({"step": 0, "val_loss": ev.loss, "val_perplexity": ev.perplexity,
                                 "val_bits_per_byte": ev.bits_per_byte})
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, disable=not progress, desc="train", unit="step", mininterval=2.0)
    t_last, tokens_since = time.perf_counter(), 0
    t_run = time.perf_counter()
    wall_before = state.get("wall_time_s", 0.0)  # a resumed run adds to the time already spent
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        x, y = random_batch(train_stream, tc.batch_size, tc.seq_len, tc.seed, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16_autocast):
            loss, _ = model.loss(torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        tokens_since += x.size
        now = time.perf_counter()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_since / max(now - t_last, 1e-9):.0f}")
        done = step + 1
        if done % tc.eval_every == 0 or done == tc.steps:
            ev = evaluate(model, val_windows, val_bpt, tc.batch_size)
            state["history"].append({"step": done, "train_loss": loss.item(), "val_loss": ev.loss,
                                     "val_perplexity": ev.perplexity, "val_bits_per_byte": ev.bits_per_byte,
                                     "tokens_per_s": tokens_since / max(now - t_last, 1e-9)})
            t_last, tokens_since = time.perf_counter(), 0
            bar.write(f"step {done}: val loss {ev.loss:.4f}  ppl {ev.perplexity:.2f}  bpb {ev.bits_per_byte:.4f}")
        if done % tc.checkpoint_every == 0 or done == tc.steps or done == stop_at:
            state["step"] = done
            state["wall_time_s"] = wall_before + time.perf_counter() - t_run
            save_checkpoint(out, model, opt, state)
        if done == stop_at:
            break
    bar.close()
    if start >= tc.steps:
        log(f"{out} is already trained to step {start}")
    return state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrm_edge.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default", help="preset name in export/presets/ or a .toml path (default: default)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write (created if missing)")
    p.add_argument("--corpus", help="text file or folder of UTF-8 text files (default: the Python stdlib source)")
    p.add_argument("--steps", type=int, help="override the preset's number of optimizer steps")
    p.add_argument("--seed", type=int, help="override the preset's seed")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the preset's, else all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    a = p.parse_args(argv)
    preset = load_preset(a.preset)
    if a.corpus:
        preset.data.corpus = a.corpus
    if a.steps is not None:
        if a.steps < 1:
            raise UserError("--steps must be >= 1")
        preset.train.steps = a.steps
    if a.seed is not None:
        preset.train.seed = a.seed
    if a.threads is not None:
        preset.train.threads = a.threads
    state = train(preset, a.out, resume=a.resume, progress=not a.no_progress)
    if state["history"]:
        last = state["history"][-1]
        print(f"done: step {state['step']}, val loss {last['val_loss']:.4f}, bpb {last['val_bits_per_byte']:.4f} -> {a.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
