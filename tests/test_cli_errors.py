"""Bad input: one clear line on stderr, exit code 2, never a traceback."""
import pytest

from conftest import run_module


def assert_user_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_corpus(tmp_path):
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", tmp_path / "nope",
                                 "--out", tmp_path / "o"), "corpus not found")


def test_empty_corpus(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "empty.txt").write_text("  \n")
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny", "--corpus", tmp_path / "c",
                                 "--out", tmp_path / "o"), "empty")


def test_empty_corpus_folder(tmp_path):
    (tmp_path / "c").mkdir()
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", tmp_path / "c",
                                 "--out", tmp_path / "o"), "no files")


def test_non_utf8_corpus(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--corpus", bad, "--out", tmp_path / "o"),
                      "not UTF-8", "latin1.txt")


def test_unknown_preset(tmp_path):
    assert_user_error(run_module("hrm_edge.export", "--preset", "huge", "--out", tmp_path / "o"),
                      "unknown preset 'huge'", "tiny")


def test_missing_checkpoint(tmp_path):
    assert_user_error(run_module("hrm_edge.export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "o"),
                      "checkpoint folder not found")
    (tmp_path / "half").mkdir()
    assert_user_error(run_module("hrm_edge.export", "--checkpoint", tmp_path / "half", "--out", tmp_path / "o"),
                      "missing config.json")


def test_unwritable_out(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a folder cannot be created below a file, even by root
    assert_user_error(run_module("hrm_edge.export", "--preset", "tiny", "--out", blocker / "out"), "not writable")


def test_parity_on_a_non_export_folder(tmp_path):
    assert_user_error(run_module("hrm_edge.parity", tmp_path), "no manifest.json")
    assert_user_error(run_module("hrm_edge.parity", tmp_path / "nope"), "not found")


@pytest.mark.parametrize("module", ["hrm_edge.export", "hrm_edge.train", "hrm_edge.parity"])
def test_help_explains_flags(module):
    proc = run_module(module, "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout


def test_train_needs_out():
    assert_user_error(run_module("hrm_edge.train", "--preset", "tiny"), "--out is required")
