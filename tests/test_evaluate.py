"""python -m hrm_edge.evaluate: held-out bits per byte, depth dial and xz -9, on the fake built corpus of
test_corpus (no download)."""
import json
import math

import torch

from conftest import run_module
from hrm_edge.model.checkpoint import save_model
from hrm_edge.config import ModelConfig
from hrm_edge.train.dataset import encode_documents
from hrm_edge.measure.evaluate import heldout_texts, project_bits
from hrm_edge.model.lm import HRMLM
from hrm_edge.train.tokenizer import save_tokenizer, train_tokenizer
from test_corpus import built, fake_cache  # noqa: F401  (fixtures)


def checkpoint(folder, texts, zero_table: bool):
    tok = train_tokenizer(texts, 300)
    model = HRMLM(ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_heads=2, max_seq_len=64, H_cycles=2,
                              L_cycles=1, aux_loss_weight=0.3)).eval()
    if zero_table:  # logits all 0: every token costs exactly log2(V) bits
        with torch.no_grad():
            model.embed.weight.zero_()
    save_model(folder, model)
    save_tokenizer(tok, folder / "tokenizer.json")
    return model, tok


def test_bits_are_the_models_next_token_loss(built, tmp_path):  # noqa: F811
    out, _ = built
    projects = heldout_texts(str(out), max_bytes=20_000)
    assert projects and all(p.texts for p in projects)
    texts = [t for p in projects for t in p.texts]
    model, tok = checkpoint(tmp_path / "uniform", texts, zero_table=True)
    # thousands of 16-token calls of a 32-wide model: one thread. With 2 it took 125-404 s in the suite beside the
    # other worker's exports (each call's threads waiting on one the export displaced), 5 s alone (docs/measurements.md)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in projects:
            n_predicted = len(encode_documents(tok, p.texts)) - 1  # every token but the first, each once
            for n_cycles in (None, 1):
                bits = project_bits(model, tok, p.texts, seq_len=16, n_cycles=n_cycles)
                assert math.isclose(bits, n_predicted * math.log2(tok.get_vocab_size()), rel_tol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_cli_table_and_record(built, tmp_path):  # noqa: F811
    out, _ = built
    texts = [t for p in heldout_texts(str(out), 20_000) for t in p.texts]
    checkpoint(tmp_path / "random", texts, zero_table=False)
    proc = run_module("hrm_edge.evaluate", tmp_path / "random", "--corpus", out, "--max-bytes", "20000",
                      "--seq-len", "32", "--samples", "1", "--out", tmp_path / "eval", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    rows = {r["project"]: r for r in record["rows"]}
    projects = [r for name, r in rows.items() if name != "all"]
    assert projects and {"xz_9", "random:full", "random:1_cycle"} <= set(rows["all"])
    # 'all' is the byte-weighted mean of the projects
    for key in ("xz_9", "random:full"):
        mean = sum(r[key] * r["bytes"] for r in projects) / sum(r["bytes"] for r in projects)
        assert math.isclose(rows["all"][key], mean, rel_tol=1e-9)
    assert all(0 < r["xz_9"] < 8 and r["random:full"] > r["xz_9"] for r in projects)  # an untrained model loses
    assert record["samples"] and record["samples"][0]["greedy"] is not None
    assert "| all |" in (tmp_path / "eval" / "evaluation.md").read_text()
