"""The Android app's plain-Java core (android_demo/app/src/main/java/org/hrmedge/core): compiled with the JDK,
its JUnit 4 tests run, and its numbers compared with Python's on the same files (web parity bundle metrics,
tokenizer ids). CI does not read JUnit's summary, so pytest parses it and fails on any failure or no tests."""
import json
import random
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from hrm_edge.io import sha256_file
from hrm_edge.runtime.decoders import Sampling, StepDecoder, generate
from hrm_edge.runtime.healing import heal_prompt, prompt_end, token_bytes
from hrm_edge.train.tokenizer import eos_id, load_tokenizer
from hrm_edge.verify.parity import load_bundle
from hrm_edge.verify.web_bundle import check_web_bundle, kv_logits, read_web_bundle, write_web_bundle
from test_cli_errors import assert_user_error
from test_demo import edit_manifest, fake_export
from test_healing import check_client_healing, healing_cases
from test_web_bundle import synthetic_export

APP = REPO / "android_demo" / "app" / "src"
JUNIT = [Path("/usr/share/java/junit4.jar"), Path("/usr/share/java/hamcrest-core.jar")]


@pytest.fixture(scope="module")
def classes(tmp_path_factory) -> Path:
    """The core and its tests compiled into one folder."""
    assert shutil.which("javac"), "javac not found: apt-get install default-jdk-headless (python -m hrm_edge.sysdeps does)"
    missing = [str(j) for j in JUNIT if not j.is_file()]
    assert not missing, f"{missing} missing: apt-get install junit4 (python -m hrm_edge.sysdeps does)"
    out = tmp_path_factory.mktemp("java_classes")
    sources = sorted(APP.glob("main/java/org/hrmedge/core/*.java")) + sorted(APP.glob("test/java/org/hrmedge/core/*.java"))
    proc = subprocess.run(["javac", "-Xlint:all", "-Werror", "-d", str(out), "-cp", ":".join(map(str, JUNIT)),
                           *map(str, sources)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def java(classes: Path, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(["java", "-cp", ":".join([str(classes), *map(str, JUNIT)]), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


CORE_CLASSES = ["ByteLevelBpe", "Completion", "Json", "Lookahead", "ParityMetrics", "Sampling", "TokenHealing",
                "WebBundle", "WordSuggester"]


def test_core_has_no_android_imports():
    sources = sorted(APP.glob("main/java/org/hrmedge/core/*.java"))
    assert [p.stem for p in sources] == CORE_CLASSES  # the glob sees the core (a moved folder fails here)
    for path in sources:
        imports = re.findall(r"^import\s+([\w.]+)", path.read_text(), re.M)
        assert all(i.startswith("java.") for i in imports), (path.name, imports)


def test_each_core_class_has_its_junit_test():
    tests = sorted(p.stem for p in APP.glob("test/java/org/hrmedge/core/*Test.java"))
    assert tests == [f"{name}Test" for name in CORE_CLASSES]


def test_junit_tests_pass(classes):
    test_files = sorted(APP.glob("test/java/org/hrmedge/core/*Test.java"))
    expected = sum(len(re.findall(r"@Test\b", p.read_text())) for p in test_files)
    proc = java(classes, "org.junit.runner.JUnitCore", *[f"org.hrmedge.core.{p.stem}" for p in test_files])
    ok = re.search(r"^OK \((\d+) tests?\)", proc.stdout, re.M)
    assert proc.returncode == 0 and ok, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert int(ok.group(1)) == expected >= 15, (ok.group(1), expected)  # every @Test ran, none skipped


def java_parity(classes, bundle: Path, logits: np.ndarray, precision: str, tmp_path: Path) -> dict:
    raw = tmp_path / f"logits.{precision}.f32"
    raw.write_bytes(np.ascontiguousarray(logits, dtype="<f4").tobytes())
    proc = java(classes, "org.hrmedge.core.CoreCli", "parity", bundle, raw, precision)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_same_metrics(got: dict, want: dict):
    assert got["passed"] == want["passed"], (got, want)
    assert got["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=1e-12)
    assert got["max_abs_logit_error"] == pytest.approx(want["max_abs_logit_error"], rel=1e-6, abs=1e-9)
    assert got["logit_range"] == pytest.approx(want["logit_range"], rel=1e-7)
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-9)
    assert got["reference_perplexity"] == pytest.approx(want["reference_perplexity"], rel=1e-9)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_java_metrics_equal_hrm_edge_parity(classes, tmp_path, precision):
    """A bundle written by hrm_edge.verify.web_bundle, and logits off by noise with a few flipped argmaxes."""
    manifest, bundle = synthetic_export(vocab=512)
    web = read_web_bundle(write_web_bundle(tmp_path, manifest, bundle))
    rng = np.random.default_rng(3)
    logits = web.logits + 0.02 * rng.standard_normal(web.logits.shape).astype(np.float32)
    logits[0, :3] = rng.standard_normal((3, 512)).astype(np.float32)  # three positions off entirely
    want = check_web_bundle(logits, web, precision)
    got = java_parity(classes, tmp_path / "web_bundle.bin", logits, precision, tmp_path)
    assert_same_metrics(got, want)
    assert 0.9 < got["top1_agreement"] < 1.0 and not got["passed"]  # the fixture really disagrees somewhere


def test_java_tokenizer_equals_python_tokenizers(classes, tmp_path):
    """The shipped model's tokenizer.json: the same ids as HF tokenizers, and the same decoded text, long words
    included."""
    path = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
    texts = [(REPO / "hrm_edge" / "runtime" / "decoders.py").read_text()[:3000], "import os\ndef ", "x = 'it''s'  \n\n\t  y",
             "naïve café — 日本語 😀 1234567 3.14", "<|bos|>start<|eos|>", "    return self._cache[key]  # héllo\r\n",
             # words of thousands of letters (a pasted key or hash is one word; ByteLevelBpe merges from a heap)
             "key = '" + "".join(random.Random(0).choices(string.ascii_letters, k=5000)) + "'",
             "a" * 5001 + " " + "ab" * 2500]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    proc = java(classes, "org.hrmedge.core.CoreCli", "tokenize", path, tmp_path / "texts.json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    tok = load_tokenizer(path)
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert json.loads(lines[2 * i]) == ids, text[:60]
        assert json.loads(lines[2 * i + 1]) == tok.decode(ids), text[:60]


def test_java_decodes_invalid_utf8_like_python(classes, tmp_path):
    """ByteLevelBpe.decode on byte tokens in any order (a model may emit them so): the same U+FFFD as HF tokenizers
    (one per maximal invalid subpart; the JDK's own decoder gives one for an encoded surrogate, Python three)."""
    path = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
    tok = load_tokenizer(path)
    byte_id = {b[0]: i for i, b in enumerate(token_bytes(tok)) if len(b) == 1}
    rng = random.Random(0)
    lead = [0xC0, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]
    cases = [b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe0\x80\x80", b"\xf0\x9f\x98", b"\xc0\xaf", "aé😀".encode()]
    cases += [bytes(rng.choice(lead + [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF]) for _ in range(rng.randint(1, 8)))
              for _ in range(400)]
    ids = [[byte_id[b] for b in case] for case in cases]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    proc = java(classes, "org.hrmedge.core.CoreCli", "decode", path, tmp_path / "ids.json")
    assert proc.returncode == 0, proc.stderr
    for case, line, row in zip(cases, proc.stdout.splitlines(), ids, strict=True):
        assert json.loads(line) == tok.decode(row) == case.decode("utf-8", "replace"), case


def typed_code(chars: int, backspaces: int) -> tuple[str, list[str]]:
    """(code, the texts of typing it): the first `chars` characters of suggest.py and a tail of spaces, CRLF, tabs
    and a special token, typed a key at a time, then `backspaces` deleted one at a time, then an edit at its start;
    then a line and a long comment typed, the cursor moved back to the end of the first line (the text before it is
    the kept start) and a word typed on there, where the line break was."""
    code = (REPO / "hrm_edge" / "runtime" / "suggest.py").read_text()[:chars]
    code += "x = 'é'  \r\n\ty = [1,\n    2]\n<|eos|>\n\n\ndef  f():\n"
    typed = [code[:i] for i in range(1, len(code) + 1)]
    typed += [code[:i] for i in range(len(code) - 1, len(code) - 1 - backspaces, -1)]
    lines = "import re\n" + "x = 1  # " + "a" * 70 + "\n"
    moved_back = [lines[:i] for i in range(1, len(lines) + 1)] + ["import re" + "turn"[:i] for i in range(5)]
    return code, typed + ["# a comment\n" + code] + moved_back


def test_java_encodes_the_end_of_a_typed_text(classes, tmp_path):
    """WordSuggester.KeptStartEncoder (the page's keptStartEncoder): code typed a key at a time, deleted and edited
    gives the ids of encoding each whole text, while it keeps a start of the text."""
    path = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
    code, typed = typed_code(1200, 149)
    (tmp_path / "texts.json").write_text(json.dumps(typed))
    proc = java(classes, "org.hrmedge.core.CoreCli", "typed", path, tmp_path / "texts.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok, kept = load_tokenizer(path), []
    for text, line in zip(typed, proc.stdout.splitlines(), strict=True):
        ids, chars = line.rsplit(" ", 1)
        assert json.loads(ids) == tok.encode(text, add_special_tokens=False).ids, text[-60:]
        kept.append(int(chars))
    assert max(kept) > len(code) - 200  # it kept most of the text (and its ids were right after the edit too)


def test_java_heals_and_penalises_like_python(classes, tmp_path):
    """TokenHealing and Sampling.penalizeRepetition on the shipped tokenizer: the same healed context, allowed first
    tokens and penalised logits (bit for bit) as hrm_edge.runtime.healing, on test_healing's cases."""
    path = REPO / "hrm_edge" / "default_model" / "tokenizer.json"
    tok = load_tokenizer(path)
    cases = healing_cases(tok)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = java(classes, "org.hrmedge.core.CoreCli", "heal", path, tmp_path / "cases.json")
    assert proc.returncode == 0, proc.stderr
    check_client_healing(proc.stdout, cases, token_bytes(tok))


def test_java_completes_like_python(classes, tmp_path):
    """The app's Complete (Completion.java) against hrm_edge.runtime.decoders.generate, greedy, on the hash fixture
    model (tests/test_keyboard.py) and the shipped tokenizer, with and without the repetition penalty: the same
    tokens and text, the text streamed without a U+FFFD, the prompt cut as complete --truncate and the page cut it
    (room for the tokens asked for: it left one), and
    healing (the first token starts with the bytes of the prompt's last one, which the text leaves out)."""
    # kept here: test_keyboard imports this module at its top (an import cycle)
    from test_keyboard import FIXTURE_MAX_SEQ_LEN, LONG, HashStepModel, TOKENIZER, printable_ids

    tok = load_tokenizer(TOKENIZER)
    allowed, vocab_bytes = printable_ids(tok), token_bytes(tok)
    cases = [{"text": text, "penalty": penalty} for text in ("import json\n\ndef load(path):\n", "def ", "x = fo",
                                                              "caf\u00e9 = ", LONG) for penalty in (1.0, 1.2)]
    job = {"vocab": tok.get_vocab_size(), "allowed": allowed, "max_seq_len": FIXTURE_MAX_SEQ_LEN,
           "eos": eos_id(tok), "max_new_tokens": 12, "cases": cases}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = java(classes, "org.hrmedge.core.CoreCli", "complete", TOKENIZER, tmp_path / "job.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    for case, out in zip(cases, got, strict=True):
        ids = prompt_end(tok.encode(case["text"], add_special_tokens=False).ids, FIXTURE_MAX_SEQ_LEN, 12)
        context, heal = heal_prompt(ids, vocab_bytes)
        decoder = StepDecoder(HashStepModel(allowed, tok.get_vocab_size()))
        g = generate(decoder, context, 12, Sampling(repetition_penalty=case["penalty"]), eos_id(tok), heal=heal)
        text = b"".join(vocab_bytes[t] for t in g.tokens)[len(heal.prefix) if heal else 0:].decode(errors="replace")
        assert out["tokens"] == g.tokens and out["text"] == text, (case, out, g.tokens, text)
        assert out["shown"][-1] == text and not any("\ufffd" in s for s in out["shown"]), out
        assert out["truncated"] == (case["text"] == LONG)
        assert out["stopped_at"] == ("EOS" if g.stopped_at_eos else "max length")  # (EOS: CompletionTest)
    assert any(a["tokens"] != b["tokens"] for a, b in zip(got[::2], got[1::2]))  # the penalty changed something


@pytest.mark.slow
def test_java_metrics_on_a_real_int8_artifact(classes, tiny_export, tmp_path):
    """A web bundle from a real export (the suite's shared tiny export) and the logits its full-depth int8 KV
    graph gives in onnxruntime. Java's numbers are compared with Python's on whatever that graph computes, so
    the artifact's own parity verdict does not matter here."""
    manifest = json.loads((tiny_export / "manifest.json").read_text())
    path = write_web_bundle(tmp_path, manifest, load_bundle(tiny_export / manifest["parity_bundle"]["path"]))
    web = read_web_bundle(path)
    art = next(a for a in manifest["artifacts"] if a["program"] == "kv_cache" and a["format"] == "onnx"
               and a["precision"] == "int8" and a.get("cycles") is None)
    logits = kv_logits(tiny_export / art["path"], web)
    want = check_web_bundle(logits, web, "int8")
    got = java_parity(classes, path, logits, "int8", tmp_path)
    assert_same_metrics(got, want)


def test_copy_artifacts_into_the_app(tmp_path):
    """android_demo/copy_artifacts.py: the int8 KV .pte, tokenizer.json, a web bundle and program.json (its precision,
    for the Self-test's tolerances), sha256-checked; a program that failed the parity gate is refused (it was
    copied: the app shipped what the export had refused)."""
    root = fake_export(tmp_path / "e")
    script = REPO / "android_demo" / "copy_artifacts.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), *map(str, a)], capture_output=True, text=True,
                                    timeout=120)
    assert_user_error(run(root, "--assets", tmp_path / "assets"), "no int8 KV-cache .pte")
    (root / "hrm.int8.kv.pte").write_bytes(b"a program")
    pte = {"path": "hrm.int8.kv.pte", "format": "pte", "runtime": "executorch", "iteration": "unrolled",
           "precision": "int8", "program": "kv_cache", "bytes": 9,
           "sha256": sha256_file(root / "hrm.int8.kv.pte"), "parity": {"x86_64": {"passed": False}}}
    edit_manifest(root, lambda m: m["artifacts"].append(pte))
    assert_user_error(run(root, "--assets", tmp_path / "assets"), "hrm.int8.kv.pte did not pass the export's parity")
    assert not (tmp_path / "assets").exists()
    edit_manifest(root, lambda m: m["artifacts"][-1]["parity"]["x86_64"].update(passed=True))
    proc = run(root, "--assets", tmp_path / "assets")
    assert proc.returncode == 0, proc.stderr
    assets = tmp_path / "assets"
    assert (assets / "hrm.kv.pte").read_bytes() == b"a program"
    assert json.loads((assets / "program.json").read_text())["precision"] == "int8"
    assert (assets / "tokenizer.json").read_bytes() == (root / "tokenizer.json").read_bytes()
    assert read_web_bundle(assets / "web_bundle.bin").header["prefill_len"] == 4
    (root / "hrm.int8.kv.pte").write_bytes(b"b program")
    assert_user_error(run(root, "--assets", tmp_path / "assets"), "hrm.int8.kv.pte does not match the sha256")
