import sysconfig
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from hrm_edge.export.calibrate import BLOCK_LINEARS, activation_ranges, make_calibration_set
from hrm_edge.export.onnx import export_onnx_decode, quantize_nbits
from hrm_edge.export.onnx_passes import loop_and_body, step_op_counts
from hrm_edge.config import DataConfig, ModelConfig
from hrm_edge.errors import UserError
from hrm_edge.model.lm import HRMLM
from hrm_edge.export.quantize import (activation_qparams, dynamic_quantization, fake_quant_activation, nbits_reference,
                                     parse_linear_names, pt2e_quantization, static_int8_names, static_int8_reference,
                                     static_onnx_quantization, static_plan, table_qparams, weight_qparams)
from hrm_edge.runtime.decoders import OnnxDecoder, decode_logits
from hrm_edge.train.dataset import encode_documents, load_corpus
from hrm_edge.train.tokenizer import train_tokenizer
from hrm_edge.verify.reference import eager_logits


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = Path(sysconfig.get_paths()["stdlib"])
    return train_tokenizer([(root / n).read_text() for n in ("textwrap.py", "string.py")], 300)


def test_calibration_set_is_deterministic(tok, text_corpus):
    cfg = DataConfig(corpus=str(text_corpus))
    a, rec_a = make_calibration_set(tok, cfg, samples=6, seq_len=32, seed=7)
    b, rec_b = make_calibration_set(tok, cfg, samples=6, seq_len=32, seed=7)
    c, rec_c = make_calibration_set(tok, cfg, samples=6, seq_len=32, seed=8)
    assert rec_a.tokens_sha256 == rec_b.tokens_sha256 and np.array_equal(a, b)
    assert rec_a.tokens_sha256 != rec_c.tokens_sha256
    assert a.shape == (6, 32) and rec_a.split == "calib" and rec_a.token_count == 192


def test_calibration_never_uses_validation_text(tok, text_corpus):
    cfg = DataConfig(corpus=str(text_corpus))
    windows, _ = make_calibration_set(tok, cfg, samples=20, seq_len=16, seed=0)
    calib_stream = encode_documents(tok, load_corpus(cfg).calib)
    joined = calib_stream.tobytes()
    for w in windows:
        assert w.astype(np.int32).tobytes() in joined  # every window is a slice of the calibration split


def test_a_calibration_corpus_leaves_out_the_parity_splits_documents(tok, text_corpus):
    """--calib-corpus of the export's own corpus calibrated on its validation split too, where the gate's windows
    come from: those documents are left out, and the record says so."""
    cfg = DataConfig(corpus=str(text_corpus))
    val = load_corpus(cfg).val
    windows, record = make_calibration_set(tok, cfg, samples=40, seq_len=16, seed=0, calib_corpus=str(text_corpus))
    assert record.split == f"all but {len(val)} texts within or holding validation documents"
    val_stream = encode_documents(tok, val).tobytes()
    assert not any(w.astype(np.int32).tobytes() in val_stream for w in windows)


def test_a_calibration_corpus_cut_into_pieces_leaves_out_validation_text(tok, text_corpus, tmp_path):
    """A calibration folder of few files is cut into pieces, which never equal a validation document: validation text
    given that way was calibrated on (every validation text as a file of its own: none left out). Pieces within or
    holding a validation text are left out now."""
    cfg = DataConfig(corpus=str(text_corpus))
    val = load_corpus(cfg).val
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, text in enumerate(val):
        (calib / f"val{i}.py").write_text(text)
    with pytest.raises(UserError, match="holds no text outside the validation documents"):
        make_calibration_set(tok, cfg, 8, 16, 0, calib_corpus=str(calib))
    for i in range(20):
        (calib / f"other{i}.py").write_text(f"value_{i} = {i} * width\n" * 40)
    windows, record = make_calibration_set(tok, cfg, 40, 16, 0, calib_corpus=str(calib))
    assert record.split.startswith("all but ") and record.split.endswith(" texts within or holding validation documents")
    val_stream = encode_documents(tok, val).tobytes()
    assert not any(w.astype(np.int32).tobytes() in val_stream for w in windows)


def test_empty_or_short_calibration_corpus_is_a_clear_error(tok, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("\n\n")
    with pytest.raises(UserError, match="empty"):
        make_calibration_set(tok, DataConfig(), 4, 32, 0, calib_corpus=str(empty))
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    with pytest.raises(UserError, match="too short"):
        make_calibration_set(tok, DataConfig(), 4, 32, 0, calib_corpus=str(short))


def test_qparams_round_trip():
    scale, zp = activation_qparams(np.array([-1.0, -0.5]), np.array([3.0, 0.5]))
    assert scale.dtype == np.float32 and zp.dtype == np.int8
    x = torch.linspace(-1, 3, 1000)
    err = (fake_quant_activation(x, float(scale[0]), int(zp[0])) - x).abs().max().item()
    assert err <= scale[0] / 2 + 1e-6
    assert fake_quant_activation(torch.zeros(1), float(scale[1]), int(zp[1])).item() == 0.0  # zero is exact
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    q, s = weight_qparams(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert np.abs(q * s[:, None] - w).max() <= s.max() / 2 + 1e-6


def test_static_reference_per_step_scales_are_used():
    """Per-step scales change the result only through the step they belong to."""
    torch.manual_seed(0)
    model = HRMLM(ModelConfig(vocab_size=97, d_model=32, n_heads=4, max_seq_len=32, H_cycles=2, L_cycles=1)).eval()
    windows = np.random.default_rng(0).integers(0, 97, size=(4, 16))
    ranges = activation_ranges(model, windows)
    assert len(ranges["linears"]["attn.wq"]["max"]) == model.cfg.n_steps
    tokens = torch.from_numpy(windows)
    per_step, shared = static_plan(model, ranges, True), static_plan(model, ranges, False)
    for name in BLOCK_LINEARS:  # shared: one value over all steps, covering every step's range
        assert np.all(shared.act_scale[name] == shared.act_scale[name][0])
        assert np.all(shared.act_scale[name] >= per_step.act_scale[name] - 1e-9)
    with torch.no_grad():
        fp32 = model(tokens)
        a = static_int8_reference(model, per_step)(tokens)
        b = static_int8_reference(model, shared)(tokens)
    assert 0 < (a - fp32).abs().max() < 0.1 * fp32.abs().max()
    assert not torch.equal(a, b)


def test_table_qparams_column_equalization():
    """The tied table's int8 form (per-row x per-column scales) reconstructs a table with a few large
    columns better than per-row scales alone, and stays int8 with |q| <= 127."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 16)) * np.where(np.arange(16) < 2, 8.0, 1.0)).astype(np.float32)
    q, row, col = table_qparams(w)
    assert q.dtype == np.int8 and np.abs(q).max() <= 127 and row.shape == (64,) and col.shape == (16,)
    err_eq = np.square(q * row[:, None] * col[None, :] - w).sum()
    q0, s0 = weight_qparams(w)
    err_rows = np.square(q0 * s0[:, None] - w).sum()
    assert err_eq < 0.5 * err_rows


def test_static_plan_keeps_named_linears_fp32():
    torch.manual_seed(0)
    model = HRMLM(ModelConfig(vocab_size=97, d_model=32, n_heads=4, max_seq_len=32, H_cycles=1, L_cycles=1)).eval()
    windows = np.random.default_rng(0).integers(0, 97, size=(2, 16))
    plan = static_plan(model, activation_ranges(model, windows), True, parse_linear_names("ffn.w_down"))
    assert "ffn.w_down" not in plan.weight_q and "ffn.w_down" not in plan.int8_linears
    assert "block.ffn.w_down.weight" not in static_int8_names(plan)
    ref = static_int8_reference(model, plan)
    assert torch.equal(ref.block.ffn.w_down.weight, model.block.ffn.w_down.weight)  # fp32, untouched
    assert not torch.equal(ref.block.ffn.w_up.weight, model.block.ffn.w_up.weight)  # int8-rounded
    with pytest.raises(UserError, match="unknown block linear"):
        parse_linear_names("ffn.w_dwn")


def test_quantization_records_describe_each_mode():
    """The manifest's description of each int8 mode (one definition per mode, in quantize.py)."""
    torch.manual_seed(0)
    model = HRMLM(ModelConfig(vocab_size=97, d_model=32, n_heads=4, max_seq_len=32, H_cycles=1, L_cycles=1)).eval()
    ranges = activation_ranges(model, np.random.default_rng(0).integers(0, 97, size=(2, 16)))
    per_step = static_onnx_quantization(static_plan(model, ranges, True, ("ffn.w_down",)), "abc")
    assert per_step["mode"] == "static" and per_step["activation_scales"] == "per_step"
    assert per_step["fp32"] == "gates, attention scores, ffn.w_down" and "ffn.w_down" not in per_step["weights"]
    assert per_step["calibration_sha256"] == "abc"
    shared = static_onnx_quantization(static_plan(model, ranges, False), "abc")
    assert shared["activation_scales"] == "shared" and shared["fp32"] == "gates, attention scores"
    assert dynamic_quantization()["mode"] == "dynamic" and dynamic_quantization()["calibration_sha256"] is None
    assert pt2e_quantization("abc")["mode"] == "static" and pt2e_quantization("abc")["calibration_sha256"] == "abc"


def test_nbits_graph_has_no_float_block_weights_and_computes_its_reference(tmp_path):
    """A tiny model's fp32 KV graph rewritten with 8-bit and 4-bit MatMulNBits: in the Loop body the only float
    matrix MatMul with a constant weight left is RoPE's rotation (and the gates' batched ones, fp32 by design), the
    block linears (those reading one input as one node) and the head are MatMulNBits, the
    float table is gone; prefill + decode with the graph computes the eager nbits reference (float rounding and
    the kernel's run-time rounding apart), and 4-bit weights move the logits further from fp32 than 8-bit ones."""
    torch.manual_seed(0)  # vocabulary and width large enough that the exporter keeps the tied head's Transpose
    cfg = ModelConfig(vocab_size=512, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=32, H_cycles=2, L_cycles=1)
    model = HRMLM(cfg).eval()
    fp32_path = export_onnx_decode(model, tmp_path / "hrm.fp32.kv.onnx")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 16))
    fp32 = eager_logits(model, tokens)
    logit_range = fp32.max() - fp32.min()
    vs_fp32 = {}
    for bits, block in ((8, 32), (4, 16)):
        path, weights = quantize_nbits(fp32_path, tmp_path / f"hrm.int{bits}-nbits.kv.onnx", model, bits, block)
        proto = onnx.load(str(path))
        # the IR version opset 23 came with (torch wrote 10), kept through the rewrite: "com.microsoft" adds none
        assert proto.ir_version == onnx.load(str(fp32_path)).ir_version == 11
        _, body = loop_and_body(proto.graph)
        body_weights = {i.name: onnx.numpy_helper.to_array(i) for i in body.initializer}
        float_matmuls = [body_weights[n.input[1]] for n in body.node if n.op_type == "MatMul" and n.input[1] in body_weights]
        matrices = [w for w in float_matmuls if w.ndim == 2]  # (the rest: both gates' stacked [2, 1, ., .] weights)
        assert len(matrices) == 1 and np.array_equal(matrices[0], model.block.attn.rot.numpy().T)
        assert all(w.ndim == 4 and w.shape[0] == 2 for w in float_matmuls if w.ndim != 2)
        # per application wq+wk+wv, wo, w_gate+w_up and w_down (linears that read one input: one node); the head
        assert step_op_counts(proto.graph, cfg.n_steps)["MatMulNBits"] == 4 * cfg.n_steps + 1
        assert not [i.name for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
                    and np.prod(i.dims) == cfg.vocab_size * cfg.d_model], "the float table is gone"
        assert sorted(weights) == sorted([f"block.{n}.weight" for n in BLOCK_LINEARS] + ["embed.weight"])
        got = decode_logits(OnnxDecoder(path, threads=1), tokens, prefill_len=4)
        reference = eager_logits(nbits_reference(model, weights, block), tokens)
        # measured 2e-7 to 2e-6 x range; a reference without the kernel's input rounding is 3e-3 to 4e-3 away
        assert np.abs(got - reference).max() < 1e-4 * logit_range
        vs_fp32[bits] = np.abs(got - fp32).max()
    assert 0 < vs_fp32[8] < vs_fp32[4] < 0.05 * logit_range  # measured 4.6e-3 and 1.1e-2 x range
