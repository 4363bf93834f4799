"""Training: AdamW, warmup + cosine, grad clipping, periodic validation, resumable checkpoints.

    python -m hrm_edge.train --preset tiny --out runs/tiny
    python -m hrm_edge.train --preset tiny --out runs/tiny --resume      # continue from its checkpoint
    torchrun --nproc_per_node=2 -m hrm_edge.train --preset tiny --out runs/tiny   # data parallel

A checkpoint folder holds config.json (ModelConfig), model.safetensors, tokenizer.json, optimizer.safetensors
and train_state.json (step, preset, metrics). Batches are a pure function of (seed, step), so a resumed
run sees the same data as an uninterrupted one.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment) each process joins a process group (NCCL
on GPUs, one GPU per process; gloo on CPU) and takes its contiguous slice of the same global batch a
single process would draw for that step; gradients are averaged over the processes before clipping, so
N processes train the model one process would, up to floating-point summation order. Rank 0 alone trains
the tokenizer, writes checkpoints and logs; --resume loads rank 0's files on every rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from hrm_edge.model.checkpoint import (CONFIG, OPTIMIZER, STATE, TOKENIZER, WEIGHTS, check_checkpoint,
                                      check_checkpoint_step, load_model, load_optimizer, load_train_state,
                                      save_checkpoint)
from hrm_edge.config import Preset, load_preset
from hrm_edge.train.dataset import (Corpus, check_corpus, encode_documents, fixed_windows, load_corpus, random_batch,
                                    token_byte_lengths)
from hrm_edge.train.halting import train_halting_head
from hrm_edge.errors import ArgumentParser, UserError
from hrm_edge.io import (atomic_write_text, check_writable_dir, path_arg, refuse_flags, refuse_out_of_range,
                         removed_if_failed, some_names, text_arg)
from hrm_edge.model.lm import HRMLM, parameter_counts
from hrm_edge.train.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

RUN_FILES = (CONFIG, WEIGHTS, TOKENIZER, OPTIMIZER, "train_speed.json")  # a run's files before its train_state.json


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
def evaluate(model: HRMLM, windows: np.ndarray, target_bytes: int, batch_size: int,
             rank: int = 0, world: int = 1) -> EvalResult:
    """Mean next-token loss over fixed windows [N, S + 1]; bits per byte over `target_bytes`, the UTF-8 bytes of
    the tokens predicted (windows[:, 1:]; not the split's mean bytes a token: its first windows differ from it).

    With world > 1 (a collective: every rank calls it) rank r takes batches r, r + world, ... of the same
    batches one process would run, and the sums are all-reduced: every rank gets the single-process result."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(rank * batch_size, len(windows), world * batch_size):
        w = torch.from_numpy(windows[i : i + batch_size]).to(device)
        logits = model(w[:, :-1])
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    if world > 1:
        sums = torch.tensor([total, count], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        total, count = sums[0].item(), int(sums[1].item())
    model.train()
    loss = total / count
    return EvalResult(loss, math.exp(loss), total / math.log(2) / max(target_bytes, 1))


def seed_step(seed: int, step: int) -> None:
    """Seed torch's generators from (seed, step), as random_batch draws the data: the gate dropout's masks of a
    resumed run are then those of an uninterrupted one (a seed set once at the start replays them from step 0)."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))


def make_optimizer(model: HRMLM, tc):
    """AdamW; weight decay on matrices only (not norms, gate biases, init states)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=tc.lr, betas=(0.9, 0.95))


def _average_gradients(model: HRMLM, loss: torch.Tensor, world: int) -> torch.Tensor:
    """Replace every gradient by its mean over the ranks; returns the mean loss (for logging).

    Each rank's loss is the mean over an equal share of the global batch, so the mean of the ranks'
    gradients is the gradient of the global-batch mean, what one process computes. Done by hand rather
    than with DistributedDataParallel because training calls model.loss, not forward (DDP's hooks are
    armed by forward), and one flat all-reduce per step (loss riding along) is cheap at these model sizes."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads] + [loss.detach().float().reshape(1)])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat[-1]


@dataclass
class ProcessGroup:
    """This process's place in a data-parallel run: rank 0 of 1 without torchrun."""

    distributed: bool
    rank: int
    world: int
    device: torch.device


def check_batch_split(batch_size: int, world: int) -> None:
    if batch_size % world:
        raise UserError(f"batch_size {batch_size} is not divisible by the number of processes ({world}); "
                        f"the global batch is split evenly across them")


def _process_group(batch_size: int) -> ProcessGroup:
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    check_batch_split(batch_size, world)
    # NCCL only moves CUDA tensors: a GPU per process (main set it). Without torchrun: the GPU if there is one
    # (the same steps, in bf16 where the preset asks for it), else the CPU
    if distributed:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return ProcessGroup(distributed, rank, world, device)


def _tokenizer(preset: Preset, out: Path, corpus: Corpus, resume: bool, group: ProcessGroup):
    """The checkpoint's tokenizer when resuming; otherwise rank 0 trains it on training text and saves it,
    and the other ranks load its file."""
    if resume:  # check_resume has checked the folder
        return load_tokenizer(out / TOKENIZER)
    if group.rank != 0:
        dist.barrier()  # rank 0 trains and saves the tokenizer (below); the others load its file
        return load_tokenizer(out / TOKENIZER)
    sample, n = [], 0
    for text in corpus.train:  # the tokenizer sees training text only
        if n >= preset.data.tokenizer_sample_bytes:
            break
        sample.append(text)
        n += len(text)
    tok = train_tokenizer(sample, preset.model.vocab_size)
    save_tokenizer(tok, out / TOKENIZER)
    if group.distributed:
        dist.barrier()
    return tok


# a rank other than 0 that meets an input error waits this long before it exits: torchrun ends every process as soon as
# one exits with an error, and rank 0, which reports the error, may not have printed it yet. torchrun ends the wait
# as soon as rank 0 exits; it only runs out where rank 0 did not meet the error.
REPORTER_GRACE_S = 30.0
# what a resumed run may change: how it runs (not what it computes), paths that move with a run's folders (the
# corpus's split sha256 is checked) and the number of steps (the end moves: the cosine schedule stretches from the
# resumed step on)
MAY_CHANGE_ON_RESUME = {"train": ("threads", "compile", "bf16_autocast", "distill_from", "steps"), "data": ("corpus",)}


def check_resume(preset: Preset, out: Path) -> None:
    """What --resume needs, checked before the corpus is read (a minute on the default corpus): a whole checkpoint
    in `out` that this preset trained with these settings. Another preset's model, seed or schedule would go on
    under other batches and learning rates than its train_state.json records."""
    if not (Path(out) / STATE).is_file():
        raise UserError(f"--resume: no checkpoint in {out} (missing {STATE})")
    check_checkpoint(out)
    state = load_train_state(out)
    trained_with = state.get("preset")
    if trained_with != preset.name:
        raise UserError(f"--resume: {out} was trained with the preset named {trained_with!r}, not {preset.name!r}; "
                        "resume it with that preset (a name in presets/, or the .toml file of that name)")
    for section, config in (("train", preset.train), ("data", preset.data)):
        recorded = state.get(section, {})
        changed = [f"{section}.{k} is {v!r}, was {recorded[k]!r}" for k, v in dataclasses.asdict(config).items()
                   if k in recorded and k not in MAY_CHANGE_ON_RESUME[section] and recorded[k] != v]
        if changed:
            raise UserError(f"--resume: {changed[0]} when {out} was started" + (f" (and {len(changed) - 1} more)"
                            if len(changed) > 1 else "") + "; a resumed run goes on with the settings it began with")
    check_checkpoint_step(out, state.get("step", 0))


def _resumed_state(state: dict, preset: Preset, log) -> dict:
    """The train state going on under `preset` (check_resume allowed its differences): a new number of steps is
    recorded with the step it took effect at."""
    before = state["train"].get("steps")
    if before != preset.train.steps:
        log(f"resuming at step {state['step']} with {preset.train.steps} steps (the run began with {before}): the "
            "learning-rate schedule stretches from here")
        state.setdefault("steps_changed", []).append({"at_step": state["step"], "from": before,
                                                      "to": preset.train.steps})
    state["train"] = dataclasses.asdict(preset.train)
    return state


def check_new_run_folder(out: Path) -> None:
    """A run without --resume writes a new checkpoint into `out`: a folder that is new, empty, or holds only what a
    run writes before its first checkpoint (one stopped early: started over). One that holds a checkpoint would be
    overwritten from step 0 (--resume continues it); one of other files would get mixed in."""
    entries = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else []
    if STATE in entries:
        raise UserError(f"--out {out} holds a checkpoint: pass --resume to continue it, or choose a new folder "
                        "(a new run would overwrite it)")
    entries = [e for e in entries if e not in RUN_FILES and not e.startswith(".")]
    if entries:
        raise UserError(f"--out {out} holds other files ({some_names(entries)}); train into a new or empty folder")


def _model_and_state(preset: Preset, out: Path, corpus: Corpus, tok, resume: bool, n_train: int, n_val: int, log):
    """(model, train state): the checkpoint's when resuming, else a fresh model fitted to the tokenizer."""
    tc = preset.train
    if resume:
        model = load_model(out).train()
        state = load_train_state(out)
        if state.get("corpus_split_sha256") != corpus.names_sha256:
            raise UserError(f"--resume: the corpus differs from the one {out} was trained on")
        return model, _resumed_state(state, preset, log)
    mc = dataclasses.replace(preset.model, vocab_size=tok.get_vocab_size(),
                             max_seq_len=max(preset.model.max_seq_len, tc.seq_len))
    state = {"step": 0, "preset": preset.name, "train": dataclasses.asdict(tc), "data": dataclasses.asdict(preset.data),
             "quant": dataclasses.asdict(preset.quant),
             "corpus": corpus.source, "corpus_split_sha256": corpus.names_sha256,
             "train_tokens": n_train, "val_tokens": n_val, "history": []}
    return HRMLM(mc), state


def native_bf16(device: torch.device) -> bool:
    """bf16 autocast pays only with native bf16 matmuls: a GPU, or a CPU with AVX-512-BF16 or AMX."""
    if device.type != "cpu":
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@dataclass
class TrainStep:
    """What one optimizer step runs: the (maybe compiled) loss, bf16 or not, and the optional teacher."""

    loss_fn: object  # (tokens, targets, n_cycles) -> (loss, logits)
    bf16: bool
    teacher: HRMLM | None = None


def make_train_step(model: HRMLM, tc, device: torch.device, log=print) -> TrainStep:
    bf16 = tc.bf16_autocast and native_bf16(device)
    if tc.bf16_autocast and not bf16:
        log("bf16 autocast is off: this CPU has no native bf16 (AVX-512-BF16 or AMX); training in fp32")
    teacher = None
    if tc.distill_from:
        teacher = load_model(Path(tc.distill_from)).to(device).eval()
        if teacher.cfg.vocab_size != model.cfg.vocab_size:
            raise UserError(f"train.distill_from: the teacher's vocabulary ({teacher.cfg.vocab_size}) is not the "
                            f"student's ({model.cfg.vocab_size}); train both with the same tokenizer")
        teacher.requires_grad_(False)
    return TrainStep(torch.compile(model.loss) if tc.compile else model.loss, bf16, teacher)


def distillation_loss(logits, teacher_logits, temperature: float):
    """KL(teacher || student) per position [B, S, V] at `temperature`, scaled by T^2 (Hinton et al.)."""
    s = F.log_softmax(logits.flatten(0, 1).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.flatten(0, 1).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


def _optimizer_step(model: HRMLM, opt, batch: tuple, step: int, run: TrainStep, tc, group: ProcessGroup) -> torch.Tensor:
    """One step on this rank's share (x, y [b, S]) of the global batch; returns the loss (the group's mean)."""
    x, y = (torch.from_numpy(a).to(group.device) for a in batch)
    n_cycles = 1 if step < tc.curriculum_steps else None  # the curriculum: shallow first
    with torch.autocast(group.device.type, dtype=torch.bfloat16, enabled=run.bf16):
        loss, logits = run.loss_fn(x, y, n_cycles)
        if run.teacher is not None:
            with torch.no_grad():
                teacher_logits = run.teacher(x)
            kl = distillation_loss(logits, teacher_logits, tc.distill_temperature)
            loss = (1 - tc.distill_weight) * loss + tc.distill_weight * kl
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if group.world > 1:
        loss = _average_gradients(model, loss, group.world)  # before clipping: the norm is the global batch's
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    opt.step()
    return loss


def validation_windows(tok, val_stream: np.ndarray, tc) -> tuple[np.ndarray, int]:
    """The windows every evaluation scores [N, S + 1] and the UTF-8 bytes of the tokens they predict (bits per byte)."""
    windows = fixed_windows(val_stream, tc.eval_batches * tc.batch_size, tc.seq_len)
    return windows, int(token_byte_lengths(tok)[windows[:, 1:]].sum())


def _record_eval(state: dict, step: int, train_loss: float, ev: EvalResult, tokens_per_s: float, bar) -> None:
    state["history"].append({"step": step, "train_loss": train_loss, "val_loss": ev.loss, "val_perplexity": ev.perplexity,
                             "val_bits_per_byte": ev.bits_per_byte, "tokens_per_s": tokens_per_s})
    if bar is not None:  # tqdm.write prints even when the bar is disabled
        bar.write(f"step {step}: val loss {ev.loss:.4f}  ppl {ev.perplexity:.2f}  bpb {ev.bits_per_byte:.4f}")


def train(preset: Preset, out: Path, resume: bool = False, progress: bool = True, log=print,
          stop_at: int | None = None) -> dict:
    """Train preset into `out` (a checkpoint folder). Returns the final train state.

    stop_at: checkpoint and stop after this step, as an interrupted run would (resume continues it).
    If a torch.distributed process group is initialized (see main), every rank must call this; each
    returns the same state."""
    tc = preset.train
    group = _process_group(tc.batch_size)
    rank, world = group.rank, group.world
    if rank != 0:  # one process speaks for the group
        log, progress = (lambda *_: None), False
    check_corpus(preset.data.corpus)  # before the folder is made
    if resume:
        check_resume(preset, out)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    with removed_if_failed(out):  # a corpus found empty (or not text) only when read leaves no folder behind
        out = check_writable_dir(out)
        corpus = load_corpus(preset.data)
    tok = _tokenizer(preset, out, corpus, resume, group)
    train_stream, val_stream = encode_documents(tok, corpus.train), encode_documents(tok, corpus.val)
    val_windows, val_bytes = validation_windows(tok, val_stream, tc)
    model, state = _model_and_state(preset, out, corpus, tok, resume, len(train_stream), len(val_stream), log)
    model.to(group.device)
    if group.distributed:  # every rank built the same init from the same seed (or loaded the same file); make sure
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
    opt = make_optimizer(model, tc)
    if resume and state["step"] > 0:  # check_resume found the file
        load_optimizer(opt, out / OPTIMIZER)
    run = make_train_step(model, tc, group.device, log)
    state["precision"] = "bf16 autocast" if run.bf16 else "fp32"
    total, unique = parameter_counts(model)
    log(f"model: {model.cfg.arch}, {unique:,} unique parameters ({total:,} counting each block application), "
        f"T={model.cfg.n_steps}; train {len(train_stream):,} tokens, val {len(val_stream):,} tokens")

    model.train()
    start = state["step"]
    if start == 0:  # the untrained baseline, so the history shows what training bought
        ev = evaluate(model, val_windows, val_bytes, tc.batch_size, rank, world)
        state["history"].append({"step": 0, "val_loss": ev.loss, "val_perplexity": ev.perplexity,
                                 "val_bits_per_byte": ev.bits_per_byte})
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, disable=not progress, desc="train", unit="step", mininterval=2.0)
    t_last, tokens_since = time.perf_counter(), 0
    t_run = time.perf_counter()
    wall_before = state.get("wall_time_s", 0.0)  # a resumed run adds to the time already spent
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        x, y = random_batch(train_stream, tc.batch_size, tc.seq_len, tc.seed, step)  # the global batch
        seed_step(tc.seed, step)
        if world > 1:  # this rank's contiguous share of it
            share = tc.batch_size // world
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        loss = _optimizer_step(model, opt, (x, y), step, run, tc, group)
        tokens_since += x.size * world
        now = time.perf_counter()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_since / max(now - t_last, 1e-9):.0f}")
        done = step + 1
        if done % tc.eval_every == 0 or done == tc.steps:
            ev = evaluate(model, val_windows, val_bytes, tc.batch_size, rank, world)
            _record_eval(state, done, loss.item(), ev, tokens_since / max(now - t_last, 1e-9), bar if rank == 0 else None)
            t_last, tokens_since = time.perf_counter(), 0
        if done % tc.checkpoint_every == 0 or done == tc.steps or done == stop_at:
            state["step"] = done
            state["wall_time_s"] = wall_before + time.perf_counter() - t_run
            if rank == 0:
                save_checkpoint(out, model, opt, state)
        if done == stop_at:
            break
    bar.close()
    if group.distributed:
        dist.barrier()  # rank 0's checkpoint is on disk before any rank returns (and, say, resumes from it)
    if start >= tc.steps:
        log(f"{out} is already trained to step {start}")
    return state


def training_speed(preset: Preset, steps: int = 12, warmup: int = 3, log=print) -> list[dict]:
    """Training tokens/s of the preset's model under each CPU speed-up choice, measured, not assumed:
    fp32, fp32 + torch.compile, bf16 autocast, bf16 + torch.compile (the bf16 rows only where the CPU has
    native bf16; elsewhere they are listed as skipped, with the reason). Random tokens (speed does not
    depend on the text); median step time after `warmup` steps (torch.compile compiles during those)."""
    mc, tc = preset.model, preset.train
    mc = dataclasses.replace(mc, max_seq_len=max(mc.max_seq_len, tc.seq_len))
    rows = []
    for name, bf16, compiled in [("fp32", False, False), ("fp32 + torch.compile", False, True),
                                 ("bf16 autocast", True, False), ("bf16 autocast + torch.compile", True, True)]:
        if bf16 and not native_bf16(torch.device("cpu")):
            row = {"variant": name, "batch_size": tc.batch_size, "skipped": "no native bf16 on this CPU"}
        else:
            row = _time_training_steps(mc, tc, bf16, compiled, steps, warmup) | {"variant": name}
        rows.append(row)
        result = row.get("error") or row.get("skipped") or f"{row['tokens_per_s']:8.0f} tokens/s"
        log(f"  {name:<32} {result}")
    base = rows[0].get("tokens_per_s")
    for row in rows:
        if base and "tokens_per_s" in row:
            row["vs_fp32"] = row["tokens_per_s"] / base
    return rows


def _time_training_steps(mc, tc, bf16: bool, compiled: bool, steps: int, warmup: int) -> dict:
    torch.manual_seed(tc.seed)
    model = HRMLM(mc).train()
    opt = make_optimizer(model, tc)
    loss_fn = torch.compile(model.loss) if compiled else model.loss
    gen = torch.Generator().manual_seed(0)
    times = []
    try:
        for i in range(warmup + steps):
            x = torch.randint(0, mc.vocab_size, (tc.batch_size, tc.seq_len), generator=gen)
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = loss_fn(x, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t)
    except Exception as e:  # e.g. torch.compile without a working C++ toolchain: reported, not fatal
        return {"batch_size": tc.batch_size, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    step_s = sorted(times)[len(times) // 2]
    return {"batch_size": tc.batch_size, "tokens_per_s": tc.batch_size * tc.seq_len / step_s, "step_s": step_s}


def _init_distributed() -> None:
    """Under torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): join the process group."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))  # one GPU per process
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def speed_test(preset: Preset, steps: int, out: Path | None) -> int:
    """--speed-test: the preset's training tokens/s per variant, printed; train_speed.json into `out` if given."""
    if out:
        check_writable_dir(out)  # before the timing, not after
    if preset.train.threads:
        torch.set_num_threads(preset.train.threads)
    print(f"training speed, preset {preset.name}, batch {preset.train.batch_size} x {preset.train.seq_len} tokens, "
          f"{torch.get_num_threads()} thread(s):")
    rows = training_speed(preset, steps=steps)
    table = ["| variant | batch | tokens/s | vs fp32 |", "|---|---:|---:|---:|"] + [
        f"| {r['variant']} | {r['batch_size']} | " + (f"{r['tokens_per_s']:.0f} | {r['vs_fp32']:.2f}x |"
                                                      if "tokens_per_s" in r else
                                                      f"{'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error']} | – |")
        for r in rows]
    print("\n".join(table))
    if out:
        atomic_write_text(out / "train_speed.json", json.dumps(
            {"preset": preset.name, "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m hrm_edge.train", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="data parallel on N processes (same global batch, split across them; NCCL on GPUs, gloo on CPU):\n"
               "  torchrun --nproc_per_node=N -m hrm_edge.train --preset tiny --out runs/tiny [--resume]\n"
               "the preset's batch_size must be divisible by N; rank 0 writes the checkpoint and the logs")
    p.add_argument("--preset", default="default", help="preset name in hrm_edge/train/presets/ or a .toml path (default: default)")
    p.add_argument("--out", type=path_arg,
                   help="checkpoint folder to write (created if missing); required unless --speed-test")
    p.add_argument("--corpus", type=text_arg,
                   help="text file or folder of UTF-8 text files (default: the Python stdlib source)")
    p.add_argument("--steps", type=int, help="override the preset's number of optimizer steps")
    p.add_argument("--seed", type=int, help="override the preset's seed")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads per process (default: the preset's, else all cores; under torchrun, "
                        "the cores divided by the processes per machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    p.add_argument("--speed-test", action="store_true",
                   help="do not train: measure training tokens/s of the preset's model with fp32, fp32 + torch.compile, "
                        "bf16 autocast and bf16 + torch.compile (bf16 only on CPUs with native bf16) (--steps timed "
                        "steps each, default 12); "
                        "prints a table, and writes train_speed.json into --out if given")
    p.add_argument("--halting-head", type=path_arg, metavar="CHECKPOINT",
                   help="do not train the model: train the adaptive-depth halting head of this checkpoint on its frozen "
                        "model (training split of --corpus, default the checkpoint's own corpus) and write "
                        "CHECKPOINT/halting.safetensors (hrm_edge.train.halting)")
    a = p.parse_args(argv)
    refuse_out_of_range(("--threads", a.threads, a.threads is None or 0 <= a.threads <= 256, "in 0..256"),
                        ("--seed", a.seed, a.seed is None or 0 <= a.seed < 2**32, "in 0..4294967295"))
    if a.halting_head:
        training = (("--preset", a.preset != p.get_default("preset")), ("--out", a.out is not None),
                    ("--steps", a.steps is not None), ("--resume", a.resume), ("--speed-test", a.speed_test))
        refuse_flags([flag for flag, given in training if given],
                     ("does not apply with --halting-head", "do not apply with --halting-head"))
        if a.threads:
            torch.set_num_threads(a.threads)
        train_halting_head(a.halting_head, a.corpus, seed=a.seed or 0)
        return 0
    preset = load_preset(a.preset)
    preset.override(a.corpus, a.steps)
    if a.seed is not None:
        preset.train.seed = a.seed
    if a.threads is not None:
        preset.train.threads = a.threads
    if a.speed_test:
        refuse_flags([flag for flag, given in (("--resume", a.resume), ("--corpus", a.corpus)) if given],
                     ("does not apply with --speed-test", "do not apply with --speed-test"))
        return speed_test(preset, a.steps or 12, a.out)
    if a.out is None:
        raise UserError("--out is required (the checkpoint folder to write)")
    distributed, rank = "RANK" in os.environ, int(os.environ.get("RANK", 0))  # RANK: launched by torchrun
    if distributed:
        if a.threads is None:  # processes on one machine share its cores: torch's default (all, each) oversubscribes
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            share = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            preset.train.threads = min(preset.train.threads or share, share)
    try:
        if not a.resume:
            check_new_run_folder(a.out)
        if distributed:
            # before joining: a rank that left after its own join (on this error) broke rank 0's still under way
            check_batch_split(preset.train.batch_size, int(os.environ.get("WORLD_SIZE", 1)))
            _init_distributed()
        state = train(preset, a.out, resume=a.resume, progress=not a.no_progress)
    except UserError:
        if rank != 0:  # every rank meets the same input error: rank 0 reports it, once
            time.sleep(REPORTER_GRACE_S)
            return 2
        raise
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    if state["history"] and rank == 0:
        last = state["history"][-1]
        print(f"done: step {state['step']}, val loss {last['val_loss']:.4f}, bpb {last['val_bits_per_byte']:.4f} -> {a.out}")
    return 0
