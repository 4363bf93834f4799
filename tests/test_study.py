"""python -m hrm_edge.study: the quick budget end to end, resume, and its user errors.

The quick budget trains thirteen tiny models for 40 steps, so only robust things are asserted: every model
learned something, the sizes are what the study claims, the files and the table are there, and the
int8 programs decode. Which model wins is the full run's business (docs/measurements.md), not CI's.
"""
import json
import math

import pytest

from conftest import run_module
from hrm_edge.measure.study import BUDGETS, study_entries
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
    assert all(g["met"] is not None for g in study["goals"]), study["goals"]  # evaluated, whatever the verdict
    assert table.count("**met**") + table.count("**not met**") == 2

    # --resume keeps every finished model and program: nothing is trained or lowered again
    again = run_module("hrm_edge.study", "--budget", "quick", "--out", out, "--threads", "1", "--no-progress", "--resume")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("already trained (kept)") == len(names)
    assert again.stdout.count("int8 program already built (kept)") == 3
    resumed = {m["name"]: m for m in json.loads((out / "study.json").read_text())["models"]}
    assert all(resumed[n]["val_bits_per_byte"] == models[n]["val_bits_per_byte"] for n in names)


def test_study_refuses_an_existing_study_without_resume(tmp_path):
    out = tmp_path / "study"
    (out / "hrm").mkdir(parents=True)
    (out / "hrm" / "train_state.json").write_text("{}")
    assert_user_error(run_module("hrm_edge.study", "--out", out), "already holds a study", "--resume")


def test_study_unknown_model(tmp_path):
    assert_user_error(run_module("hrm_edge.study", "--out", tmp_path / "s", "--only", "hrm,nope"),
                      "unknown model", "nope")


def test_study_resume_with_another_budget(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    (out / "study_config.json").write_text(json.dumps({"budget": {"name": "full"}}))
    assert_user_error(run_module("hrm_edge.study", "--out", out, "--budget", "quick", "--resume"),
                      "different budget")
