"""Property-based search for bad input (issue 10, item 4), with hypothesis: the CLIs' arguments, prompts (empty,
huge, control characters, lone surrogates, bytes that are not UTF-8 on stdin, every Unicode plane), manifests
and configs. The properties: never a traceback, exit code 0 or 2 only (2 with one `error:` line), and the
tokenizer/decoder path never raises on model output (any token ids).

The CLIs run in this process (their main() under errors.run_cli, as `python -m` runs them), so an example costs
milliseconds, not an interpreter start; a few real subprocess calls check what only a process shows (argv and
stdin bytes). Every test is bounded (max_examples, derandomized so CI sees the same examples each run); the
whole file runs in about 30 s on this project's 2-core machine."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import REPO, parser_of, run_module
from hrm_edge.measure import bench
from hrm_edge.app import complete
from hrm_edge.app import demo
from hrm_edge.export import pipeline as export
from hrm_edge.verify import parity
from hrm_edge.train import loop as train
from hrm_edge.config import DataConfig, ModelConfig, QuantConfig, TrainConfig, from_dict
from hrm_edge.errors import UserError, run_cli
from hrm_edge.runtime.healing import token_bytes
from hrm_edge.runtime.manifest import read_manifest, verify_files
from hrm_edge.train.tokenizer import load_tokenizer
from test_reliability import SHIPPED_TOKENIZER, assert_user_error, edit_manifest, flip_byte, mini_export

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def run_in_process(main, argv, stdin: bytes = b""):
    """main(argv) as `python -m` runs it: (exit code, stdout, stderr). Any exception other than the exit escapes
    and fails the test: that is the traceback the property forbids."""
    # stdout and stderr encode as a real process's do (UTF-8, strict): a lone surrogate written there raises
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True) for _ in range(2))
    threads, real_stdin = torch.get_num_threads(), sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli(main, argv)
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    finally:
        sys.stdin = real_stdin
        torch.set_num_threads(threads)  # --threads must not leak into the other tests
    return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


def assert_outcome(code, stdout, stderr, expected: int, needle: str = ""):
    """Exit code `expected`; a refusal (2) is one `error:` line holding `needle`, a success writes the stats line."""
    assert code == expected, (code, expected, stderr[-2000:])
    assert "Traceback" not in stderr
    if expected == 2:
        lines = [line for line in stderr.splitlines() if line.startswith("error:") or ": error: " in line]
        assert len(lines) == 1 and needle in lines[0], (needle, stderr[-2000:])
    else:
        assert "decode" in stdout.splitlines()[-1], stdout[-2000:]


def assert_exit_0_or_2(code, stderr):
    assert code in (0, 2), (code, stderr[-2000:])
    assert "Traceback" not in stderr
    if code == 2:
        ours = [line for line in stderr.splitlines() if line.startswith("error:")]
        argparse_error = ": error: " in stderr and "usage:" in stderr  # argparse's own usage + one error line
        assert len(ours) == 1 or (not ours and argparse_error), stderr


# ---- folders the CLIs are pointed at ----
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A good export (eager-runnable), and folders every reader must refuse: missing, a file, empty, not JSON,
    a `..` path, a link leaving the folder, a flipped byte."""
    root = tmp_path_factory.mktemp("fuzz")
    good = mini_export(root / "good")
    (root / "file.txt").write_text("not a folder")
    (root / "empty").mkdir()
    bad = {"missing": root / "nope", "file": root / "file.txt", "empty": root / "empty"}
    for name in ("notjson", "dotdot", "link", "flipped"):
        shutil.copytree(good, root / name)
        bad[name] = root / name
    (bad["notjson"] / "manifest.json").write_text("[1, 2")
    edit_manifest(bad["dotdot"], lambda m: m["artifacts"][0].update(path="../../etc/passwd"))
    (root / "outside.onnx").write_bytes(b"x")
    (bad["link"] / "hrm.fp32.kv.onnx").unlink()
    (bad["link"] / "hrm.fp32.kv.onnx").symlink_to(root / "outside.onnx")
    flip_byte(bad["flipped"] / "model.safetensors")
    return {"good": good, "bad": bad, "unwritable": root / "file.txt" / "out"}


# ---- argument strategies ----
# argv strings cannot hold NUL; they can hold lone surrogates (bytes that were not UTF-8, surrogate-escaped)
ARG_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=()), max_size=12)
NUMBER = st.one_of(st.integers(-10**6, 10**6), st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1])).map(str)
REAL = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["nan", "inf", "1e-320"]))
VALUE = st.one_of(NUMBER, REAL, ARG_TEXT)
# values at and around the edges of what is valid, where the bugs live
EDGE_INT = st.one_of(st.sampled_from([-2**63, -1, 0, 1, 2, 255, 256, 257, 2**31, 2**64]), st.integers(-3, 300)).map(str)
EDGE_REAL = st.one_of(st.sampled_from(["0", "-0.0", "5e-324", "1e-310", "1e-5", "1e-4", "0.5", "1", "1.0000001", "1e4",
                                       "1e5", "nan", "inf", "-inf", "-1"]), st.floats().map(repr))


def argv_of(options: dict, switches: list, positional=None, max_flags: int = 5, junk: bool = True):
    """Lists of flags with values from `options` ({flag: strategy}, plus any VALUE if `junk`), bare `switches`,
    and a positional."""
    pair = st.sampled_from(sorted(options)).flatmap(
        lambda flag: st.tuples(st.just(flag), options[flag] | VALUE if junk else options[flag]))
    parts = st.lists(st.one_of(pair.map(list), st.sampled_from(switches).map(lambda s: [s])), max_size=max_flags)
    flat = parts.map(lambda ps: [x for p in ps for x in p])
    if positional is None:
        return flat
    return st.tuples(flat, positional).map(lambda t: t[0] + t[1])


def dirs(folders, names):
    return st.sampled_from(names).map(lambda n: str(folders["bad"][n]))


SAFE_BAD = ["missing", "file", "empty", "notjson", "dotdot", "link"]  # refused before any work starts


@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_complete_arguments(folders, data):
    """Two kinds of example: a command that generates with one or two flags set to edge values (later flags
    win), which reaches the model; and any flags with any values, which tests the parsing."""
    folder = st.sampled_from([str(folders["good"])]) | dirs(folders, SAFE_BAD + ["flipped"])
    options = {"--artifacts": folder, "--runtime": st.sampled_from(complete.RUNTIMES),
               "--precision": st.sampled_from(["fp32", "int8"]), "--max-new-tokens": EDGE_INT,
               "--temperature": EDGE_REAL, "--top-k": EDGE_INT, "--top-p": EDGE_REAL, "--seed": EDGE_INT,
               "--threads": EDGE_INT, "--repetition-penalty": EDGE_REAL}
    if data.draw(st.booleans()):
        base = ["--artifacts", str(folders["good"]), "--runtime", "eager", "--max-new-tokens", "3", "def f("]
        argv = base + data.draw(argv_of(options, ["--truncate", "--no-verify", "--no-heal"], max_flags=2, junk=False))
        code, out, err = run_in_process(complete.main, argv)
        assert_outcome(code, out, err, *complete_outcome(argv, folders))
    else:  # any flags, any values: the property is the one-line refusal, whichever exit code
        argv = data.draw(argv_of(options, ["--truncate", "--no-verify", "--no-heal"], st.lists(ARG_TEXT, max_size=1),
                                 max_flags=3))
        code, _, err = run_in_process(complete.main, argv, stdin=b"def f(")
        assert_exit_0_or_2(code, err)


COMPLETE_PARSER = parser_of(complete.main)


def complete_outcome(argv: list, folders) -> tuple[int, str]:
    """What `complete` must do with argv (exit code, a word of its error line), worked out apart from it:
    argparse's verdict, then the ranges its --help states, then which folder and program it may run (the good
    export runs eagerly in fp32 only; the flipped one only unverified)."""
    try:
        a = COMPLETE_PARSER.parse_args(argv)
    except SystemExit:
        return 2, "error: argument"
    for flag, ok in (("--max-new-tokens", a.max_new_tokens >= 1), ("--threads", 0 <= a.threads <= complete.MAX_THREADS),
                     ("--seed", a.seed >= 0), ("--temperature", a.temperature == 0 or 1e-4 <= a.temperature <= 1e4),
                     ("--top-p", 0 < a.top_p <= 1), ("--top-k", a.top_k >= 0)):
        if not ok:  # the first flag out of its range, named with its value
            return 2, f"{flag} must be"
    if not 1 <= a.repetition_penalty <= 10:
        return 2, "--repetition-penalty must be"
    if a.temperature == 0 and (a.top_k, a.top_p, a.seed) != (0, 1.0, 0):
        return 2, "only when sampling"
    runnable = a.artifacts == folders["good"] or (a.artifacts == folders["bad"]["flipped"] and a.no_verify)
    return (0, "") if runnable and a.runtime == "eager" and a.precision == "fp32" else (2, "")


EDGES = {"int": ["-9223372036854775808", "-1", "0", "1", "2", "255", "256", "257", "4294967296", "x", ""],
         "real": ["0", "-0.0", "5e-324", "1e-310", "1e-5", "1e-4", "0.5", "1", "1.0000001", "1e4", "1e5", "nan", "inf",
                  "-inf", "-1", "x", ""]}


def test_complete_flag_edges_one_at_a_time(folders):
    """Systematic, beside the random search: each numeric flag at each edge value, on a command that generates (and
    samples, so that --top-k, --top-p and --seed apply; a --temperature given after it wins)."""
    base = ["--artifacts", str(folders["good"]), "--runtime", "eager", "--max-new-tokens", "2", "--temperature", "0.5",
            "def f("]
    flags = {"--max-new-tokens": "int", "--top-k": "int", "--seed": "int", "--threads": "int", "--temperature": "real",
             "--top-p": "real", "--repetition-penalty": "real"}
    # the values each flag accepts (its --help's range); every other edge value is refused in one line
    valid = {"--max-new-tokens": {"1", "2", "255", "256", "257", "4294967296"},
             "--top-k": {"0", "1", "2", "255", "256", "257", "4294967296"},
             "--seed": {"0", "1", "2", "255", "256", "257", "4294967296"},
             "--threads": {"0", "1", "2", "255", "256"},
             "--temperature": {"0", "-0.0", "1e-4", "0.5", "1", "1.0000001", "1e4"},
             "--top-p": {"5e-324", "1e-310", "1e-5", "1e-4", "0.5", "1"},
             "--repetition-penalty": {"1", "1.0000001"}}
    for flag, kind in flags.items():
        for value in EDGES[kind]:
            code, out, err = run_in_process(complete.main, base + [flag, value])
            needle = "" if value in valid[flag] else ("argument " + flag) if value in ("x", "") else flag
            assert_outcome(code, out, err, 0 if value in valid[flag] else 2, needle)


@FUZZ
@given(data=st.data())
def test_export_and_train_arguments(folders, data):
    """--out is always a path below a file (unwritable): whatever the other arguments, nothing is trained or
    exported; each argument is checked (or ignored) on the way to that one-line error."""
    paths = st.sampled_from([str(folders["good"]), str(folders["bad"]["missing"]), str(folders["bad"]["file"])])
    common = {"--preset": st.sampled_from(["tiny", "default", "huge", "../../etc/passwd", "x.toml"]),
              "--corpus": paths, "--steps": NUMBER}
    main, options, switches = data.draw(st.sampled_from([
        (export.main, common | {"--checkpoint": paths, "--parity-samples": NUMBER, "--calib-samples": NUMBER,
                                "--formats": st.sampled_from(["onnx", "pte", "onnx,pte", ",", "ort"]),
                                "--int8": st.sampled_from(["none", "static", "dynamic,pt2e", "int4", ""]),
                                "--cycles": st.sampled_from(["1", "0", "1,2", "x", "-1"]), "--calib-corpus": paths,
                                "--pte-programs": st.sampled_from(["kv_cache", "full_sequence,speculative", ",",
                                                                   "kv"])},
         ["--no-progress"]),
        (train.main, common | {"--seed": NUMBER, "--threads": NUMBER}, ["--no-progress", "--resume"])]))
    argv = data.draw(argv_of(options, switches)) + ["--out", str(folders["unwritable"])]
    code, _, err = run_in_process(main, argv)
    assert_exit_0_or_2(code, err)
    assert code == 2 or "--help" in argv or "-h" in argv  # 0 only for the help text: nothing can be written


@FUZZ
@given(data=st.data())
def test_parity_bench_demo_arguments(folders, data):
    """Pointed at folders they must refuse (bench also at one with a flipped byte: it has no --no-verify here,
    so it never starts its benchmark processes)."""
    main, options, switches, names = data.draw(st.sampled_from([
        (parity.main, {"--formats": st.sampled_from(["onnx", "pte", "onnx,pte", "x"]),
                       "--target": st.sampled_from(["host", "aarch64", "riscv"]), "--cpu": ARG_TEXT},
         ["--bundle-only"], SAFE_BAD),
        (bench.main, {"--threads": NUMBER, "--seq-len": NUMBER, "--repeats": NUMBER, "--prompt-len": NUMBER,
                      "--new-tokens": NUMBER, "--json": ARG_TEXT}, ["--no-baseline"], SAFE_BAD + ["flipped"]),
        (demo.main, {"--host": st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "no.such.host"]), "--port": NUMBER},
         ["--no-verify", "--quiet"], SAFE_BAD)]))
    argv = data.draw(argv_of(options, switches, dirs(folders, names).map(lambda d: [d])))
    code, _, err = run_in_process(main, argv)
    assert_exit_0_or_2(code, err)
    assert code == 2 or "--help" in argv or "-h" in argv


# ---- prompts ----
PLANES = st.integers(0, 16).flatmap(lambda plane: st.integers(plane << 16, (plane << 16) | 0xFFFF))  # every plane
CODEPOINT = st.one_of(PLANES, st.integers(0xD800, 0xDFFF), st.integers(0, 0x7F))  # + surrogates, ASCII controls
PROMPT = st.one_of(st.lists(CODEPOINT, max_size=30).map(lambda cs: "".join(map(chr, cs))),  # surrogates included
                   st.text(max_size=30),
                   st.text(st.characters(whitelist_categories=["Cc", "Cf", "Zl", "Zp"]), max_size=30))


@FUZZ
@given(prompt=PROMPT, via_stdin=st.booleans())
@example(prompt="", via_stdin=False)
@example(prompt="\udc80abc", via_stdin=True)
@example(prompt="\udc80abc", via_stdin=False)
@example(prompt="a" * 200_000, via_stdin=True)
@example(prompt="\x00\x1b[2J\r\n\t", via_stdin=False)
def test_complete_prompts(folders, tokenizer, prompt, via_stdin):
    argv = ["--artifacts", str(folders["good"]), "--runtime", "eager", "--max-new-tokens", "3"]
    stdin = prompt.encode("utf-8", "surrogatepass")  # a lone surrogate becomes bytes that are not UTF-8
    code, out, err = run_in_process(complete.main, argv + ([] if via_stdin else [prompt]), stdin if via_stdin else b"")
    assert_outcome(code, out, err, *prompt_outcome(prompt, via_stdin, tokenizer, folders["good"]))
    if code == 0:
        assert out.startswith(prompt)


def prompt_outcome(prompt: str, via_stdin: bool, tokenizer, export_dir) -> tuple[int, str]:
    """(exit code, a word of the error line): a prompt that is not Unicode text, is empty or fills the context
    (one token must fit after it) is refused; every other prompt completes."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in prompt):
        return 2, "not UTF-8" if via_stdin else "not valid UTF-8"
    if not prompt:
        return 2, "empty prompt"
    context = json.loads((export_dir / "manifest.json").read_text())["model"]["max_seq_len"]
    return (2, "context") if len(tokenizer.encode(prompt, add_special_tokens=False).ids) >= context else (0, "")


def test_a_prompt_with_every_unicode_plane_completes(folders):
    prompt = "".join(chr((plane << 16) | 0x41) for plane in range(17)) + "é中😀\x07"
    code, out, err = run_in_process(complete.main, ["--artifacts", str(folders["good"]), "--runtime", "eager",
                                                    "--max-new-tokens", "4", prompt])
    assert code == 0, err
    assert out.startswith(prompt)


def test_undecodable_bytes_through_a_real_process(folders):
    """What only a real process shows: bytes on stdin that are not UTF-8, and argv bytes that are not (Python
    surrogate-escapes them), each one error line; control characters and astral characters complete."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    base = [sys.executable, "-m", "hrm_edge.complete", "--artifacts", str(folders["good"]), "--runtime", "eager",
            "--max-new-tokens", "3"]
    for stdin in (b"def \xff\xfe", b"\xed\xa0\x80"):  # invalid bytes; an encoded lone surrogate
        proc = subprocess.run(base, input=stdin, capture_output=True, cwd=REPO, env=env, timeout=120)
        assert_user_error(decoded(proc), "prompt on stdin is not UTF-8")
    proc = subprocess.run([os.fsencode(a) for a in base] + [b"caf\xe9"], capture_output=True, cwd=REPO, env=env,
                          timeout=120)
    assert_user_error(decoded(proc), "not valid UTF-8")
    proc = run_module("hrm_edge.complete", *base[3:], "tab\there \x1b[31m 𝔘𝔫𝔦 \U0010fffd")
    assert proc.returncode == 0 and proc.stdout.startswith("tab\there \x1b[31m 𝔘𝔫𝔦 \U0010fffd"), proc.stderr


def decoded(proc):
    proc.stdout, proc.stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    return proc


# ---- the tokenizer / decoder path on model output ----
@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def vocab_bytes(tokenizer):
    return token_bytes(tokenizer)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_text_is_the_decoded_text(tokenizer, vocab_bytes, data):
    """Any token ids a model can emit (byte tokens that split a character, EOS, specials): streaming never raises,
    writes each piece once, and writes exactly what decoding all the ids at once gives."""
    ids = data.draw(st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=40))
    pieces = []
    stream = complete.TextStream(vocab_bytes, pieces.append)
    for token in ids:
        stream.add(token)
    stream.finish()
    assert "".join(pieces) == tokenizer.decode(ids)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(CODEPOINT.filter(lambda c: not 0xD800 <= c < 0xE000), max_size=40).map(
    lambda cs: "".join(map(chr, cs))))
def test_every_valid_string_encodes_and_decodes_back(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text  # byte level: lossless


# ---- manifests and configs ----
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


@FUZZ
@given(where=st.sampled_from(["", "artifacts.0", "tokenizer", "parity_bundle", "checkpoint", "model"]),
       key=st.sampled_from(["path", "sha256", "bytes", "format", "artifacts", "tokenizer", "checkpoint", "weights",
                            "config", "web_bundle", "model", "format_version", "program", "converted_from"]),
       value=JSON)
def test_an_edited_manifest_is_read_or_refused_in_one_line(folders, tmp_path_factory, where, key, value):
    root = tmp_path_factory.mktemp("manifest")
    for name in ("manifest.json", "tokenizer.json", "config.json", "model.safetensors", "parity_bundle.npz",
                 "hrm.fp32.kv.onnx"):
        shutil.copyfile(folders["good"] / name, root / name)
    manifest = json.loads((root / "manifest.json").read_text())
    node = manifest
    for step in filter(None, where.split(".")):
        node = node[int(step)] if step.isdigit() else node[step]
    node[key] = value
    (root / "manifest.json").write_text(json.dumps(manifest))
    try:
        verify_files(root, read_manifest(root))
    except UserError as e:
        assert "\n" not in str(e)


FIELDS = {cls: [f for f in cls.__dataclass_fields__] for cls in (ModelConfig, TrainConfig, DataConfig, QuantConfig)}


@FUZZ
@given(cls=st.sampled_from(sorted(FIELDS, key=lambda c: c.__name__)), data=st.data())
def test_a_config_is_valid_or_refused_in_one_line(cls, data):
    values = data.draw(st.dictionaries(st.sampled_from(FIELDS[cls] + ["colour"]),
                                       st.one_of(JSON, st.integers(-3, 3), st.floats(-2, 2), st.just(float("nan"))),
                                       max_size=4))
    try:
        cfg = from_dict(cls, values, "fuzz")
    except UserError as e:
        assert "\n" not in str(e) and str(e).startswith("fuzz: ")
        return
    if cls is ModelConfig:  # what the model relies on
        assert cfg.n_heads > 0 and cfg.d_model % cfg.n_heads == 0 and cfg.head_dim % 2 == 0 and cfg.n_steps >= 1
    if cls is TrainConfig:
        assert cfg.steps >= 1 and cfg.seq_len >= 1 and cfg.batch_size >= 1 and cfg.seed >= 0
