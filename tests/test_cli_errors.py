"""Bad input: one clear line on stderr, exit code 2, never a traceback; and each command's --help."""
import argparse
import importlib
import re
import subprocess
import sys

import pytest

from conftest import REPO, parser_of, run_module
from hrm_edge.app import complete
from hrm_edge.errors import UserError
from hrm_edge.measure import bench, evaluate, peers


def assert_user_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_corpus(tmp_path):
    """Checked before the output folder is made: a bad input leaves nothing behind (export, train)."""
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", tmp_path / "nope",
                                 "--out", tmp_path / "o"), "corpus not found")
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny", "--corpus", tmp_path / "nope",
                                 "--out", tmp_path / "t"), "corpus not found")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_empty_corpus(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "empty.txt").write_text("  \n")
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny", "--corpus", tmp_path / "c",
                                 "--out", tmp_path / "o"), "empty")
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", tmp_path / "c",
                                 "--out", tmp_path / "e"), "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # found empty only when read: no folder is left


def test_resume_is_checked_before_the_corpus_is_read(tmp_path):
    """--resume of another preset's checkpoint (found after the corpus was read and tokenized, ~46 s) and a
    train_state.json cut short (a traceback) are one line at once; --halting-head into a folder, before training."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in (REPO / "hrm_edge" / "default_model").iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    proc = run_module("hrm_edge.train", "--preset", "tiny", "--out", ckpt)  # a new run would start over in it
    assert_user_error(proc, f"--out {ckpt} holds a checkpoint: pass --resume to continue it")
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny", "--out", tmp_path),
                      f"--out {tmp_path} holds other files (ckpt)")
    early = tmp_path / "stopped_early"  # a run stopped before its first checkpoint: a new run starts over in it
    early.mkdir()
    (early / "tokenizer.json").write_text("{}")
    (early / "train_speed.json").write_text("{}")
    proc = run_module("hrm_edge.train", "--preset", "tiny", "--out", early, "--corpus", tmp_path / "nope")
    assert_user_error(proc, "corpus not found")  # past the folder check
    proc = run_module("hrm_edge.train", "--preset", "tiny", "--out", ckpt, "--resume")
    assert_user_error(proc, "was trained with the preset named 'default', not 'tiny'")
    assert proc.stdout == ""
    (ckpt / "train_state.json").write_text('{"step": 12, "pres')
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny", "--out", ckpt, "--resume"),
                      "train_state.json is not readable JSON")
    (ckpt / "halting.safetensors").unlink()
    (ckpt / "halting.safetensors").mkdir()
    proc = run_module("hrm_edge.train", "--halting-head", ckpt, "--corpus", tmp_path / "nope")
    assert_user_error(proc, "halting.safetensors is a folder")
    (ckpt / "halting.safetensors").rmdir()
    assert_user_error(run_module("hrm_edge.train", "--halting-head", ckpt, "--corpus", tmp_path / "nope"),
                      "corpus not found")


def test_empty_corpus_folder(tmp_path):
    (tmp_path / "c").mkdir()
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", tmp_path / "c",
                                 "--out", tmp_path / "o"), "no files")
    assert not (tmp_path / "o").exists()


def test_non_utf8_corpus(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", bad, "--out", tmp_path / "o"),
                      "not UTF-8", "latin1.txt")
    assert not (tmp_path / "o").exists()


def test_unknown_preset(tmp_path):
    assert_user_error(run_module("hrm_edge.export", "--preset", "huge", "--out", tmp_path / "o"),
                      "unknown preset 'huge'", "tiny")
    assert not (tmp_path / "o").exists()


def test_export_numbers_and_calibration_corpus_are_checked_first(tmp_path):
    """Before the folder is made or anything is trained or exported (each of these ran on before)."""
    shipped = ("--checkpoint", REPO / "hrm_edge" / "default_model")
    (tmp_path / "latin1.py").write_bytes("caf\u00e9 = 1\n".encode("latin-1"))
    for args, needle in [((*shipped, "--calib-samples", "0"), "--calib-samples must be >= 1"),
                         ((*shipped, "--calib-samples", "-1"), "--calib-samples must be >= 1"),
                         ((*shipped, "--calib-corpus", tmp_path / "nope"), "corpus not found"),
                         ((*shipped, "--calib-corpus", tmp_path / "latin1.py"), "not UTF-8"),  # after 24 s of work
                         (("--preset", "tiny", "--steps", "0"), "--steps must be >= 1")]:
        assert_user_error(run_module("hrm_edge.export", *args, "--out", tmp_path / "o"), needle)
    assert not (tmp_path / "o").exists()


def test_thread_counts_seeds_and_output_paths_are_checked_first(tmp_path):
    """Out of range: one line before any work (a negative count was torch's traceback, 100000 threads crashed the
    tokenizer's pool); an output path that cannot be written: before the evaluation or the timing, not after."""
    (tmp_path / "a_file").write_text("x")
    shipped, tiny = REPO / "hrm_edge" / "default_model", ("--preset", "tiny")
    for module, args, needle in [
            ("hrm_edge.train", (*tiny, "--out", tmp_path / "t", "--threads", "-1"), "--threads must be in"),
            ("hrm_edge.train", (*tiny, "--out", tmp_path / "t", "--seed", "-1"), "--seed must be in 0..4294967295, not -1"),
            ("hrm_edge.train", (*tiny, "--speed-test", "--out", tmp_path / "a_file" / "o"), "not writable"),
            ("hrm_edge.study", ("--out", tmp_path / "s", "--threads", "100000"), "--threads must be in 0..256"),
            ("hrm_edge.evaluate", (shipped, "--threads", "-1"), "--threads must be in 0..256"),
            ("hrm_edge.evaluate", (shipped, "--out", tmp_path / "a_file"), "is a file, not a folder"),
            ("hrm_edge.evaluate", (shipped, "--keyboard", "--ngram", tmp_path / "a_file" / "n.npz"),
             "is a file, not a folder"),
            ("hrm_edge.demo", (tmp_path, "--host", ""), "--host is empty"),
            ("hrm_edge.bench", (tmp_path, "--seq-len", "0"), "--seq-len must be >= 1, not 0"),  # 0 meant the default
            # the table beside the results would have replaced them (".md" of "r.md" is itself)
            ("hrm_edge.bench", (tmp_path, "--json", tmp_path / "r.md"), "ends in .md"),
            ("hrm_edge.peers", (shipped, "--build-only", "--repeats", "5", "--json", tmp_path / "p.json"),
             "--repeats, --json time nothing with --build-only"),  # it exited 0 and wrote no JSON
            ("hrm_edge.peers", (shipped, "--prompt-len", "0"), "--prompt-len and --new-tokens must be >= 1"),
            ("hrm_edge.peers", (shipped, "--build-only"), "is a checkpoint folder: give --out")]:
        proc = run_module(module, *args)
        assert_user_error(proc, needle)
        assert "held-out projects" not in proc.stdout and "training speed" not in proc.stdout, (module, args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize("module, args", [
    ("hrm_edge.train", ["--preset", "tiny", "--out"]), ("hrm_edge.export", ["--out"]),
    ("hrm_edge.evaluate", ["hrm_edge/default_model", "--out"]), ("hrm_edge.study", ["--out"]),
    ("hrm_edge.peers", ["--out"]), ("hrm_edge.complete", ["--artifacts"]),
    ("hrm_edge.bench", ["export/out", "--json"])])
def test_an_empty_path_is_not_the_working_folder(module, args, tmp_path):
    """`--out "$OUT"` with OUT unset: refused, not a checkpoint or a table written into the working folder."""
    proc = run_module(module, *args, "", cwd=tmp_path)
    assert proc.returncode == 2 and f"argument {args[-1]}: an empty path" in proc.stderr, proc.stderr[-800:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module, flag", [("hrm_edge.train", "--corpus"), ("hrm_edge.export", "--corpus"),
                                          ("hrm_edge.export", "--int8"), ("hrm_edge.export", "--calib-corpus"),
                                          ("hrm_edge.export", "--cycles"),  # it ran a whole export without the dial
                                          ("hrm_edge.study", "--corpus"), ("hrm_edge.evaluate", "--corpus"),
                                          ("hrm_edge.parity", "--cpu")])
def test_an_empty_value_is_not_the_default(module, flag, tmp_path):
    """`--corpus "$CORPUS"` with CORPUS unset trained on the default corpus; `--int8 ""` exported no int8 artifact."""
    args = {"hrm_edge.evaluate": ["hrm_edge/default_model"], "hrm_edge.parity": [tmp_path]}.get(module, [])
    proc = run_module(module, *args, flag, "", "--out" if module != "hrm_edge.parity" else "--formats",
                      tmp_path / "o" if module != "hrm_edge.parity" else "onnx", cwd=tmp_path)
    assert proc.returncode == 2 and f"argument {flag}: an empty value" in proc.stderr, proc.stderr[-800:]
    assert list(tmp_path.iterdir()) == []


def test_evaluate_modes_are_one_at_a_time():
    """--depth-curve, --keyboard and --repetition are each an evaluation "instead": two of them are refused (the
    repetition run used to ignore --keyboard)."""
    proc = run_module("hrm_edge.evaluate", "hrm_edge/default_model", "--repetition", "1.1", "--keyboard")
    assert proc.returncode == 2 and "argument --keyboard: not allowed with argument --repetition" in proc.stderr


def test_depth_dial_beyond_the_models_cycles(tmp_path):
    """--cycles is checked against the preset's or the checkpoint's H_cycles before training or making --out."""
    for model in (["--preset", "tiny"], ["--checkpoint", REPO / "hrm_edge" / "default_model"]):
        assert_user_error(run_module("hrm_edge.export", *model, "--cycles", "1,5", "--out", tmp_path / "o"),
                          "--cycles: 5 is not in 1..2 (the model's outer cycles, H_cycles)")
    assert not (tmp_path / "o").exists()


def test_missing_checkpoint(tmp_path):
    assert_user_error(run_module("hrm_edge.export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "o"),
                      "checkpoint folder not found")
    (tmp_path / "half").mkdir()
    assert_user_error(run_module("hrm_edge.export", "--checkpoint", tmp_path / "half", "--out", tmp_path / "o"),
                      "missing config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half"]  # no output folder was made


def test_evaluate_checks_its_checkpoints_first(tmp_path):
    """Before minutes of held-out text or n-gram training (--keyboard trained its n-gram keyboard for 2 minutes
    and then found the checkpoint missing), in every mode."""
    for mode in ([], ["--keyboard"], ["--depth-curve"], ["--repetition", "1,1.2"]):
        proc = run_module("hrm_edge.evaluate", tmp_path / "nope", *mode, "--out", tmp_path / "o")
        assert_user_error(proc, f"checkpoint folder not found: {tmp_path / 'nope'}")
        assert proc.stdout == "", (mode, proc.stdout[-500:])  # nothing ran before the check
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    assert_user_error(run_module("hrm_edge.evaluate", REPO / "hrm_edge" / "default_model", tmp_path / "half",
                                 "--keyboard"), "half is missing model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half"]


def test_a_refused_evaluation_leaves_no_folder(tmp_path, monkeypatch):
    """A refusal found only when an input is read (a damaged checkpoint, an --ngram file that is not one, both after
    the held-out text is read) left the new --out behind, empty; a folder that was there stays."""
    def refused(*args):
        raise UserError("the held-out text: refused")

    monkeypatch.setattr(evaluate, "heldout_texts", refused)
    for out in (tmp_path / "new", tmp_path):
        with pytest.raises(UserError, match="refused"):
            evaluate.main([str(REPO / "hrm_edge" / "default_model"), "--out", str(out)])
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []


def test_unwritable_out(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a folder cannot be created below a file, even by root
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--out", blocker / "out"), "not writable")


def test_pte_programs_are_checked_before_anything_runs(tmp_path):
    out = tmp_path / "o"
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--out", out, "--pte-programs", "kv,full"),
                      "--pte-programs: unknown full, kv", "full_sequence, kv_cache, speculative")
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--out", out, "--pte-programs", ","),
                      "--pte-programs: unknown (none given)")
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--out", out, "--int8", "pt2e",
                                 "--pte-programs", "kv_cache"), "--int8 pt2e makes a full_sequence .pte program")
    assert not out.exists()  # refused before training


def test_repetition_penalties_out_of_range():
    assert_user_error(run_module("hrm_edge.evaluate", "hrm_edge/default_model", "--repetition", "1,0.5"),
                      "--repetition takes penalties in [1, 10]")
    assert_user_error(run_module("hrm_edge.complete", "--repetition-penalty", "0.9", "def "),
                      "--repetition-penalty must be in [1, 10]")


def test_keyboard_graph_and_page_form_need_a_kv_graph(tmp_path):
    """Refused before the n-gram keyboard trains (minutes): a graph that is not a KV graph's, the page's form of
    anything but an ONNX KV graph."""
    evaluate = ("hrm_edge.evaluate", "hrm_edge/default_model", "--keyboard")
    assert_user_error(run_module(*evaluate, "--keyboard-page-form"),
                      "--keyboard-page-form needs --keyboard-graph with an ONNX KV graph")
    for name in ("hrm.fp32.onnx", "manifest.json"):  # a full-sequence graph, another file of the export
        (tmp_path / name).write_bytes(b"x")
        proc = run_module(*evaluate, "--keyboard-graph", tmp_path / name)
        assert_user_error(proc, "--keyboard-graph takes one checkpoint and an existing KV graph",
                          "(*.kv.onnx or *.kv.ort)")
        assert proc.stdout == "", proc.stdout[-500:]
    (tmp_path / "m.kv.ort").write_bytes(b"x")
    assert_user_error(run_module(*evaluate, "--keyboard-page-form", "--keyboard-graph", tmp_path / "m.kv.ort"),
                      "needs --keyboard-graph with an ONNX KV graph (*.kv.onnx)")


def test_a_flag_of_a_mode_that_is_off_is_refused(tmp_path):
    """Flags that only shape another flag's mode were ignored without a word: `complete --draft-len 8` decoded
    without speculation, `evaluate --keyboard-chars` ran the bits-per-byte table, `demo --keyboard-interval` served;
    `train --halting-head` took no --steps, `corpus --pin` (a download) no --out. Nothing is made or fetched."""
    for module, args, needle in [
            ("hrm_edge.complete", ("--draft-len", "8", "def "), "--draft-len only applies with --speculative"),
            ("hrm_edge.complete", ("--lookup-len", "0", "--draft-len", "2", "def "),
             "--draft-len, --lookup-len only apply with --speculative: add --speculative, or leave them out"),
            ("hrm_edge.complete", ("--top-k", "5", "--seed", "7", "def "),  # greedy (the default --temperature 0)
             "--top-k, --seed apply only when sampling: add --temperature T > 0, or leave them out"),
            ("hrm_edge.complete", ("--adaptive", "--exit-threshold", "0.5", "def "),  # 0.5 ran, --adaptive unsaid
             "--adaptive is --exit-threshold 0.8: give one of the two"),
            ("hrm_edge.evaluate", ("hrm_edge/default_model", "--keyboard-chars", "100", "--ngram", tmp_path / "n"),
             "--keyboard-chars, --ngram only apply with --keyboard"),
            ("hrm_edge.evaluate", ("hrm_edge/default_model", "--depth-curve", "--keyboard-sample", "start"),
             "--keyboard-sample only applies with --keyboard"),
            ("hrm_edge.study", ("--out", tmp_path / "s", "--train-only", "--decode-ablations"),
             "--decode-ablations and --decode-threads shape the decode measurement"),
            ("hrm_edge.demo", (tmp_path, "--keyboard-interval", "200"), "--keyboard-interval only applies with "
                                                                        "--keyboard-bench"),
            ("hrm_edge.train", ("--halting-head", "hrm_edge/default_model", "--steps", "3", "--out", tmp_path / "t"),
             "--out, --steps do not apply with --halting-head: leave them out"),
            ("hrm_edge.train", ("--preset", "tiny", "--speed-test", "--resume"),
             "--resume does not apply with --speed-test"),
            ("hrm_edge.train", ("--preset", "tiny", "--speed-test", "--corpus", tmp_path / "no-such-corpus"),
             "--corpus does not apply with --speed-test"),
            ("hrm_edge.evaluate", ("hrm_edge/default_model", "--keyboard", "--samples", "3", "--seq-len", "7"),
             "--seq-len, --samples do not apply with --keyboard: leave them out"),
            ("hrm_edge.evaluate", ("hrm_edge/default_model", "--repetition", "1", "--max-bytes", "0"),
             "--max-bytes does not apply with --repetition"),
            ("hrm_edge.evaluate", ("hrm_edge/default_model", "--depth-curve", "--samples", "2"),
             "--samples does not apply with --depth-curve"),
            ("hrm_edge.evaluate", ("hrm_edge/default_model", "hrm_edge/default_model", "--depth-curve"),
             "--depth-curve measures one checkpoint"),  # it measured the first and said nothing of the second
            ("hrm_edge.corpus", ("--pin", "a==1", "--out", tmp_path / "c", "--cache", tmp_path / "cache"),
             "--out does not apply with --pin: leave it out")]:
        proc = run_module(module, *args)
        assert_user_error(proc, needle)
        assert proc.stdout == "", (module, proc.stdout[-500:])
    assert list(tmp_path.iterdir()) == []


def test_export_flags_that_would_do_nothing(tmp_path):
    """`--formats onnx --int8 dynamic` exported no int8 artifact, `--pte-programs` without pte and `--steps` with a
    checkpoint were ignored: refused before the folder is made."""
    for args, needle in [(("--formats", "onnx", "--int8", "static,dynamic,8da4w"),
                          "--int8 dynamic,8da4w makes pte artifacts, which --formats leaves out"),
                         (("--formats", "pte", "--int8", "nbits"), "--int8 nbits makes onnx artifacts"),
                         (("--formats", "onnx", "--pte-programs", "kv_cache"), "--pte-programs chooses .pte programs"),
                         (("--steps", "5",), "--steps sets the training of a --preset"),
                         (("--checkpoint", REPO / "hrm_edge" / "default_model", "--steps", "5"), "--steps sets")]:
        assert_user_error(run_module("hrm_edge.export", *args, "--out", tmp_path / "o"), needle)
    assert list(tmp_path.iterdir()) == []


def test_parity_on_a_non_export_folder(tmp_path):
    assert_user_error(run_module("hrm_edge.parity", tmp_path), "no manifest.json")
    assert_user_error(run_module("hrm_edge.parity", tmp_path / "nope"), "not found")


# every command README names: its entry's main, and the flags its --help must show (internal flags that a parent
# process passes to its child are hidden: help=SUPPRESS)
COMMANDS = {
    "corpus": ("hrm_edge.train.corpus", "--cache --out --recipe --project-cap --no-stdlib-reference --pin --jobs "
               "--no-progress"),
    "train": ("hrm_edge.train.loop", "--preset --out --corpus --steps --seed --resume --threads --no-progress "
              "--speed-test --halting-head"),
    "export": ("hrm_edge.export.pipeline", "--preset --checkpoint --out --corpus --steps --parity-samples --formats "
               "--int8 --calib-samples --calib-corpus --cycles --pte-programs --no-progress --verbose"),
    "parity": ("hrm_edge.verify.parity", "--bundle-only --formats --target --cpu"),
    "arm64": ("hrm_edge.verify.arm64_toolchain", "--no-pte"),
    "complete": ("hrm_edge.app.complete", "--artifacts --runtime --precision --max-new-tokens --temperature --top-k "
                 "--top-p --seed --repetition-penalty --no-heal --threads --truncate --no-verify --speculative --draft-len --lookup-len "
                 "--exit-threshold --adaptive --verbose"),
    "demo": ("hrm_edge.app.demo", "--host --port --no-verify --quiet --verbose --keyboard-bench --keyboard-chars "
                                   "--keyboard-sample --keyboard-text --keyboard-model --keyboard-threads "
                                   "--keyboard-full-depth --keyboard-interval --keyboard-cpu-slowdown "
                                   "--keyboard-profile"),
    "bench": ("hrm_edge.measure.bench", "--threads --seq-len --repeats --prompt-len --new-tokens --no-baseline --peers "
              "--rounds --lookup-len --no-weight-cache --json --no-verify --verbose"),
    "peers": ("hrm_edge.measure.peers", "--out --shape --build-only --threads --prompt-len --new-tokens --repeats "
              "--no-weight-cache --json --verbose"),
    "evaluate": ("hrm_edge.measure.evaluate", "--corpus --max-bytes --seq-len --samples --threads --out --depth-curve "
                 "--keyboard --keyboard-chars --keyboard-sample --keyboard-split --ngram --ngram-cache-weight "
                 "--ngram-follow-weight --keyboard-graph --keyboard-page-form --repetition"),
    "study": ("hrm_edge.measure.study", "--budget --out --only --resume --corpus --threads --decode-threads "
              "--decode-ablations --train-only --no-progress --verbose"),
    "sysdeps": ("hrm_edge.verify.sysdeps", "--check"),
}


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)  # argparse wraps help to the terminal's width (and at hyphens)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_explains_flags(command):
    """`python -m hrm_edge.X --help` exits 0 and shows each of the parser's flags and positionals with its own
    non-empty help text; the flags are the expected ones (a flag lost or added without help fails here)."""
    module, flags = COMMANDS[command]
    parser = parser_of(importlib.import_module(module).main)
    proc = run_module(f"hrm_edge.{command}", "--help")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python -m hrm_edge.{command}"), proc.stdout[:200]
    shown = squeezed(proc.stdout)
    visible = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    assert sorted(o for a in visible for o in a.option_strings) == sorted(flags.split())
    for action in visible:
        assert action.help and action.help.strip(), (command, action.option_strings or action.dest)
        explained = squeezed(action.help.split("%(")[0])  # up to any %(default)s, which argparse fills in
        assert len(explained) >= 4 and explained in shown, (command, action.option_strings, action.help)
        for name in action.option_strings or [action.metavar or action.dest]:
            assert re.search(rf"(^|[\s,\[]){re.escape(name)}(?![\w-])", proc.stdout), (command, name)
    hidden = [o for a in parser._actions if a.help == argparse.SUPPRESS for o in a.option_strings]
    assert not [o for o in hidden if re.search(rf"{re.escape(o)}(?![\w-])", proc.stdout)], hidden


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_argparse_refusals_are_one_line(command):
    """argparse's own refusals (an unknown flag, or a missing argument) are one `error:` line naming --help, not its
    usage block."""
    proc = run_module(f"hrm_edge.{command}", "--no-such-flag")
    assert_user_error(proc, f"see python -m hrm_edge.{command} --help")
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout, proc.stderr


def test_train_needs_out():
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny"), "--out is required")


def test_a_closed_pipe_ends_quietly():
    """`python -m hrm_edge.X ... | head`: when the reader goes away the command stops with exit code 141 (a shell
    tool's SIGPIPE status) and no traceback."""
    code = ("import sys\nfrom hrm_edge.errors import run_cli\n"
            "def main(argv):\n    while True:\n        print('x' * 1000)\n"
            "run_cli(main)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.read(10)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141
    assert b"Traceback" not in proc.stderr.read()


def test_a_value_out_of_range_is_named_with_its_flag():
    """Each flag out of its range is refused on its own line with the value given (until 2026-12-05 one line listed
    every flag's range, `--max-bytes must be >= 1, --seq-len >= 2, --samples >= 0` for a bad --seq-len)."""
    for main, argv, line in [
            (evaluate.main, ["hrm_edge/default_model", "--seq-len", "1"], "--seq-len must be >= 2, not 1"),
            (complete.main, ["--seed", "-1", "def f("], "--seed must be >= 0, not -1"),
            (complete.main, ["--top-p", "1.5", "def f("], "--top-p must be in (0, 1], not 1.5"),
            (complete.main, ["--temperature", "nan", "def f("],
             "--temperature must be 0 (greedy) or in [1e-4, 1e4], not nan"),
            (complete.main, ["--speculative", "--lookup-len", "65", "def f("], "--lookup-len must be in 0..64, not 65"),
            (bench.main, ["hrm_edge/default_model", "--rounds", "0"], "--rounds must be >= 1, not 0"),
            (peers.main, ["--out", "x", "--repeats", "0"], "--repeats must be >= 1, not 0")]:
        with pytest.raises(UserError, match="^" + re.escape(line) + "$"):
            main(argv)


def test_a_full_disk_is_one_error_line():
    """stdout redirected to a full file system (/dev/full) was an OSError traceback; now one line and exit code 1
    (the same for any write that finds the disk full)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "hrm_edge.sysdeps", "--check"], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and proc.stderr == "error: No space left on device (writing the output)\n", proc.stderr
