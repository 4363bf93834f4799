"""Token healing and the repetition penalty (hrm_edge.runtime.healing) in generate, generate_speculative and
complete: the mask on the first token, the stripped text, the penalty's arithmetic, speculative greedy equal to
plain greedy under the penalty, and (slow) the issue's must-show on a default export of the shipped model."""
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from conftest import REPO, run_module
from hrm_edge.app.complete import TextStream, parser
from hrm_edge.measure.repetition import header_prompts, line_repeats, ngram_repeats, parse_penalties
from hrm_edge.model.eager import EagerDecoder, EagerSpeculativeDecoder
from hrm_edge.runtime.decoders import Sampling, generate
from hrm_edge.runtime.healing import (DEFAULT_REPETITION_PENALTY, Heal, heal_prompt, penalize_repetition, shape_logits,
                                     token_bytes)
from hrm_edge.runtime.speculative import RoundPlan, accept_greedy, generate_speculative
from hrm_edge.train.tokenizer import load_tokenizer
from test_speculative import code_prompt, shipped, tiny_model

TOKENIZER = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
MUST_SHOW = "import json\n\ndef load(path):\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def vocab_bytes(tok):
    return token_bytes(tok)


def test_token_bytes_spell_what_the_tokenizer_decodes(tok, vocab_bytes):
    assert len(vocab_bytes) == tok.get_vocab_size() == 4096
    assert vocab_bytes[0] == vocab_bytes[1] == b""  # <|bos|>, <|eos|>: no text
    ids = tok.encode("def f(x):\n    return 'naïve 😀'\n").ids
    assert b"".join(vocab_bytes[i] for i in ids).decode() == tok.decode(ids)
    for i in range(2, 4096, 97):  # every 97th token: ASCII ones decode alone to the same text
        if vocab_bytes[i].isascii():
            assert vocab_bytes[i].decode() == tok.decode([i]), i


def test_healing_a_line_end_allows_the_indented_line_ends(tok, vocab_bytes):
    ids = tok.encode(MUST_SHOW).ids
    context, heal = heal_prompt(ids, vocab_bytes)
    assert context == ids[:-1] and heal.prefix == b"\n" and vocab_bytes[ids[-1]] == b"\n"
    allowed = {tok.decode([i]) for i in np.flatnonzero(heal.allowed)}
    assert allowed == {tok.decode([i]) for i in range(2, 4096) if tok.decode([i]).startswith("\n")}
    assert {"\n", "\n    ", "\n\n"} <= allowed and " " not in allowed and "import" not in allowed
    assert not heal.allowed[0] and not heal.allowed[1]  # EOS cannot re-spell a line end


def test_healing_works_on_bytes_of_a_split_character(tok, vocab_bytes):
    """An emoji the vocabulary lacks is several byte tokens: the last one is not UTF-8 by itself."""
    ids = tok.encode("x = '😀").ids
    last = vocab_bytes[ids[-1]]
    with pytest.raises(UnicodeDecodeError):
        last.decode()
    context, heal = heal_prompt(ids, vocab_bytes)
    assert heal.prefix == last and heal.allowed[ids[-1]]
    assert all(vocab_bytes[i].startswith(last) for i in np.flatnonzero(heal.allowed))


def test_no_healing_of_one_token_or_a_special_token(vocab_bytes):
    assert heal_prompt([300], vocab_bytes) == ([300], None)
    assert heal_prompt([300, 1], vocab_bytes) == ([300, 1], None)


def test_the_stream_strips_the_healed_bytes(tok, vocab_bytes):
    """The healed first token re-spells the removed text; only what follows it is written, also when the
    removed bytes are half a character."""
    heal_ids = tok.encode("\n    return x").ids
    pieces = []
    stream = TextStream(vocab_bytes, pieces.append, skip=1)
    for t in heal_ids:
        stream.add(t)
    stream.finish()
    assert "".join(pieces) == "    return x"
    # a prompt ending inside a character: the healed first token re-spells its last byte, then "!" follows
    context, heal = heal_prompt(tok.encode("x = '😀").ids, vocab_bytes)
    new = [tok.encode("x = '😀").ids[-1]] + tok.encode("!").ids
    pieces = []
    stream = TextStream(vocab_bytes, pieces.append, skip=len(heal.prefix))
    for t in new:
        stream.add(t)
    stream.finish()
    assert "".join(pieces) == "!" and len(heal.prefix) == 1


def test_penalty_arithmetic():
    """Hugging Face's rule, by hand: ids 0, 1, 4 are in the context (1 twice: once is enough)."""
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    got = penalize_repetition(logits, [0, 1, 1, 4], 2.0)
    assert got.dtype == np.float64 and got.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    got = penalize_repetition(logits, [3, 1], 1.3)
    np.testing.assert_allclose(got, [2.0, -1.3, 0.5, 2.3076923076923075, 0.0], rtol=1e-15)
    assert penalize_repetition(logits, [0, 3], 1.0).tolist() == logits.tolist()  # 1: off
    heal = Heal(b"x", np.array([True, False, True, True, False]))
    z = shape_logits(logits, [3], 2.0, heal)
    assert z.tolist() == [2.0, -np.inf, 0.5, 1.5, -np.inf] and int(np.argmax(z)) == 0


def test_generate_takes_the_first_token_from_the_allowed_set():
    """A random tiny model: the first token is the argmax of the allowed logits (the prefill's), later ones free."""
    model = tiny_model()
    prompt = [3, 17, 5]
    logits = EagerDecoder(model).prefill(np.array(prompt))[-1]
    allowed = np.zeros(64, bool)
    allowed[[9, 40, 41]] = True
    g = generate(EagerDecoder(model), prompt, 6, heal=Heal(b"?", allowed))
    assert g.tokens[0] == [9, 40, 41][int(np.argmax(logits[[9, 40, 41]]))] and g.prompt_len == 3
    plain = generate(EagerDecoder(model), prompt, 6)
    assert plain.tokens[0] == int(np.argmax(logits)) and not allowed[plain.tokens[0]]  # the mask changed it
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 6, heal=Heal(b"?", allowed))
    assert spec.tokens == g.tokens


def test_greedy_with_a_penalty_reference_loop():
    """generate's greedy tokens equal a hand-written loop: full logits of the whole sequence, penalty over it."""
    model = tiny_model(1)
    prompt, want = [4, 8, 15], []
    for _ in range(12):
        seq = prompt + want
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1].numpy()
        z = logits.astype(np.float64)
        for i in set(seq):
            z[i] = z[i] / 3 if z[i] > 0 else z[i] * 3
        want.append(int(np.argmax(z)))
    got = generate(EagerDecoder(model), prompt, 12, Sampling(repetition_penalty=3.0)).tokens
    assert got == want and len(set(want)) > 3  # the unpenalised random model repeats one token
    assert len(set(generate(EagerDecoder(model), prompt, 12).tokens)) <= 2


def test_accept_greedy_penalises_each_position_with_its_own_prefix():
    full = np.array([[0.0, 2.0, 1.9], [0.0, 2.0, 1.9], [0.0, 2.0, 1.9]])  # argmax 1 everywhere
    assert accept_greedy(full, [1, 1]) == [1, 1, 1]
    # position 1 sees proposal 1 in its prefix: 2 / 1.1 < 1.9, corrected to 2
    assert accept_greedy(full, [1, 1], [], 1.1) == [1, 2]
    # context [1]: position 0 gives 2; positions 1 and 2 see proposal 2 too (1.9 / 1.1 < 2 / 1.1): 1, 1
    assert accept_greedy(full, [2, 1], [1], 1.1) == [2, 1, 1]


@pytest.mark.parametrize("penalty, draft_len, start", [(1.2, 2, 900), (1.5, 4, 1800)])
def test_speculative_greedy_equals_plain_greedy_with_a_penalty(penalty, draft_len, start):
    model, prompt = shipped()[0], code_prompt(start)
    s = Sampling(repetition_penalty=penalty)
    full = generate(EagerDecoder(model), prompt, 48, s)
    spec = generate_speculative(EagerSpeculativeDecoder(model), prompt, 48, s, plan=RoundPlan(draft_len))
    assert spec.tokens == full.tokens and len(full.tokens) == 48
    assert full.tokens != generate(EagerDecoder(model), prompt, 48).tokens  # the penalty changed the text
    assert 0 < spec.accepted < spec.proposed


def test_speculative_sampling_with_a_penalty_runs_to_the_budget():
    g = generate_speculative(EagerSpeculativeDecoder(tiny_model()), [3, 17, 5], 40,
                             Sampling(temperature=0.8, seed=3, repetition_penalty=1.3))
    assert len(g.tokens) == 40 and len(set(g.tokens)) > 10


CASE_TEXTS = [MUST_SHOW, "x = '😀", "def ", "a", "import os\n<|eos|>", "    return self._cache[key]  # héllo"]


def healing_cases(tok) -> list[dict]:
    """Prompts and logits that Python, the page (Node) and the Android core (Java) must shape the same way: each
    text's ids, random float32 logits, a few generated ids, a penalty."""
    rng = np.random.default_rng(5)
    return [{"text": text, "ids": tok.encode(text).ids, "penalty": penalty,
             "logits": (3 * rng.standard_normal(4096)).astype(np.float32).tolist(),
             "generated": rng.integers(0, 4096, size=i).tolist()}
            for i, (text, penalty) in enumerate(zip(CASE_TEXTS, [1.3, 1.0, 2.0, 1.15, 1.2, 1.05]))]


def python_healing(case: dict, vocab_bytes) -> tuple[list, list, list]:
    """(healed context, allowed first-token ids, the penalised logits' raw bits): what the other clients print."""
    context, heal = heal_prompt(case["ids"], vocab_bytes)
    allowed = np.flatnonzero(heal.allowed).tolist() if heal else []
    z = penalize_repetition(np.array(case["logits"], np.float32), context + case["generated"], case["penalty"])
    return context, allowed, z.view(np.int64).tolist()


def check_client_healing(stdout: str, cases: list[dict], vocab_bytes) -> None:
    lines = stdout.splitlines()
    assert len(lines) == 3 * len(cases), stdout[-2000:]
    for i, case in enumerate(cases):
        context, allowed, bits = python_healing(case, vocab_bytes)
        assert json.loads(lines[3 * i]) == context, case["text"]
        assert json.loads(lines[3 * i + 1]) == allowed, case["text"]
        assert json.loads(lines[3 * i + 2]) == bits, case["text"]  # the same doubles, bit for bit
    assert any(c["penalty"] != 1 and len(python_healing(c, vocab_bytes)[1]) > 1 for c in cases)


NODE_HEALING = """
import { readFileSync } from "node:fs";
import { healPrompt, penalizeRepetition, tokenBytes } from "%s";
const vocabBytes = tokenBytes(JSON.parse(readFileSync(process.argv[2], "utf8")));
for (const c of JSON.parse(readFileSync(process.argv[3], "utf8"))) {
  const { context, heal } = healPrompt(c.ids, vocabBytes);
  const allowed = heal ? [...heal.allowed.keys()].filter((i) => heal.allowed[i]) : [];
  const z = penalizeRepetition(Float32Array.from(c.logits), context.concat(c.generated), c.penalty);
  console.log(JSON.stringify(context));
  console.log(JSON.stringify(allowed));
  console.log("[" + Array.from(new BigInt64Array(z.buffer), String).join(",") + "]");
}
"""


def test_the_page_heals_and_penalises_like_python(tok, vocab_bytes, tmp_path):
    """hrm_edge/app/web/js/healing.mjs in Node on the same prompts and logits: the same context, allowed set and
    penalised logits (bit for bit) as hrm_edge.runtime.healing."""
    assert shutil.which("node"), "node not found"
    cases = healing_cases(tok)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = tmp_path / "heal.mjs"
    script.write_text(NODE_HEALING % (REPO / "hrm_edge" / "app" / "web" / "js" / "healing.mjs").as_uri())
    proc = subprocess.run(["node", str(script), str(TOKENIZER), str(tmp_path / "cases.json")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_client_healing(proc.stdout, cases, vocab_bytes)


def test_every_client_defaults_to_the_measured_penalty():
    html = (REPO / "hrm_edge" / "app" / "web" / "index.html").read_text()
    page = re.search(r'<input id="repetition"[^>]* value="([^"]+)"', html).group(1)
    java = (REPO / "android_demo" / "app" / "src" / "main" / "java" / "org" / "hrmedge" / "core"
            / "Sampling.java").read_text()
    core = re.search(r"DEFAULT_REPETITION_PENALTY = ([\d.]+);", java).group(1)
    cli = parser().parse_args(["x"]).repetition_penalty
    assert float(page) == float(core) == cli == DEFAULT_REPETITION_PENALTY > 1


def test_repeat_counts():
    assert ngram_repeats([1, 2, 3, 4, 1, 2, 3, 4, 1]) == (2, 6)  # (1,2,3,4) and (2,3,4,1) come back once each
    assert ngram_repeats([1, 2, 3]) == (0, 0)
    assert line_repeats("a = 1\n  a = 1\n\nb\na = 1") == (1, 3)  # the unfinished last line does not count
    text = "import os\n" + "x = 1\n" * 150 + "def load(path):\n    return path\nclass A:\n"
    (p,) = header_prompts(text, 5)[:1]
    assert p.text.endswith("def load(path):\n") and p.truth.startswith("    return path")
    assert len(p.text.encode()) <= 600 and p.text.startswith("x = 1\n")  # whole lines of the last 600 bytes
    assert [q.text[-9:] for q in header_prompts(text, 5)] == ["f load(path):\n"[-9:], "class A:\n"]
    assert parse_penalties("1,1.1,1.25") == [1.0, 1.1, 1.25]
    for bad in ("", "0.9", "1,x", "11"):
        with pytest.raises(ValueError):
            parse_penalties(bad)


def body_after_def_load(export_dir, runtime: str, *extra) -> str:
    proc = run_module("hrm_edge.complete", "--artifacts", export_dir, "--runtime", runtime, "--temperature", "0",
                      "--max-new-tokens", "24", *extra, MUST_SHOW)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(MUST_SHOW)
    return proc.stdout[len(MUST_SHOW):].rsplit("\n", 2)[0]  # less the stats line


@pytest.mark.slow
def test_complete_continues_a_def_line_with_its_body(default_export):
    """Issue 23's must-show: after "def load(path):\\n" greedy completion is the function's indented body in every
    runtime (unhealed, the shipped model starts a new top-level statement), the same text in each."""
    texts = {rt: body_after_def_load(default_export, rt) for rt in ("eager", "onnx", "executorch")}
    assert texts["eager"][:1] in (" ", "\t") and texts["eager"].strip(), texts
    assert texts["onnx"] == texts["eager"] and texts["executorch"] == texts["eager"], texts
    assert body_after_def_load(default_export, "onnx", "--speculative") == texts["onnx"]
    unhealed = body_after_def_load(default_export, "onnx", "--no-heal", "--repetition-penalty", "1")
    assert unhealed[:1] not in (" ", "\t"), unhealed
