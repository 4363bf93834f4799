"""python -m hrm_edge.study: the quick budget end to end, resume, and its user errors.

The quick budget trains thirteen tiny models for 40 steps, so only robust things are asserted: every model
learned something, the sizes are what the study claims, the files and the table are there, and the
int8 programs decode; the goals' verdicts are checked against the numbers they come from. Which model wins
is the full run's business (docs/measurements.md), not CI's.
"""
import copy
import json
import math

import pytest

import hrm_edge.measure.study as study_module
from conftest import run_module
from hrm_edge.measure.study import (BUDGETS, GOAL_BPB_RATIO, GOAL_DECODE_RATIO, GOAL_PARAM_RATIO, _jsonable,
                                    first_difference, goals, study_entries)
from test_cli_errors import assert_user_error


@pytest.mark.slow
def test_quick_study_end_to_end_and_resume(tmp_path):
    out = tmp_path / "study"
    # one thread: on a 2-core machine shared with other work, two OpenMP threads per tiny op are far slower
    proc = run_module("hrm_edge.study", "--budget", "quick", "--out", out, "--threads", "1", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    table = (out / "study.md").read_text()
    names = [e.name for e in study_entries(BUDGETS["quick"])]
    models = {m["name"]: m for m in study["models"]}
    assert list(models) == names
    for name in names:
        assert f"| {name} |" in table and f"| {name} |" in proc.stdout
    assert study["command"].startswith("python -m hrm_edge.study --budget quick")

    for m in models.values():  # every model learned: well below its own untrained value
        assert math.isfinite(m["val_bits_per_byte"]), m["name"]
        assert m["val_bits_per_byte"] < m["untrained_bits_per_byte"] - 0.2, (m["name"], m["history"])
        assert m["val_bits_per_byte"] == m["history"][-1]["val_bits_per_byte"]
    assert len({m["tokenizer_sha256"] for m in models.values()}) == 1  # one tokenizer, one data stream
    assert len({m["tokens_trained"] for m in models.values()}) == 1

    ref, hrm, eq = models[study["reference"]], models[study["hrm"]], models[study["equal_compute"]]
    assert ref["model"]["arch"] == "transformer" and ref["model"]["n_layers"] == 4
    assert hrm["params_unique"] <= 0.3 * ref["params_unique"]
    assert eq["model"]["arch"] == "transformer" and eq["model"]["n_layers"] == hrm["block_applications"]
    assert eq["model"]["d_model"] == hrm["model"]["d_model"] and eq["params_unique"] > hrm["params_unique"]
    assert models["hrm-no-gating"]["params_unique"] < hrm["params_unique"]  # the gates are gone
    assert models["hrm-H1-L7"]["block_applications"] == 8 and models["hrm-H2-L1"]["block_applications"] == 4
    # the seed's training ideas: same model as hrm, another recipe
    assert models["hrm-distill"]["train_overrides"]["distill_from"] == "{out}/transformer-4L"
    assert models["hrm-curriculum"]["train_overrides"]["curriculum_steps"] == 40 // 3
    assert models["hrm-gate-dropout"]["model"]["gate_dropout"] == 0.1
    assert models["hrm-curriculum"]["params_unique"] == models["hrm-distill"]["params_unique"] == hrm["params_unique"]
    assert "bpb vs hrm" in table

    for name in (ref["name"], hrm["name"], eq["name"]):
        assert study["decode"]["models"][name]["decode_tokens_per_s"] > 0, name
        assert (out / name / models[name]["pte"]["path"]).is_file()
    # the verdicts follow from the numbers in the same JSON (recomputed here from the goals' definitions)
    quality_met = (hrm["val_bits_per_byte"] / ref["val_bits_per_byte"] <= GOAL_BPB_RATIO
                   and hrm["params_unique"] / ref["params_unique"] <= GOAL_PARAM_RATIO)
    decode = study["decode"]["models"]
    speed = decode[hrm["name"]]["decode_tokens_per_s"] / decode[eq["name"]]["decode_tokens_per_s"]
    speed_met = speed >= GOAL_DECODE_RATIO
    assert [g["met"] for g in study["goals"]] == [quality_met, speed_met], study["goals"]
    assert table.count("**met**") == quality_met + speed_met
    assert table.count("**not met**") == 2 - quality_met - speed_met
    assert study["cpu"]["cores"] >= 1 and study["cpu"]["model"] and "CPU: " in table

    # --resume keeps every finished model and program: nothing is trained or lowered again
    again = run_module("hrm_edge.study", "--budget", "quick", "--out", out, "--threads", "1", "--no-progress", "--resume")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("already trained (kept)") == len(names)
    assert again.stdout.count("int8 program already built (kept)") == 3
    resumed = {m["name"]: m for m in json.loads((out / "study.json").read_text())["models"]}
    assert all(resumed[n]["val_bits_per_byte"] == models[n]["val_bits_per_byte"] for n in names)


def test_goal_verdicts_follow_the_ratios():
    """goals() against hand-made results on both sides of each threshold (the study's verdicts can fail)."""
    ref = {"val_bits_per_byte": 2.0, "params_unique": 1000}
    good = {"val_bits_per_byte": 2.0 * GOAL_BPB_RATIO - 1e-6, "params_unique": int(1000 * GOAL_PARAM_RATIO)}
    decode = {"models": {"hrm": {"decode_tokens_per_s": 95.0}, "eq": {"decode_tokens_per_s": 100.0}}}
    met = goals({"ref": ref, "hrm": good}, "ref", "hrm", "eq", decode)
    assert [g["met"] for g in met] == [True, GOAL_DECODE_RATIO <= 0.95]
    assert "= 0.950x" in met[1]["detail"]
    worse_bpb = good | {"val_bits_per_byte": 2.0 * GOAL_BPB_RATIO + 1e-3}
    too_big = good | {"params_unique": int(1000 * GOAL_PARAM_RATIO) + 1}
    slow = {"models": decode["models"] | {"hrm": {"decode_tokens_per_s": 100.0 * GOAL_DECODE_RATIO - 1}}}
    assert goals({"ref": ref, "hrm": worse_bpb}, "ref", "hrm", "eq", decode)[0]["met"] is False
    assert goals({"ref": ref, "hrm": too_big}, "ref", "hrm", "eq", decode)[0]["met"] is False
    assert goals({"ref": ref, "hrm": good}, "ref", "hrm", "eq", slow)[1]["met"] is False
    assert [g["met"] for g in goals({"hrm": good}, "ref", "hrm", "eq", {})] == [None, None]


def test_study_refuses_an_existing_study_without_resume(tmp_path):
    out = tmp_path / "study"
    (out / "hrm").mkdir(parents=True)
    (out / "hrm" / "train_state.json").write_text("{}")
    assert_user_error(run_module("hrm_edge.study", "--out", out), "already holds a study", "--resume")


def test_study_refuses_a_folder_of_other_files(tmp_path):
    """`--out` an export folder: the study would have mixed its 13 model folders and its config into it."""
    out = tmp_path / "export"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    assert_user_error(run_module("hrm_edge.study", "--out", out), "holds other files than a study's (manifest.json)")
    assert [p.name for p in out.iterdir()] == ["manifest.json"]


def test_study_unknown_model(tmp_path):
    assert_user_error(run_module("hrm_edge.study", "--out", tmp_path / "s", "--only", "hrm,nope"),
                      "unknown model", "nope")
    assert not (tmp_path / "s").exists()  # refused before the folder is made


def test_study_resume_without_a_study(tmp_path):
    """--resume in a folder where no model has started is refused (it started a new study, as train --resume
    does not), and makes no folder."""
    assert_user_error(run_module("hrm_edge.study", "--out", tmp_path / "s", "--resume"),
                      "--resume", "holds no study to continue")
    assert not (tmp_path / "s").exists()


def test_study_resume_with_another_budget(tmp_path):
    out = tmp_path / "study"
    (out / "hrm").mkdir(parents=True)
    (out / "hrm" / "train_state.json").write_text("{}")  # a model has started
    (out / "study_config.json").write_text(json.dumps({"budget": {"name": "full"}}))
    assert_user_error(run_module("hrm_edge.study", "--out", out, "--budget", "quick", "--resume"),
                      "another setup (budget.name: 'full' there, 'quick' now)")


def test_study_names_the_setup_that_differs(tmp_path):
    """The folder's study was made on another corpus: the error says so, not "another budget"."""
    out = tmp_path / "study"
    (out / "hrm").mkdir(parents=True)
    (out / "hrm" / "train_state.json").write_text("{}")
    (out / "study_config.json").write_text(json.dumps({"budget": _jsonable(BUDGETS["quick"]) | {"data": {
        **_jsonable(BUDGETS["quick"])["data"], "corpus": "pypi"}}}))
    assert_user_error(run_module("hrm_edge.study", "--out", out, "--resume"),
                      "another setup (budget.data.corpus: 'pypi' there, '' now)")
    assert first_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == ("a.c", 2, 3)
    assert first_difference({"a": 1, "z": 0}, {"a": 1}) == ("z", 0, None)


def test_study_with_a_missing_corpus_makes_nothing(tmp_path, monkeypatch):
    """The corpus is checked before the study folder is made; a corpus found empty only when read (by the first
    model's training) removes the new folder and its study_config.json. A folder that a run stopped so left with its
    config alone (before 2026-12-06) is taken by the fixed command, its config replaced."""
    out = tmp_path / "study"
    assert_user_error(run_module("hrm_edge.study", "--out", out, "--corpus", tmp_path / "nope"), "corpus not found")
    assert not out.exists()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.py").write_text("\n")
    assert_user_error(run_module("hrm_edge.study", "--out", out, "--corpus", tmp_path / "blank"), "empty")
    assert not out.exists()
    out.mkdir()
    (out / "study_config.json").write_text(json.dumps({"budget": {"data": {"corpus": str(tmp_path / "blank")}}}))
    # the fixed command (the budget's own corpus) takes the folder: its config replaces the stopped run's, and the
    # first model would train (here a scripted stop instead)
    class Trains(Exception):
        pass

    def train_entry(*args):
        raise Trains

    monkeypatch.setattr(study_module, "train_entry", train_entry)
    with pytest.raises(Trains):
        study_module.run_study(copy.deepcopy(BUDGETS["quick"]), out, study_module.StudyOptions(progress=False),
                               log=lambda *_: None)
    assert json.loads((out / "study_config.json").read_text())["budget"]["data"]["corpus"] == ""
