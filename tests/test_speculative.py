"""Self-speculative decoding (hrm_edge.runtime.speculative): the first outer cycle drafts, the full depth verifies.
Greedy output must equal full-depth greedy decoding token for token; sampling must keep the full model's
distribution."""
import functools
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from hrm_edge.app.complete import files_to_load
from hrm_edge.app.demo import WEB_DIR, web_packages
from hrm_edge.config import ModelConfig
from hrm_edge.errors import UserError
from hrm_edge.export.pipeline import pte_jobs
from hrm_edge.measure.profile import round_costs
from hrm_edge.model.checkpoint import load_model
from hrm_edge.model.eager import EagerDecoder, EagerSpeculativeDecoder
from hrm_edge.model.lm import HRMLM, CachedDraftForm, CachedVerifyForm, KVCache
from hrm_edge.runtime.decoders import PteDecoder, Sampling, generate
from hrm_edge.runtime.healing import prompt_end
from hrm_edge.runtime.manifest import Artifact
from hrm_edge.runtime.speculative import (DEFAULT_DRAFT_LEN, DEFAULT_LOOKUP_LEN, PteSpeculativeDecoder, RoundPlan,
                                          accept_greedy, accept_sampled, context_guess, generate_speculative,
                                          one_hot_probs)
from hrm_edge.train.tokenizer import load_tokenizer

SHIPPED = REPO / "hrm_edge" / "default_model"


@functools.cache
def shipped():
    """The shipped model: a random one's greedy output is one token repeated, and its drafts are always kept;
    on real code the first cycle is kept most of the time and corrected some of the time."""
    torch.set_num_threads(1)
    return load_model(SHIPPED), load_tokenizer(SHIPPED / "tokenizer.json")


CODE_SAMPLE = Path(__file__).parent / "code_sample.txt"  # real code, frozen: the model's drafts on it are known


def code_prompt(start: int, n_bytes: int = 200) -> list[int]:
    """Tokens of a piece of code_sample.txt (the start of an earlier runtime/decoders.py, kept as it was: prompts cut
    from the live file changed whenever it was edited, and with them whether a draft is ever corrected)."""
    text = CODE_SAMPLE.read_text()[start: start + n_bytes]
    return shipped()[1].encode(text).ids


def tiny_model(seed: int = 0) -> HRMLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, H_cycles=2, L_cycles=3, max_seq_len=96, ffn_hidden=64)
    return HRMLM(cfg).eval()


@pytest.mark.parametrize("draft_len, start", [(1, 0), (2, 1000), (4, 1800), (7, 2700)])
def test_greedy_equals_full_depth_greedy(draft_len, start):
    model, prompt = shipped()[0], code_prompt(start)
    full = generate(EagerDecoder(model), prompt, 60)
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 60, plan=RoundPlan(draft_len, lookup_len=0))
    assert spec.tokens == full.tokens and len(full.tokens) == 60
    assert spec.rounds == len(spec.round_tokens) and sum(spec.round_tokens) == 60 - 1
    assert 0 < spec.accepted < spec.proposed  # both paths ran: kept drafts and corrections
    assert max(spec.round_tokens) <= draft_len + 1 and spec.lookup_rounds == 0


@pytest.mark.parametrize("start", [0, 1800])
def test_context_lookup_keeps_the_full_depth_greedy_text(start):
    """Rounds drafted from a context guess (one draft call for the guess) and rounds drafted by the first cycle
    both ran, and the text is still the full model's, token for token."""
    model, prompt = shipped()[0], code_prompt(start, 400)
    full = generate(EagerDecoder(model), prompt, 80)
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 80, plan=RoundPlan(4, lookup_len=8))
    assert spec.tokens == full.tokens and len(full.tokens) == 80
    assert 0 < spec.lookup_rounds < spec.rounds and sum(spec.round_tokens) == 80 - 1
    assert max(spec.round_tokens) <= 8 + 1


def test_context_guess():
    ctx = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 6, 7]
    assert context_guess(ctx, 3) == [2, 3, 6]  # 6 7 last followed by 2 3 6 (the latest earlier occurrence)
    assert context_guess(ctx, 10) == [2, 3, 6, 7]  # up to the context's end
    assert context_guess(ctx + [5], 4) == []  # "6 7 5" never occurred, "7 5" neither, and n = 1 is not tried
    assert context_guess(ctx + [5], 4, ngrams=(3, 2, 1)) == [6, 7, 2, 3]  # the latest earlier 5
    assert context_guess([1, 2, 3], 4) == [] and context_guess(ctx, 0) == []


def test_draft_many_is_one_call_of_the_per_token_drafts():
    """draft_many over n tokens writes and returns what n draft calls do: the verify after it gives the same logits."""
    model = tiny_model(3)
    tokens = [4, 8, 15, 16, 23, 42, 7, 1, 30]
    one, many = EagerSpeculativeDecoder(model), EagerSpeculativeDecoder(model)
    for dec in (one, many):
        dec.prefill(np.array(tokens[:5]))
    per_token = np.stack([one.draft(t) for t in tokens[5:]])
    batched = many.draft_many(tokens[5:])
    np.testing.assert_allclose(batched, per_token, atol=2e-5, rtol=0)
    np.testing.assert_allclose(many.verify(), one.verify(), atol=2e-5, rtol=0)


def test_verify_many_is_the_full_depth_of_a_guess():
    """verify_many over n tokens gives the full model's logits there, and leaves the caches a later round reads."""
    model = tiny_model(4)
    tokens = [4, 8, 15, 16, 23, 42, 7, 1, 30, 2, 9]
    dec = EagerSpeculativeDecoder(model)
    dec.prefill(np.array(tokens[:5]))
    many = dec.verify_many(tokens[5:9])
    dec.commit(4)
    for t in tokens[9:]:
        dec.draft(t)
    after = dec.verify()
    with torch.no_grad():
        reference = model(torch.tensor([tokens]))[0].numpy()
    np.testing.assert_allclose(many, reference[5:9], atol=2e-4, rtol=0)
    np.testing.assert_allclose(after, reference[9:], atol=2e-4, rtol=0)


def test_a_guess_as_a_point_mass_draft_keeps_the_target_distribution():
    """Sampling with a context guess: q is one-hot on the guess, kept with probability p(d), else p without d."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(p)[None, :].repeat(2, 0)
    s, rng = Sampling(temperature=1.0), np.random.default_rng(1)
    counts = np.zeros(4)
    for _ in range(20000):
        counts[accept_sampled(logits, one_hot_probs([2], 4), [2], s, rng)[0]] += 1
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.015)


def test_verified_logits_equal_the_full_models():
    """The verify call's logits at every drafted position are the full-depth logits of those positions."""
    model = tiny_model(1)
    tokens = [4, 8, 15, 16, 23, 42, 7, 1, 30]
    dec = EagerSpeculativeDecoder(model)
    dec.prefill(np.array(tokens[:5]))
    for t in tokens[5:]:
        dec.draft(t)
    verified = dec.verify()  # [4, V]
    with torch.no_grad():
        reference = model(torch.tensor([tokens]))[0, 5:].numpy()
    np.testing.assert_allclose(verified, reference, atol=2e-4, rtol=0)


def test_stops_at_eos_and_context():
    model = tiny_model()  # a random model: its drafts are all kept, which the other tests do not cover
    prompt = [3, 17, 5]
    full = generate(EagerDecoder(model), prompt, 500)  # the context (96) ends it
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 500, plan=RoundPlan(4))
    assert spec.tokens == full.tokens and len(spec.tokens) == 96 - 3
    eos = full.tokens[10]
    full = generate(EagerDecoder(model), prompt, 500, eos_id=eos)
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 500, eos_id=eos, plan=RoundPlan(4))
    assert spec.tokens == full.tokens and spec.stopped_at_eos and spec.tokens[-1] == eos


def test_accept_greedy():
    full = np.eye(5)[[1, 2, 3, 4]]  # argmax 1, 2, 3, 4
    assert accept_greedy(full, [1, 2, 3]) == [1, 2, 3, 4]  # all kept, plus the bonus token
    assert accept_greedy(full, [1, 0, 3]) == [1, 2]  # the first disagreement ends the round, corrected


def test_speculative_sampling_keeps_the_target_distribution():
    """One position: proposal d ~ q, kept with min(1, p/q), else drawn from max(0, p - q). The first token's
    empirical distribution over 20,000 draws matches p (not q) within 0.015 per token."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(p)[None, :].repeat(2, 0)  # the verify logits at two positions
    s = Sampling(temperature=1.0)
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    for _ in range(20000):
        d = int(rng.choice(4, p=q))
        counts[accept_sampled(logits, [q], [d], s, rng)[0]] += 1
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.015)
    assert not np.allclose(counts / counts.sum(), q, atol=0.1)


def test_sampled_generation_runs_to_the_budget():
    model = tiny_model()
    g = generate_speculative(EagerSpeculativeDecoder(model), [3, 17, 5], 40, Sampling(temperature=0.8, seed=3))
    assert len(g.tokens) == 40 and g.rounds >= 40 // 5


def test_cached_forms_continue_the_full_model():
    """The ExecuTorch program's draft and verify methods on an eager KVCache: prefill 5 tokens with the full
    model, draft 4 (cycle-1 readout and states), verify them in one call: the full model's logits there."""
    model = tiny_model(2)
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 1, 30]])
    cache = KVCache(model.cfg)
    draft, verify = CachedDraftForm(model, cache), CachedVerifyForm(model, cache)
    with torch.no_grad():
        model(tokens[:, :5], cache=cache, input_pos=torch.tensor([0]))
        states = [draft(tokens[:, i: i + 1], torch.tensor([i]))[1] for i in range(5, 9)]  # [2, 1, 1, D] each
        verified = verify(tokens[:, 5:], torch.cat(states, dim=2), torch.tensor([5]))[0]
        cycle1 = draft(tokens[:, 8:9], torch.tensor([8]))[0][0, -1]
        reference = model(tokens, aux=True)  # per outer cycle: [1, 9, V] each
    np.testing.assert_allclose(verified.numpy(), reference[-1][0, 5:].numpy(), atol=2e-4, rtol=0)
    np.testing.assert_allclose(cycle1.numpy(), reference[0][0, 8].numpy(), atol=2e-4, rtol=0)


def made(jobs) -> list[str]:
    """The programs a list of PteJob writes, in order: each job's, then the KV program it writes too."""
    return [name for j in jobs for name in (j.name, j.kv) if name]


def test_the_export_lowers_a_speculative_program_beside_each_full_depth_kv_program():
    """fp32, and int8 where the dynamic int8 KV program is built, sharing its eager reference (the same quantized
    model) and writing it (its forward method); the plain KV programs stay; slowest first; none for a model without a
    first cycle to draft with."""
    cfg = ModelConfig(H_cycles=2, L_cycles=3)
    jobs = {j.name: j for j in pte_jobs(cfg, ("static", "dynamic"), (1,))}
    assert list(jobs)[0] == "hrm.int8-dynamic.spec.pte"
    assert made(jobs.values()) == ["hrm.int8-dynamic.spec.pte", "hrm.int8-dynamic.kv.pte", "hrm.fp32.pte",
                                   "hrm.fp32.spec.pte", "hrm.fp32.kv.pte", "hrm.int8-dynamic.c1.kv.pte"]
    spec = jobs["hrm.int8-dynamic.spec.pte"]
    assert (spec.precision, spec.program, spec.reference, spec.kv) == ("int8", "speculative", "hrm.int8-dynamic.kv.pte",
                                                                       "hrm.int8-dynamic.kv.pte")
    assert jobs["hrm.fp32.spec.pte"].reference is None and jobs["hrm.fp32.spec.pte"].kv == "hrm.fp32.kv.pte"
    assert jobs["hrm.int8-dynamic.c1.kv.pte"].program == "kv_cache"
    assert [j.name for j in pte_jobs(cfg, ("static",), ()) if j.program == "speculative"] == ["hrm.fp32.spec.pte"]
    for other in (ModelConfig(arch="transformer"), ModelConfig(H_cycles=1)):
        assert not [j for j in pte_jobs(other, ("dynamic",), ()) if j.program == "speculative"]


def test_pte_programs_choose_the_kinds_lowered():
    """--pte-programs: only the kinds asked for, in the same order; an int8 speculative program without its KV
    program computes its own eager reference and writes no KV program; the depth dial's programs are KV programs."""
    cfg = ModelConfig(H_cycles=2, L_cycles=3)
    every = made(pte_jobs(cfg, ("static", "dynamic"), (1,)))
    programs = {"hrm.fp32.pte": "full_sequence", "hrm.int8-dynamic.spec.pte": "speculative",
                "hrm.fp32.spec.pte": "speculative"}
    for kinds in (("kv_cache",), ("speculative",), ("full_sequence", "speculative"), ("kv_cache", "speculative")):
        names = made(pte_jobs(cfg, ("static", "dynamic"), (1,), kinds))
        assert names == [n for n in every if programs.get(n, "kv_cache") in kinds], kinds
    [spec] = [j for j in pte_jobs(cfg, ("dynamic",), (), ("speculative",)) if j.precision == "int8"]
    assert spec.reference is None and spec.kv is None
    kv = pte_jobs(cfg, ("dynamic",), (1,), ("kv_cache",))
    assert {j.name for j in kv} == {"hrm.int8-dynamic.kv.pte", "hrm.fp32.kv.pte", "hrm.int8-dynamic.c1.kv.pte"}
    assert not [j for j in kv if j.kv]
    assert pte_jobs(ModelConfig(arch="transformer"), (), (), ("speculative",)) == []


def test_complete_runs_the_speculative_program_that_passed():
    def art(path, program, passed=True):
        return Artifact.new(path, "pte", "fp32", program, "unrolled", parity={"x86_64": {"passed": passed}})

    manifest = {"tokenizer": {"path": "tokenizer.json"},
                "artifacts": [art("hrm.fp32.kv.pte", "kv_cache"), art("hrm.fp32.spec.pte", "speculative")]}
    assert files_to_load(manifest, "executorch", "fp32", speculative=True) == ["tokenizer.json", "hrm.fp32.spec.pte"]
    assert files_to_load(manifest, "executorch", "fp32") == ["tokenizer.json", "hrm.fp32.kv.pte"]
    with pytest.raises(UserError, match="no int8 self-speculative"):
        files_to_load(manifest, "executorch", "int8", speculative=True)
    manifest["artifacts"][1] = art("hrm.fp32.spec.pte", "speculative", passed=False)
    with pytest.raises(UserError, match="hrm.fp32.spec.pte did not pass"):
        files_to_load(manifest, "executorch", "fp32", speculative=True)
    # the depth dial's KV program (fewer outer cycles) is never the one a completion runs, whatever its place
    dial = Artifact.new("hrm.fp32.c1.kv.pte", "pte", "fp32", "kv_cache", "unrolled", cycles=1,
                        parity={"x86_64": {"passed": True}})
    manifest["artifacts"].insert(0, dial)
    assert files_to_load(manifest, "executorch", "fp32") == ["tokenizer.json", "hrm.fp32.kv.pte"]
    # a model without the looped depth has no first cycle to draft with (it was a traceback mid-generation)
    manifest["model"] = {"arch": "transformer", "H_cycles": 1}
    with pytest.raises(UserError, match="--speculative needs the looped HRM model with at least 2 outer cycles"):
        files_to_load(manifest, "onnx", "fp32", speculative=True)


@pytest.mark.slow
def test_pte_speculative_program_is_exact(default_export):
    """The shipped model's speculative ExecuTorch program (forward, draft, verify over shared cache buffers), as the
    export made it: draft's logits are the eager first cycle's readout, verify's the full program's, and greedy
    speculative decoding equals plain greedy decoding of the full KV program (export_pte_decode's graph is the
    program's forward) token for token."""
    model, tokenizer = shipped()
    path = default_export / "hrm.fp32.spec.pte"
    torch.set_num_threads(2)
    full, spec = PteDecoder(path, threads=1), PteSpeculativeDecoder(path, threads=1)
    # one thread is one: custom_sdpa's products over several positions ran on every core (the BLAS's OpenMP threads)
    assert torch.get_num_threads() == 1
    prompt = code_prompt(0)
    reference = full.prefill(np.array(prompt))  # [S, V]
    spec.reset()
    spec.prefill(np.array(prompt[:-5]))
    drafted = np.stack([spec.draft(token) for token in prompt[-5:]])  # [5, V]
    np.testing.assert_allclose(spec.verify(), reference[-5:], atol=1e-4, rtol=0)
    with torch.no_grad():
        cycle1 = model(torch.tensor([prompt]), aux=True)[0][0, -5:].numpy()  # the first outer cycle's readout
    np.testing.assert_allclose(drafted, cycle1, atol=1e-4 * np.ptp(cycle1), rtol=0)
    for draft_len, start in [(3, 900), (6, 2700)]:
        prompt = code_prompt(start)
        plain = generate(full, prompt, 60)
        g = generate_speculative(spec, prompt, 60, plan=RoundPlan(draft_len, lookup_len=0))
        assert g.tokens == plain.tokens and len(g.tokens) == 60
        assert 0 < g.accepted < g.proposed  # kept drafts and corrections both ran
        looked_up = generate_speculative(spec, prompt, 60, plan=RoundPlan(draft_len))  # guesses verified by forward
        assert looked_up.tokens == plain.tokens and looked_up.lookup_rounds > 0


@pytest.mark.slow
def test_round_costs_times_every_call_a_round_makes(default_export):
    """hrm_edge.measure.profile.round_costs (the call costs docs/measurements.md cites): a verify over each draft
    length's positions, the full depth over each context guess's, and the break-even of a default round from them."""
    for program in ("hrm.fp32.spec.pte", "hrm.int8-nbits.kv.onnx"):  # ExecuTorch's methods, an ONNX set's graphs
        c = round_costs(default_export / program, calls=3)
        assert list(c["verify_us"]) == list(range(1, DEFAULT_DRAFT_LEN + 2))
        assert list(c["full_us"]) == list(range(1, DEFAULT_LOOKUP_LEN + 2))
        assert c["guess_us"] == c["full_us"][DEFAULT_LOOKUP_LEN + 1] and c["guess_len"] == DEFAULT_LOOKUP_LEN + 1
        n = DEFAULT_DRAFT_LEN + 1
        assert c["break_even"] == pytest.approx((n * c["draft_us"] + c["verify_us"][n]) / c["step_us"])
        assert min([c["step_us"], c["draft_us"], *c["verify_us"].values(), *c["full_us"].values()]) > 0


# ---- the page's context lookup (generate.mjs, under node) ----
def page_lookup(tmp_path, job: dict) -> dict:
    shutil.copytree(WEB_DIR / "js", tmp_path / "js")
    shutil.copyfile(REPO / "tests" / "lookup_fixture.mjs", tmp_path / "lookup_fixture.mjs")
    (tmp_path / "node_modules").symlink_to(web_packages(log=lambda *_: None))
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run(["node", str(tmp_path / "lookup_fixture.mjs"), str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_page_context_lookup_is_exact_greedy(tmp_path):
    """The page's Complete with lookup on (greedy) gives plain greedy decoding's tokens in fewer model calls, and its
    contextGuess is Python's context_guess, its promptEnd complete --truncate's prompt_end."""
    rng = np.random.default_rng(0)
    cases = [([1, 2, 3, 4, 1, 2, 3], 8), ([5, 6, 7, 5, 6], 2), ([1, 2, 3], 8), ([9, 1, 2, 9, 1, 2, 3, 9, 1], 8),
             ([4, 4, 4, 4], 3), ([], 8), ([1, 2, 3, 1, 2], 0)]
    sizes, lens = rng.integers(0, 30, 40), rng.integers(0, 9, 40)
    cases += [(rng.integers(0, 4, size=n).tolist(), int(m)) for n, m in zip(sizes, lens)]
    cycle = [3, 7, 1, 9, 4, 12, 2]  # the fixture's greedy successor of each token in the cycle
    nxt = list(range(16))
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        nxt[a] = b
    generations = [{"prompt": [3, 7, 1], "penalty": 1.0, "maxNew": 40}, {"prompt": [3, 7, 1, 9], "penalty": 1.2,
                   "maxNew": 40}, {"prompt": [5, 3, 7], "penalty": 1.0, "maxNew": 30}]
    cuts = [(n, max_len, new) for n in (1, 39, 40, 41, 300) for max_len in (40, 256) for new in (0, 1, 12, 64, 500)]
    out = page_lookup(tmp_path, {"guesses": cases, "generations": generations, "vocab": 16, "next": nxt,
                                 "max_seq_len": 48, "eos": None, "cuts": cuts})
    assert out["guesses"] == [context_guess(c, m) for c, m in cases]
    # the page's cut of a long prompt is complete --truncate's (it kept max_len - 1 tokens: room for one new token)
    assert out["cuts"] == [prompt_end(list(range(n)), max_len, new) for n, max_len, new in cuts]
    assert prompt_end(list(range(300)), 256, 64) == list(range(108, 300))
    for g, run in zip(generations, out["runs"]):
        plain, lookup = run["0"], run["8"]
        assert lookup["tokens"] == plain["tokens"] and len(plain["tokens"]) == g["maxNew"], run  # the same text
        assert plain["calls"] == g["maxNew"] - 1 and plain["fromContext"] == 0
        assert lookup["calls"] + lookup["fromContext"] == g["maxNew"] - 1  # each token: one call or one guess
        assert lookup["modelCalls"] == lookup["calls"] + 1  # + the prefill
    assert out["runs"][0]["8"]["fromContext"] > 20  # the cycle repeats: most tokens come from the context
    for g, run in zip(generations, out["runs"]):  # self-speculative rounds: the same text, the draft's misses corrected
        for lookup_len in (0, 8):
            r = run[f"draft{lookup_len}"]
            assert r["tokens"] == run["0"]["tokens"], (g, r)
            assert r["kvCalls"] == 1 and r["setCalls"] == r["calls"]  # the KV graph prefills, the set decodes
            assert r["accepted"] + r["rounds"] == g["maxNew"] - 1  # every round: its kept proposals + one token
            assert 0 < r["accepted"] < r["proposed"], r  # the fixture's draft is right, except at every 5th position
        assert run["draft8"]["fromContext"] > 0 and run["draft0"]["fromContext"] == 0
    assert out["runs"][0]["draft0"]["rounds"] < out["runs"][0]["0"]["calls"] / 2  # full-depth calls: verify rounds

    def follows_cycle(g, run):
        text = g["prompt"] + run["0"]["tokens"]
        return all(b == nxt[a] for a, b in zip(text[len(g["prompt"]) - 1:], text[len(g["prompt"]):]))

    assert follows_cycle(generations[0], out["runs"][0]) and not follows_cycle(generations[1], out["runs"][1])
