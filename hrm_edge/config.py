"""Configuration dataclasses and TOML presets.

A preset (hrm_edge/train/presets/NAME.toml) has the tables [model], [data], [train] and [quant], whose keys are
the fields of ModelConfig, DataConfig, TrainConfig and QuantConfig. Unknown keys are a user error, not silently ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_text


@dataclass
class ModelConfig:
    arch: str = "hrm"  # "hrm": one shared block iterated; "transformer": n_layers independent blocks
    vocab_size: int = 4096
    d_model: int = 192
    n_heads: int = 6
    ffn_hidden: int = 0  # 0: derived, SwiGLU width ~ 8/3 * d_model rounded up to a multiple of 32
    max_seq_len: int = 256
    # HRM iteration: H outer (slow) cycles, each L inner (fast) steps then one slow step.
    H_cycles: int = 2
    L_cycles: int = 3
    gate_rank: int = 0  # 0: derived, d_model // 8 (low rank keeps the gates a small share of the block)
    slow_gate_bias: float = -2.0  # sigmoid(-2) ~ 0.12: the slow level starts by updating conservatively
    fast_gate_bias: float = 0.0  # sigmoid(0) = 0.5
    use_step_embedding: bool = True
    # ablations (study): hierarchy=False is a plain looped block (one state, every step a fast step, T = H*(L+1));
    # gating=False replaces the gates by plain replacement (z <- block output)
    hierarchy: bool = True
    gating: bool = True
    gate_dropout: float = 0.0  # dropout on the gates' inputs while training (a regulariser of the seed design)
    aux_loss_weight: float = 0.0  # weight of the readouts after outer cycles 1..H-1 (depth dial)
    n_layers: int = 4  # only for arch == "transformer"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        check_fields("model", self, {
            "vocab_size": POSITIVE, "d_model": POSITIVE, "n_heads": POSITIVE, "ffn_hidden": NON_NEGATIVE,
            "max_seq_len": POSITIVE, "H_cycles": POSITIVE, "L_cycles": NON_NEGATIVE, "gate_rank": NON_NEGATIVE,
            "slow_gate_bias": FINITE, "fast_gate_bias": FINITE, "gate_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "aux_loss_weight": NON_NEGATIVE, "n_layers": POSITIVE, "rope_theta": POSITIVE, "norm_eps": POSITIVE})
        if self.arch not in ("hrm", "transformer"):
            raise UserError(f"model.arch must be 'hrm' or 'transformer', got {self.arch!r}")
        if self.d_model % self.n_heads:
            raise UserError(f"model.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise UserError("model head_dim (d_model / n_heads) must be even for RoPE")
        if self.ffn_hidden == 0:
            self.ffn_hidden = 32 * -(-(8 * self.d_model // 3) // 32)
        if self.gate_rank == 0:
            self.gate_rank = max(4, self.d_model // 8)
        if self.H_cycles < 1 or self.L_cycles < 0:
            raise UserError("model.H_cycles must be >= 1 and model.L_cycles >= 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_steps(self) -> int:
        """T: block applications per forward pass."""
        if self.arch == "hrm":
            return self.H_cycles * (self.L_cycles + 1)
        return self.n_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        try:
            values = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not a readable JSON model config ({e})") from None
        return from_dict(cls, values, str(path))


@dataclass
class DataConfig:
    corpus: str = ""  # "" = the Python standard library source of the running interpreter
    max_corpus_bytes: int = 0  # 0 = no limit; the tiny preset reads a small slice to stay fast
    val_percent: int = 5  # files whose path hash falls in this bucket are validation
    calib_percent: int = 5  # next bucket: calibration (never validation)
    tokenizer_sample_bytes: int = 4_000_000  # how much training text the BPE trainer sees

    def __post_init__(self):
        percent = (lambda v: 0 <= v <= 100, "in 0..100")
        check_fields("data", self, {"max_corpus_bytes": NON_NEGATIVE, "val_percent": percent, "calib_percent": percent,
                                    "tokenizer_sample_bytes": POSITIVE})
        if self.val_percent + self.calib_percent > 100:
            raise UserError(f"data.val_percent + data.calib_percent must be <= 100, got "
                            f"{self.val_percent} + {self.calib_percent}")


@dataclass
class TrainConfig:
    seed: int = 1337
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 2000
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 500
    threads: int = 0  # 0 = torch default
    # bf16 matmuls where the CPU has them natively (AVX-512-BF16 or AMX: 1.48x fp32 measured on Zen 4) or on a
    # GPU; elsewhere training stays fp32 (an AVX2 CPU ran bf16 autocast 36x slower than fp32). Eval stays fp32.
    bf16_autocast: bool = False
    compile: bool = False  # torch.compile the training step (measured with --speed-test before choosing it)
    # the seed's training ideas (study rows): a curriculum over iterations (the first curriculum_steps steps
    # run 1 outer cycle, then all), and distillation (KL on logits at distill_temperature, weight
    # distill_weight) from a teacher checkpoint trained with the same tokenizer
    curriculum_steps: int = 0
    distill_from: str = ""
    distill_weight: float = 0.5
    distill_temperature: float = 1.0

    def __post_init__(self):
        check_fields("train", self, {
            "seed": NON_NEGATIVE, "seq_len": POSITIVE, "batch_size": POSITIVE, "steps": POSITIVE, "lr": POSITIVE,
            "min_lr": NON_NEGATIVE, "warmup_steps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
            "grad_clip": POSITIVE, "eval_every": POSITIVE, "eval_batches": POSITIVE, "checkpoint_every": POSITIVE,
            "threads": NON_NEGATIVE, "curriculum_steps": NON_NEGATIVE, "distill_weight": UNIT,
            "distill_temperature": POSITIVE})


@dataclass
class QuantConfig:
    int8_modes: str = "static,dynamic"  # what `python -m hrm_edge.export` builds unless --int8 says otherwise
    calib_samples: int = 32  # calibration windows (of the training seq_len) from the calibration split
    calib_seed: int = 1234
    static_fp32_linears: str = ""  # comma-separated block linears the static int8 ONNX leaves in fp32
    # quality gate of every int8 artifact against fp32 eager, on the validation split
    int8_min_top1: float = 0.97
    int8_max_ppl_ratio: float = 1.02
    # the same for the opt-in 4-bit program (int8 mode "8da4w"): 4-bit weights cost more than 8-bit ones
    int4_min_top1: float = 0.85
    int4_max_ppl_ratio: float = 1.10

    def __post_init__(self):
        ratio = (lambda v: 1 <= v < math.inf, ">= 1")
        check_fields("quant", self, {"calib_samples": POSITIVE, "calib_seed": NON_NEGATIVE, "int8_min_top1": UNIT,
                                     "int8_max_ppl_ratio": ratio, "int4_min_top1": UNIT, "int4_max_ppl_ratio": ratio})


@dataclass
class Preset:
    name: str
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)

    def override(self, corpus: str | None = None, steps: int | None = None) -> None:
        """The command line's --corpus and --steps, in place of the preset's."""
        if corpus:
            self.data.corpus = corpus
        if steps is not None:
            if steps < 1:
                raise UserError("--steps must be >= 1")
            self.train.steps = steps


# ---- validation: a wrong type or an out-of-range value is one error line, not a crash deep in training ----
# (predicate, what the value must be); every comparison with NaN is False, so NaN fails each of them
POSITIVE = (lambda v: 0 < v < math.inf, "> 0")
NON_NEGATIVE = (lambda v: 0 <= v < math.inf, ">= 0")
FINITE = (lambda v: -math.inf < v < math.inf, "finite")
UNIT = (lambda v: 0 <= v <= 1, "in [0, 1]")


def check_fields(section: str, cfg, rules: dict) -> None:
    """Every field has its default's type (an int also serves as a float; a bool is not an int), and each field
    named in `rules` satisfies its predicate; otherwise a user error naming `section`.field."""
    for f in dataclasses.fields(cfg):
        value, want = getattr(cfg, f.name), type(f.default)
        ok = isinstance(value, want) and not (isinstance(value, bool) and want is not bool)
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise UserError(f"{section}.{f.name} must be {_TYPE_NAMES.get(want, want.__name__)}, got {value!r}")
    for name, (valid, what) in rules.items():
        if not valid(getattr(cfg, name)):
            raise UserError(f"{section}.{name} must be {what}, got {getattr(cfg, name)!r}")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def from_dict(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise UserError(f"{where}: expected a table of {cls.__name__} keys, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} for {cls.__name__}")
    try:
        return cls(**values)
    except UserError as e:  # a value out of range: say which file (or table) it came from
        raise UserError(f"{where}: {e}") from None


def presets_dir() -> Path:
    """The packaged presets: hrm_edge/train/presets/NAME.toml."""
    return Path(__file__).resolve().parent / "train" / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.toml"))


def load_preset(name_or_path: str) -> Preset:
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = presets_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        raise UserError(f"unknown preset {name_or_path!r}; known presets: {', '.join(preset_names())}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML: {e}") from None
    unknown = sorted(set(raw) - {"model", "data", "train", "quant"})
    if unknown:
        raise UserError(f"{path}: unknown table(s) {', '.join(unknown)}")
    return Preset(
        name=path.stem,
        model=from_dict(ModelConfig, raw.get("model", {}), f"{path} [model]"),
        data=from_dict(DataConfig, raw.get("data", {}), f"{path} [data]"),
        train=from_dict(TrainConfig, raw.get("train", {}), f"{path} [train]"),
        quant=from_dict(QuantConfig, raw.get("quant", {}), f"{path} [quant]"),
    )
