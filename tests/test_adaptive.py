"""Adaptive depth: a token exits after the first outer cycle when a halting rule says so, its skipped applications'
keys/values taken from the same role's first-cycle ones. The token-by-token eager decoder and the teacher-forced
all-positions pass must compute the same logits and depths."""
import dataclasses
import itertools
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import REPO
from hrm_edge.app.complete import main as complete_main
from hrm_edge.config import ModelConfig
from hrm_edge.errors import UserError
from hrm_edge.export.executorch import ExecuTorchKVCache
from hrm_edge.export.onnx import export_onnx_decode, export_onnx_draft, export_onnx_verify
from hrm_edge.measure.adaptive import MAX_BPB_RATIO, THRESHOLDS, CurvePoint, depth_curve, pick_default, render_curve
from hrm_edge.measure.evaluate import ProjectText, project_bits
from hrm_edge.model.checkpoint import HALTING, TOKENIZER, load_halting_head, load_model, save_model
from hrm_edge.model.eager import EagerAdaptiveDecoder, EagerDecoder, EagerSpeculativeDecoder
from hrm_edge.model.lm import HRMLM, HaltingHead, HaltingRule, KVCache, adaptive_forward, run_first_cycle
from hrm_edge.runtime.adaptive import AdaptiveDecoder, TopProbRule, adaptive_decode_logits
from hrm_edge.runtime.decoders import OnnxDecoder, decode_logits, generate
from hrm_edge.runtime.manifest import MANIFEST_FORMAT, Artifact, sha256_file
from hrm_edge.runtime.speculative import OnnxSpeculativeDecoder, PteSpeculativeDecoder
from hrm_edge.train.halting import _trained_corpus, fit_head, head_report, train_halting_head
from hrm_edge.verify.parity import FP32_TOLERANCE, _adaptive_rows, adaptive_check
from hrm_edge.verify.reference import adaptive_references
from hrm_edge.train.tokenizer import load_tokenizer

SHIPPED = REPO / "hrm_edge" / "default_model"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is faster than several on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

TOKENS = [4, 8, 15, 16, 23, 42, 7, 1, 30, 2, 9, 60, 33, 5, 5, 12, 50, 3, 21, 44]


def tiny_model(seed: int = 0, H: int = 2, L: int = 2, vocab: int = 64, d: int = 32, sharpen: float = 40.0) -> HRMLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_heads=2, H_cycles=H, L_cycles=L, max_seq_len=64, ffn_hidden=2 * d)
    model = HRMLM(cfg).eval()
    with torch.no_grad():  # sharper readouts than the init's, so that top probabilities spread over (0, 1)
        model.embed.weight.mul_(sharpen)
        model.block.attn.wo.weight.mul_(20.0)  # and attention that matters, so that copied keys/values show
    return model


def middle_threshold(model, rule_head=None) -> float:
    """A threshold that some positions pass and some do not: the median score."""
    rule = HaltingRule(0.0, rule_head)
    with torch.no_grad():
        first = run_first_cycle(model, torch.tensor([TOKENS]))
        return float(rule.scores(model, first.output_state(model), first.logits)[0, 2:].median())


def sequential(model, rule, prefill: int):
    dec = EagerAdaptiveDecoder(model, rule)
    logits = decode_logits(dec, np.array([TOKENS]), prefill)[0]
    return logits, [model.cfg.H_cycles] * prefill + dec.depths


@pytest.mark.parametrize("H, L, with_head", [(2, 2, False), (3, 1, False), (2, 3, True)])
def test_parallel_equals_sequential(H, L, with_head):
    model = tiny_model(1, H, L)
    head = None
    if with_head:
        torch.manual_seed(3)
        head = HaltingHead(model.cfg.d_model).eval()
    rule = HaltingRule(middle_threshold(model, head), head)
    seq_logits, seq_depths = sequential(model, rule, prefill=2)
    with torch.no_grad():
        par_logits, par_depths = adaptive_forward(model, torch.tensor([TOKENS]), rule, prefix=2)
    assert seq_depths == par_depths[0].tolist()
    assert 4 <= seq_depths.count(1) <= len(TOKENS) - 6  # both kinds of token
    np.testing.assert_allclose(par_logits[0].numpy(), seq_logits, atol=1e-5, rtol=0)
    with torch.no_grad():  # and exiting changes the later tokens' logits: the copied keys/values are read
        full = model(torch.tensor([TOKENS]))[0].numpy()
    deep = np.array(seq_depths) == H
    assert np.abs(full[deep] - seq_logits[deep]).max() > 1e-3


def test_nothing_exits_is_full_depth():
    model = tiny_model(2)
    rule = HaltingRule(1.5)
    logits, depths = sequential(model, rule, prefill=3)
    assert depths == [2] * len(TOKENS)
    np.testing.assert_allclose(logits, decode_logits(EagerDecoder(model), np.array([TOKENS]), 3)[0], atol=1e-5, rtol=0)
    prompt = TOKENS[:5]
    assert generate(EagerAdaptiveDecoder(model, rule), prompt, 30).tokens == generate(EagerDecoder(model), prompt, 30).tokens


def test_everything_exits_is_the_first_cycle():
    """Threshold 0: every decoded token's logits are the one-cycle model's (its first cycle never reads deeper keys)."""
    model = tiny_model(3)
    logits, depths = sequential(model, HaltingRule(0.0), prefill=1)
    assert depths == [2] + [1] * (len(TOKENS) - 1)
    with torch.no_grad():
        one_cycle = model(torch.tensor([TOKENS]), n_cycles=1)[0].numpy()
    np.testing.assert_allclose(logits[1:], one_cycle[1:], atol=1e-5, rtol=0)


def test_fit_head_learns_a_separable_target():
    torch.manual_seed(0)
    feats = torch.randn(4000, 10)
    targets = (feats[:, 3] - 0.5 * feats[:, 7] > 0.2).float()
    head = fit_head(feats[:3000], targets[:3000], steps=150, lr=0.05)
    report = head_report(head, feats[3000:], targets[3000:])
    assert report["accuracy"] > 0.95 and report["bce"] < 0.2


@pytest.fixture(scope="module")
def tiny_checkpoint_with_head(tmp_path_factory):
    """A tiny random checkpoint (the shipped tokenizer) and its halting head, trained on a folder corpus; returns
    (folder, the model files' bytes before the head was trained, the head's report)."""
    ckpt = tmp_path_factory.mktemp("adaptive") / "ckpt"
    ckpt.mkdir()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=32, n_heads=2, H_cycles=2, L_cycles=1, max_seq_len=64, ffn_hidden=64)
    save_model(ckpt, HRMLM(cfg))
    shutil.copy(SHIPPED / TOKENIZER, ckpt / TOKENIZER)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    corpus = REPO / "hrm_edge" / "model"  # a text folder: its training split
    report = train_halting_head(ckpt, str(corpus), windows=20, seq_len=64, log=lambda *_: None)
    return ckpt, before, report


def test_the_halting_head_trains_on_the_checkpoints_own_corpus(tmp_path):
    """"" in train_state.json is the standard library (what the checkpoint trained on), not a missing corpus: it
    was taken for the default, pypi."""
    for data, corpus in [({"corpus": ""}, ""), ({"corpus": "/some/text"}, "/some/text"), ({}, "pypi")]:
        (tmp_path / "train_state.json").write_text(json.dumps({"data": data}))
        assert _trained_corpus(tmp_path) == corpus
    (tmp_path / "train_state.json").unlink()
    assert _trained_corpus(tmp_path) == "pypi"


def test_train_halting_head_writes_only_its_file(tiny_checkpoint_with_head):
    """halting.safetensors appears, the model's files do not change, the head loads and predicts at least as well as
    the majority class on held-back windows."""
    ckpt, before, report = tiny_checkpoint_with_head
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.name != HALTING} == before
    head = load_halting_head(ckpt, 32)
    assert sum(p.numel() for p in head.parameters()) == 32 + 3
    assert report["examples"] == 2 * 64 and 0 <= report["agree_rate"] <= 1
    assert report["accuracy"] >= max(report["agree_rate"], 1 - report["agree_rate"]) - 0.05


def test_depth_curve(tiny_checkpoint_with_head):
    """Full depth's row is evaluate's bpb; exits fall as the threshold rises; each rule's default is the most-exiting
    threshold within the allowance."""
    ckpt = tiny_checkpoint_with_head[0]
    texts = [(REPO / "hrm_edge" / "model" / name).read_text()[:1500] for name in ("eager.py", "checkpoint.py")]
    projects = [ProjectText("a", texts[:1]), ProjectText("b", texts[1:])]
    record = depth_curve(ckpt, projects, seq_len=48, log=lambda *_: None)
    points = record["points"]
    model, tok = load_model(ckpt), load_tokenizer(ckpt / TOKENIZER)
    bits = sum(project_bits(model, tok, p.texts, 48, None) for p in projects)
    assert points[0]["rule"] == "full" and points[0]["exit_rate"] == 0
    assert points[0]["bpb"] == pytest.approx(bits / sum(p.bytes for p in projects), rel=1e-5)
    for rule in ("top_prob", "halting_head"):
        curve = [p for p in points if p["rule"] == rule]
        assert [p["threshold"] for p in curve] == list(THRESHOLDS[rule])
        assert all(a["exit_rate"] >= b["exit_rate"] for a, b in zip(curve, curve[1:]))
        assert all(p["tokens_per_s"] > 0 and 0 <= p["decode_exit_rate"] <= 1 for p in curve)
        ok = [p for p in curve if p["bpb_ratio"] <= MAX_BPB_RATIO]
        assert record["defaults"][rule] == (max(ok, key=lambda p: p["exit_rate"]) if ok else None)
    assert "| top_prob | 0.5 |" in render_curve(record)


def test_pick_default():
    points = [CurvePoint("full", None, 0, 1.0, 1.0)] + [
        CurvePoint("top_prob", t, e, 1.0 * r, r) for t, e, r in ((0.5, 0.5, 1.02), (0.7, 0.3, 1.004), (0.9, 0.1, 1.0))]
    assert pick_default(points, "top_prob").threshold == 0.7
    assert pick_default(points, "halting_head") is None


def eager_export(folder, model):
    """The smallest folder complete --runtime eager accepts: a manifest naming the tokenizer and the checkpoint."""
    folder.mkdir()
    save_model(folder, model)
    shutil.copy(SHIPPED / TOKENIZER, folder / TOKENIZER)
    manifest = {"format_version": MANIFEST_FORMAT, "model": dataclasses.asdict(model.cfg), "artifacts": [],
                "tokenizer": {"path": TOKENIZER, "sha256": sha256_file(folder / TOKENIZER)},
                "checkpoint": {"config": "config.json", "weights": "model.safetensors",
                               "weights_sha256": sha256_file(folder / "model.safetensors")}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_complete_exit_threshold(tmp_path, capsys):
    """complete --exit-threshold: above every probability the text is plain greedy's; at 0 every decode step exits."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=32, n_heads=2, H_cycles=2, L_cycles=1, max_seq_len=64, ffn_hidden=64)
    out = eager_export(tmp_path / "export", HRMLM(cfg))
    runs = {}
    for extra in ((), ("--exit-threshold", "1.5"), ("--exit-threshold", "0")):
        assert complete_main(["--artifacts", str(out), "--runtime", "eager", "--max-new-tokens", "12", *extra,
                              "def f("]) == 0
        text, last = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
        runs[extra[1:]] = (text, last)
    assert runs[("1.5",)][0] == runs[()][0] and "0/11 decode steps exited" in runs[("1.5",)][1]
    assert "11/11 decode steps exited" in runs[("0",)][1]
    with pytest.raises(UserError, match="no fp32 KV-cache onnx program"):
        complete_main(["--artifacts", str(out), "--runtime", "onnx", "--exit-threshold", "0.5", "x"])
    with pytest.raises(UserError, match="without --speculative"):
        complete_main(["--artifacts", str(out), "--runtime", "eager", "--adaptive", "--speculative", "x"])


def test_complete_exit_threshold_on_the_onnx_graphs(tmp_path, capsys):
    """complete --runtime onnx --exit-threshold runs the KV, draft and verify graphs: the eager adaptive decoder's text
    and exits, nothing exiting and everything exiting; the draft graph missing is one error line."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=64, n_heads=2, H_cycles=2, L_cycles=1, max_seq_len=64, ffn_hidden=128)
    out = eager_export(tmp_path / "export", HRMLM(cfg).eval())
    manifest = json.loads((out / "manifest.json").read_text())
    for path, program in zip(onnx_set(out, load_model(out)), ("kv_cache", "draft", "verify")):
        art = Artifact.new(path, "onnx", "fp32", program, "onnx_loop", bytes=path.stat().st_size,
                           sha256=sha256_file(path), parity={"x86_64": {"passed": True}})
        manifest["artifacts"].append(art.to_json())
    (out / "manifest.json").write_text(json.dumps(manifest))
    lines = {}
    for runtime, threshold in itertools.product(("eager", "onnx"), ("0", "1.5")):
        assert complete_main(["--artifacts", str(out), "--runtime", runtime, "--max-new-tokens", "12",
                              "--exit-threshold", threshold, "def f("]) == 0
        text, last = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
        lines[runtime, threshold] = (text, last.split("exit >= ")[1].split(",")[0])
    assert lines["onnx", "0"] == lines["eager", "0"] and lines["onnx", "0"][1] == "0: 11/11 decode steps exited"
    assert lines["onnx", "1.5"] == lines["eager", "1.5"] and lines["onnx", "1.5"][1] == "1.5: 0/11 decode steps exited"
    assert lines["onnx", "0"][0] != lines["onnx", "1.5"][0]
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["program"] != "draft"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="--exit-threshold: no draft graph for hrm.fp32.kv.onnx"):
        complete_main(["--artifacts", str(out), "--runtime", "onnx", "--adaptive", "x"])


# ---- the exported artifacts: ONNX draft + verify graphs, the ExecuTorch program's draft / verify / skip ----
def spaced_threshold(model) -> float:
    """Halfway between the two middle top probabilities of the decoded positions (some exit, some do not), checked to
    sit well clear of both: an ONNX and an eager top probability that differ in the 7th digit take the same decision."""
    with torch.no_grad():
        first = run_first_cycle(model, torch.tensor([TOKENS]))
        scores = HaltingRule(0.0).scores(model, first.output_state(model), first.logits)[0, 2:].sort().values
    below, above = scores[len(scores) // 2 - 1: len(scores) // 2 + 1].tolist()
    assert above - below > 2e-4
    return (below + above) / 2


def onnx_model(seed: int, H: int, L: int) -> HRMLM:
    """tiny_model, with a vocabulary and width large enough that the ONNX exporter keeps the tied head's Transpose
    (hrm_edge.export.onnx.head_as_gemm rewrites it), sharpened less than the d-32 one, whose decoded positions' top
    probabilities all round to 1 (no threshold separates them)."""
    return tiny_model(seed, H, L, vocab=512, d=64, sharpen=12.0)


def onnx_set(folder, model):
    """The model's KV, draft and verify graphs (hrm.fp32.{kv,draft,verify}.onnx) in folder."""
    return (export_onnx_decode(model, folder / "hrm.fp32.kv.onnx"), export_onnx_draft(model, folder / "hrm.fp32.draft.onnx"),
            export_onnx_verify(model, folder / "hrm.fp32.verify.onnx"))


@pytest.fixture(scope="module", params=[(2, 2), (3, 1)], ids=["H2-L2", "H3-L1"])
def onnx_adaptive(request, tmp_path_factory):
    """(model, its KV, draft and verify graphs, a threshold between its decoded positions' top probabilities)."""
    H, L = request.param
    model = onnx_model(4, H, L)
    threshold = spaced_threshold(model)
    return model, onnx_set(tmp_path_factory.mktemp(f"onnx-h{H}-l{L}"), model), threshold


def test_onnx_adaptive_equals_eager(onnx_adaptive):
    """AdaptiveDecoder over the ONNX draft/verify graphs takes the eager decoder's decisions and computes its logits;
    with a threshold above 1 it is the plain KV graph."""
    model, paths, threshold = onnx_adaptive
    H = model.cfg.H_cycles
    eager_logits, eager_depths = sequential(model, HaltingRule(threshold), prefill=2)
    onnx = AdaptiveDecoder(OnnxSpeculativeDecoder(*paths), H, TopProbRule(threshold))
    logits, exited = adaptive_decode_logits(onnx, np.array([TOKENS]), 2)
    assert [H] * 2 + onnx.depths == eager_depths and exited[0].tolist() == [d == 1 for d in eager_depths]
    assert 4 <= eager_depths.count(1) <= len(TOKENS) - 6
    np.testing.assert_allclose(logits[0], eager_logits, atol=1e-4, rtol=0)
    never = AdaptiveDecoder(OnnxSpeculativeDecoder(*paths), H, TopProbRule(1.5))
    full = decode_logits(OnnxDecoder(paths[0]), np.array([TOKENS]), 2)
    np.testing.assert_allclose(decode_logits(never, np.array([TOKENS]), 2), full, atol=1e-5, rtol=0)
    assert never.depths == [H] * (len(TOKENS) - 2)


@pytest.mark.parametrize("onnx_adaptive", [(2, 2)], ids=["H2-L2"], indirect=True)  # its top probabilities straddle 0.8
def test_parity_adaptive_check(onnx_adaptive, tmp_path):
    """The gate's adaptive check of a verify graph at DEFAULT_EXIT_THRESHOLD: against the eager model with the graph's
    own exits, and against the bundle's stored eager reference (no eager model), both pass with every decision
    agreeing; a stored reference with other decisions, or of another model, fails it."""
    model, paths, _ = onnx_adaptive
    save_model(tmp_path, model)
    windows = np.array([TOKENS + [9], TOKENS[::-1] + [3], [t * 3 % 64 for t in TOKENS] + [1]], dtype=np.int64)
    art = Artifact.new(paths[2], "onnx", "fp32", "verify", "onnx_loop", prefill_len=3)
    stored = {f"reference/{k}": v for k, v in adaptive_references(model, "fp32", windows[:, :-1], 3).items()}
    bundle = {"windows": windows} | stored
    eager = adaptive_check(paths[2], art, bundle, FP32_TOLERANCE, tmp_path)
    offline = adaptive_check(paths[2], art, bundle, FP32_TOLERANCE, None)
    for r in (eager, offline):
        assert r["passed"] and r["depth_agreement"] == 1.0 and r["positions_compared"] == r["positions"] == 3 * len(TOKENS), r
        assert 0.1 < r["exit_rate"] == r["eager_exit_rate"] < 0.9
        assert r["max_abs_logit_error"] < 1e-4
    assert "artifact's exits" in eager["compared_with"] and "first exit that differs" in offline["compared_with"]
    art.record_parity("x86_64", {"passed": True, "adaptive": offline})
    row = f"| hrm.fp32.verify.onnx | x86_64 | {offline['exit_rate']:.3f} | {offline['eager_exit_rate']:.3f} | 1.0000 |"
    assert row in "\n".join(_adaptive_rows({"artifacts": [art]}))
    older = {k: v for k, v in offline.items() if k not in ("positions", "positions_compared")} | {"windows_compared": 3}
    art.record_parity("x86_64", {"passed": True, "adaptive": older})  # a manifest written before 2026-12-02
    assert "(3 windows)" in "\n".join(_adaptive_rows({"artifacts": [art]}))
    flipped = stored["reference/adaptive/fp32/exited"].copy()
    flipped[:, 3:5] = ~flipped[:, 3:5]
    r = adaptive_check(paths[2], art, bundle | {"reference/adaptive/fp32/exited": flipped}, FP32_TOLERANCE, None)
    assert not r["passed"] and r["depth_agreement"] < 0.99 and "exit decisions agree" in r["reason"]
    assert r["positions_compared"] == 3 * 3, "each window up to its first differing exit, position 3"
    assert r["decoded_compared"] == 0 and "no decoded position compared" in r["reason"]  # the prefill alone: no pass
    other = {f"reference/{k}": v for k, v in adaptive_references(onnx_model(7, model.cfg.H_cycles, model.cfg.L_cycles), "fp32", windows[:, :-1], 3).items()}
    assert not adaptive_check(paths[2], art, {"windows": windows} | other, FP32_TOLERANCE, None)["passed"]


@pytest.mark.parametrize("onnx_adaptive", [(3, 1)], ids=["H3-L1"], indirect=True)  # two cycles' slots to fill
def test_onnx_skip_fills_the_slots_as_copy_first_cycle(onnx_adaptive):
    """After a prefill, a draft and skip(), the ONNX decoder's deeper cache slots hold what the eager KVCache holds
    after copy_first_cycle: at the skipped position, slot t = slot t mod (L + 1)."""
    model, paths, _ = onnx_adaptive
    onnx, eager = OnnxSpeculativeDecoder(*paths), EagerSpeculativeDecoder(model)
    for dec in (onnx, eager):
        dec.reset()
        dec.prefill(np.array(TOKENS[:6]))
        dec.draft(TOKENS[6])
        dec.skip()
        dec.commit(1)
    cache, per_cycle = eager.form.cache, model.cfg.L_cycles + 1
    for i, t in enumerate(range(per_cycle, model.cfg.n_steps)):
        for name, rest in zip("kv", onnx.rest):
            np.testing.assert_allclose(rest[i, :, :, :7], getattr(cache, f"{name}_{t}")[:, :, :7].numpy(), atol=1e-5)
            np.testing.assert_array_equal(rest[i, :, :, 6], onnx.first["kv".index(name)][t % per_cycle, :, :, 6])
    assert onnx.rest[0].shape[3] == onnx.first[0].shape[3] == 7 and onnx.pos == eager.pos == 7


def test_executorch_cache_copy_first_cycle_equals_kv_cache():
    """ExecuTorchKVCache.copy_first_cycle (narrow + llama::update_cache, layout [B, L, H, hd]) moves what
    KVCache.copy_first_cycle moves ([B, H, L, hd])."""
    cfg = tiny_model(0, H=3, L=1).cfg
    et, kv = ExecuTorchKVCache(cfg, cfg.n_steps), KVCache(cfg)
    torch.manual_seed(6)
    for name, buf in et.named_buffers():
        buf.copy_(torch.randn(buf.shape))
        getattr(kv, name).copy_(buf.transpose(1, 2))
    steps = range(2, cfg.n_steps)
    et.copy_first_cycle(torch.tensor([9]), steps, 2)
    kv.copy_first_cycle(torch.tensor([9]), steps, 2)
    for name, buf in et.named_buffers():
        assert torch.equal(buf.transpose(1, 2), getattr(kv, name)), name
    assert torch.equal(et.k_4[:, 9], et.k_0[:, 9]) and not torch.equal(et.k_4[:, 8], et.k_0[:, 8])


@pytest.mark.slow
def test_pte_adaptive_equals_eager(default_export):
    """The speculative ExecuTorch program's skip method, in the shipped model's program as the export made it:
    adaptive decoding over draft / verify / skip takes the eager decoder's decisions and computes its logits."""
    model = load_model(default_export)
    threshold = spaced_threshold(model)
    eager_logits, eager_depths = sequential(model, HaltingRule(threshold), prefill=2)
    pte = AdaptiveDecoder(PteSpeculativeDecoder(default_export / "hrm.fp32.spec.pte"), model.cfg.H_cycles,
                          TopProbRule(threshold))
    logits, _ = adaptive_decode_logits(pte, np.array([TOKENS]), 2)
    assert [model.cfg.H_cycles] * 2 + pte.depths == eager_depths and 4 <= eager_depths.count(1)
    np.testing.assert_allclose(logits[0], eager_logits, atol=1e-4, rtol=0)
