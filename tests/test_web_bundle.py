"""The web parity bundle: format, size, determinism, and that it checks what the parity gate checks."""
import json

import numpy as np
import pytest

from hrm_edge.errors import UserError
from hrm_edge.verify.parity import FP32_TOLERANCE, Tolerance, compare
from hrm_edge.verify.web_bundle import MAX_BYTES, check_web_bundle, read_web_bundle, web_bundle_bytes, write_web_bundle


def synthetic_export(vocab=512, windows=8, seq=128, prefill=32, seed=0):
    """A manifest and parity bundle with the fields write_web_bundle reads (random numbers, real shapes)."""
    rng = np.random.default_rng(seed)
    bundle = {"windows": rng.integers(0, vocab, (windows, seq + 1)).astype(np.int64),
              "fp32_logits": (3 * rng.standard_normal((windows, seq, vocab))).astype(np.float32)}
    manifest = {
        "artifacts": [{"path": "m.kv.onnx", "program": "kv_cache", "format": "onnx", "precision": "fp32",
                       "prefill_len": prefill},
                      {"path": "m.onnx", "program": "full_sequence", "format": "onnx", "precision": "fp32"}],
        "tolerances": {"fp32_vs_fp32_eager": {"rel_max_abs": 1e-4, "min_top1": 0.999, "max_ppl_ratio": 1.001},
                       "int8_vs_int8_reference": {"rel_max_abs": 1e-2, "min_top1": 0.99, "max_ppl_ratio": 1.005},
                       "int8_vs_fp32_eager": {"rel_max_abs": 5e-2, "min_top1": 0.97, "max_ppl_ratio": 1.02},
                       "int4_vs_fp32_eager": {"rel_max_abs": 0.1, "min_top1": 0.85, "max_ppl_ratio": 1.1}},
        "parity_bundle": {"sha256": "ab" * 32}, "tokenizer": {"sha256": "cd" * 32},
    }
    return manifest, bundle


def test_round_trip_keeps_windows_logits_and_tolerances(tmp_path):
    manifest, bundle = synthetic_export()
    web = read_web_bundle(write_web_bundle(tmp_path, manifest, bundle))
    n, s = web.header["samples"], web.header["seq_len"]
    assert (n, s, web.prefill_len) == (3, 32 + 8, 32)
    assert web.logits.shape == (3, 40, 512)
    np.testing.assert_array_equal(web.windows, bundle["windows"][:3, :41])
    np.testing.assert_array_equal(web.logits, bundle["fp32_logits"][:3, :40])  # bit-exact float32
    assert web.tolerance("fp32") == FP32_TOLERANCE
    assert web.tolerance("int8") == Tolerance(5e-2, 0.97, 1.02)
    assert web.tolerance("int4") == Tolerance(0.1, 0.85, 1.1)  # the int4 program's own bounds (int8's failed it)
    assert web.header["logits_offset"] % 4 == 0  # a Float32Array view needs 4-byte alignment


def test_a_cut_or_edited_bundle_is_one_clear_error(tmp_path):
    """Cut short, its windows or sizes edited: a UserError that says what does not fit, not an IndexError later
    (WebBundle.java refuses the same; its test covers a cut file)."""
    manifest, bundle = synthetic_export()
    path = write_web_bundle(tmp_path, manifest, bundle)
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    with pytest.raises(UserError, match="cut short or edited"):
        read_web_bundle(path)
    n_header = int.from_bytes(good[8:12], "little")
    header = json.loads(good[12:12 + n_header])
    for edit, needle in [({"windows": header["windows"][:2]}, "windows must be 3 rows of 41 token ids below 512"),
                         ({"prefill_len": 41}, "prefill_len in 1..seq_len"), ({"seq_len": 0}, "must be >= 1")]:
        text = json.dumps(header | edit, sort_keys=True, separators=(",", ":")).encode()
        text += b" " * (n_header - len(text))  # the same length, so the logits stay where they were
        path.write_bytes(good[:12] + text + good[12 + n_header:])
        with pytest.raises(UserError, match=needle):
            read_web_bundle(path)


def test_bytes_are_deterministic_and_size_capped():
    manifest, bundle = synthetic_export(vocab=4096)  # the default model's vocabulary
    data = web_bundle_bytes(manifest, bundle)
    assert data == web_bundle_bytes(manifest, bundle)
    assert len(data) <= MAX_BYTES
    # fewer windows are kept rather than passing the cap
    small = web_bundle_bytes(manifest, bundle, max_bytes=(32 + 8) * 4096 * 4 * 2 + 1)
    assert 2 * 40 * 4096 * 4 < len(small) < 3 * 40 * 4096 * 4


def test_check_matches_parity_compare(tmp_path):
    manifest, bundle = synthetic_export()
    web = read_web_bundle(write_web_bundle(tmp_path, manifest, bundle))
    noisy = web.logits + 1e-3 * np.random.default_rng(1).standard_normal(web.logits.shape).astype(np.float32)
    got = check_web_bundle(noisy, web, "fp32")
    want = compare(noisy, web.logits, web.windows[:, 1:], FP32_TOLERANCE, "x")
    for key in ("max_abs_logit_error", "top1_agreement", "perplexity", "reference_perplexity", "passed"):
        assert got[key] == want[key]
    assert not got["passed"] and "max abs" in got["reason"]  # 1e-3 noise on a range ~30 > 1e-4 x range
    assert check_web_bundle(web.logits, web, "fp32")["passed"]


def test_not_a_bundle(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"not a bundle at all")
    with pytest.raises(UserError, match="not a web parity bundle"):
        read_web_bundle(tmp_path / "x.bin")


def test_no_kv_artifact_is_a_user_error():
    manifest, bundle = synthetic_export()
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["program"] != "kv_cache"]
    with pytest.raises(UserError, match="no KV-cache artifact"):
        web_bundle_bytes(manifest, bundle)
