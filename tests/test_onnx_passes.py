"""The ONNX graph passes on hand-built graphs: what they remove or move, and that results do not change."""
import logging

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from hrm_edge.export.onnx import mobile_usability
from hrm_edge.export.onnx_passes import (NbitsFormat, blockwise_quantize, hoist_loop_invariants, matmuls_to_nbits,
                                         merge_split_concat, nbits_node, slots_as_scan_outputs, step_op_counts,
                                         weights_into_body)


def _body(nodes: list, initializers: list) -> onnx.GraphProto:
    """A Loop body (i, cond_in, z_in) -> (cond_out, z_out) of `nodes` (which copy cond_in to cond_out)."""
    return helper.make_graph(
        nodes, "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("z_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("z_out", TensorProto.FLOAT, None)],
        initializers)


def _loop(body: onnx.GraphProto, width: int, initializers: list) -> onnx.ModelProto:
    """y = x [2, width] carried through 3 iterations of `body`."""
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, width])],
        [numpy_helper.from_array(np.array(3, np.int64), "n")] + initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _loop_model() -> onnx.ModelProto:
    """y = x carried through 3 iterations of: z <- Reshape(z, Concat(Shape(z))) * scale + i, where the shape
    chain and `scale = w * 2` are loop-invariant and `+ i` (the iteration counter) is not."""
    body = _body([
        helper.make_node("Shape", ["z_in"], ["shape"]),  # of a carried value: invariant (while_loop keeps shapes)
        helper.make_node("Concat", ["shape"], ["shape2"], axis=0),
        helper.make_node("Reshape", ["z_in", "shape2"], ["z_r"]),
        helper.make_node("Mul", ["w", "two"], ["scale"]),  # outer value x body initializer: invariant
        helper.make_node("Mul", ["z_r", "scale"], ["z_s"]),
        helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),  # the counter: stays
        helper.make_node("Add", ["z_s", "i_f"], ["z_out"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ], [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    return _loop(body, 3, [numpy_helper.from_array(np.full(3, 0.5, np.float32), "w")])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_invariant_nodes_leave_the_body_and_results_stay():
    model = _loop_model()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = _run(model, x)
    assert hoist_loop_invariants(model.graph) == 3  # Shape, Concat, the scale Mul; nothing that reads z or i
    onnx.checker.check_model(model, full_check=True)
    body = next(a.g for a in model.graph.node[-1].attribute if a.name == "body")
    assert [n.op_type for n in body.node] == ["Reshape", "Mul", "Cast", "Add", "Identity"]
    assert [n.op_type for n in model.graph.node] == ["Shape", "Concat", "Mul", "Loop"]
    assert model.graph.node[0].input[0] == "x", "Shape reads the value the Loop starts the state from"
    assert "two" in {i.name for i in model.graph.initializer} and not body.initializer
    np.testing.assert_array_equal(_run(model, x), before)
    expected = x.copy()
    for i in range(3):
        expected = expected * 1.0 + i
    np.testing.assert_allclose(before, expected)


def _slots_model(read_carried: bool = False) -> onnx.ModelProto:
    """(y, c) = Loop over 3 iterations of: z <- z + i; c[i] <- 2 z (ScatterND of [[i]] with Unsqueeze(2 z, 0)) from
    x [2] and zeros c [3, 2], as the ONNX KV graphs collect their new keys. read_carried: the body also reads c_in."""
    body = helper.make_graph([
        helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["z_in", "i_f"], ["z_out"]),
        helper.make_node("Mul", ["z_out", "two"], ["u"]),
        helper.make_node("Unsqueeze", ["u", "axis0"], ["update"]),
        helper.make_node("Reshape", ["i", "index_shape"], ["index"]),
        helper.make_node("ScatterND", ["c_in", "index", "update"], ["c_out"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ] + ([helper.make_node("ReduceSum", ["c_in"], ["c_sum"])] if read_carried else []), "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("z_in", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("c_in", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("z_out", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("c_out", TensorProto.FLOAT, [3, 2])]
        + ([helper.make_tensor_value_info("c_sum", TensorProto.FLOAT, [])] if read_carried else []),
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
         numpy_helper.from_array(np.array([0], np.int64), "axis0"),
         numpy_helper.from_array(np.array([1, 1], np.int64), "index_shape")])
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["c_shape"], ["zeros"]),
         helper.make_node("Loop", ["n", "", "x", "zeros"], ["y", "c"] + (["sums"] if read_carried else []), body=body)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(np.array(3, np.int64), "n"), numpy_helper.from_array(np.array([3, 2], np.int64), "c_shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_slots_written_once_per_iteration_become_scan_outputs():
    model = _slots_model()
    x = np.array([1.0, -2.0], np.float32)
    before = _run_all(model, x)
    assert slots_as_scan_outputs(model.graph) == 1
    onnx.checker.check_model(model, full_check=True)
    loop = model.graph.node[-1]
    body = next(a.g for a in loop.attribute if a.name == "body")
    assert [n.op_type for n in model.graph.node] == ["Loop"], "the zeros the buffer started from are gone"
    assert "ScatterND" not in [n.op_type for n in body.node] and "Reshape" not in [n.op_type for n in body.node]
    assert list(loop.input) == ["n", "", "x"] and list(loop.output) == ["y", "c"]
    assert [o.name for o in body.output] == ["cond_out", "z_out", "u"]  # c: the scan output of u
    after = _run_all(model, x)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(after[1], 2 * (x + np.array([0.0, 1.0, 3.0])[:, None]))


def test_a_carried_buffer_the_body_also_reads_stays_carried():
    model = _slots_model(read_carried=True)
    assert slots_as_scan_outputs(model.graph) == 0


def _split_concat_model(sizes: list, concat_first: int, concat_n: int) -> onnx.ModelProto:
    """x [2, sum(sizes)] -> Split(sizes) -> outputs; Concat of outputs concat_first .. + concat_n - 1 (axis -1)
    replaces them among the graph outputs, each piece then multiplied by 2 (so every output has a reader)."""
    names = [f"s{i}" for i in range(len(sizes))]
    cat = names[concat_first : concat_first + concat_n]
    outs = names[:concat_first] + ["cat"] + names[concat_first + concat_n :]
    nodes = [helper.make_node("Split", ["x", "sizes"], names, axis=-1),
             helper.make_node("Concat", cat, ["cat"], axis=-1)]
    nodes += [helper.make_node("Mul", [o, "two"], [f"y{k}"]) for k, o in enumerate(outs)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, sum(sizes)])],
        [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, [2, None]) for k in range(len(outs))],
        [numpy_helper.from_array(np.array(sizes, np.int64), "sizes"), numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run_all(model: onnx.ModelProto, x: np.ndarray) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_concat_of_split_pieces_becomes_one_piece():
    x = np.arange(18, dtype=np.float32).reshape(2, 9)
    # queries and keys concatenated again after a [q, k, v] split: the split makes [qk, v], the Concat goes
    model = _split_concat_model([2, 3, 4], 0, 2)
    before = _run_all(model, x)
    assert merge_split_concat(model.graph, model.graph) == 1
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Split", "Mul", "Mul"]
    split = model.graph.node[0]
    sizes = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}[split.input[1]]
    assert sizes.tolist() == [5, 4]
    for a, b in zip(_run_all(model, x), before):
        np.testing.assert_array_equal(a, b)
    # every piece concatenated again: Split and Concat both go, readers read x
    model = _split_concat_model([4, 5], 0, 2)
    before = _run_all(model, x)
    assert merge_split_concat(model.graph, model.graph) == 1
    assert [n.op_type for n in model.graph.node] == ["Mul"] and model.graph.node[0].input[0] == "x"
    np.testing.assert_array_equal(_run_all(model, x)[0], before[0])


def test_two_concats_of_one_split_both_merge():
    """The second merge looked the Split up by its old first output and sizes (a KeyError): [a, b, c, d] with
    Concat(a, b) and Concat(c, d) is a Split in two pieces."""
    nodes = [helper.make_node("Split", ["x", "sizes"], ["a", "b", "c", "d"], axis=-1),
             helper.make_node("Concat", ["a", "b"], ["ab"], axis=-1),
             helper.make_node("Concat", ["c", "d"], ["cd"], axis=-1),
             helper.make_node("Neg", ["ab"], ["y0"]), helper.make_node("Neg", ["cd"], ["y1"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, w])
                               for y, w in (("y0", 3), ("y1", 5))],
                              [numpy_helper.from_array(np.array([1, 2, 3, 2], np.int64), "sizes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    before = _run_all(model, x)
    assert merge_split_concat(model.graph, model.graph) == 2
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Split", "Neg", "Neg"]
    split = model.graph.node[0]
    assert {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}[split.input[1]].tolist() == [3, 5]
    for a, b in zip(_run_all(model, x), before):
        np.testing.assert_array_equal(a, b)


def test_split_pieces_out_of_order_or_shared_are_left_alone():
    model = _split_concat_model([2, 3, 4], 1, 2)  # [k, v] of [q, k, v]: consecutive pieces, merged too
    assert merge_split_concat(model.graph, model.graph) == 1
    model = _split_concat_model([2, 3, 4], 0, 2)
    model.graph.node[1].input[:] = ["s1", "s0"]  # reversed: not the split undone
    assert merge_split_concat(model.graph, model.graph) == 0
    model = _split_concat_model([2, 3, 4], 0, 2)
    model.graph.node.append(helper.make_node("Neg", ["s0"], ["extra"]))  # a piece read elsewhere too
    assert merge_split_concat(model.graph, model.graph) == 0


def test_weights_only_the_body_reads_move_into_it_and_results_stay():
    model = _loop_model()
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.5, np.float32), "bias"))
    body = next(a.g for a in model.graph.node[-1].attribute if a.name == "body")
    body.node[-2].input[1] = "bias_i"  # z_out = z_s + (i + bias): a second outer value only the body reads
    body.node.insert(len(body.node) - 2, helper.make_node("Add", ["i_f", "bias"], ["bias_i"]))
    model.graph.node.insert(0, helper.make_node("Neg", ["w"], ["w_neg"]))  # w is read outside the body too
    model.graph.output.append(helper.make_tensor_value_info("w_neg", TensorProto.FLOAT, [3]))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = _run_all(model, x)
    assert weights_into_body(model.graph) == 1
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in body.initializer] == ["two", "bias"]
    assert sorted(i.name for i in model.graph.initializer) == ["n", "w"], "the trip count and a shared weight stay"
    for a, b in zip(_run_all(model, x), before):
        np.testing.assert_array_equal(a, b)


def _int8_per_block(x: np.ndarray, block: int) -> np.ndarray:
    """What MatMulNBits at accuracy_level 4 multiplies: x rounded to int8 per block of its last axis."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    scale = np.maximum(np.abs(blocks).max(-1, keepdims=True) / 127, 1e-12)
    return (np.clip(np.rint(blocks * (1 / scale)), -127, 127) * scale).reshape(x.shape)


def test_blockwise_weights_are_what_matmulnbits_multiplies():
    """The packing is the op's: with float compute (accuracy_level 0) the node computes x @ (the weight the
    quantized one stands for) to float rounding, and with int8 compute (4) x rounded per block times it. The
    stood-for weight is within half a quantum of the original, but for the few values beyond 2^(bits-1) - 1
    quanta on the side opposite the block's extreme (clipped: within one quantum)."""
    rng = np.random.default_rng(0)
    k, n = 64, 24
    w = rng.standard_normal((k, n)).astype(np.float32) * np.exp(rng.standard_normal((1, n))).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    for bits, block in ((8, 32), (4, 16)):
        stored, scales, stands_for = blockwise_quantize(w, bits, block)
        assert stored.shape == (n, k // block, block * bits // 8) and scales.shape == (n, k // block)
        step = np.repeat(np.abs(scales).T, block, axis=0)  # [K, N]: each weight's quantum
        error = np.abs(stands_for - w)
        assert np.all(error <= step + 1e-7) and np.mean(error <= step / 2 + 1e-7) > 0.95
        for level, expected in ((0, x @ stands_for), (4, _int8_per_block(x, block) @ stands_for)):
            graph = helper.make_graph([nbits_node("x", "y", "b", "s", k, n, NbitsFormat(bits, block, level))], "g",
                                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                      [numpy_helper.from_array(stored, "b"), numpy_helper.from_array(scales, "s")])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid("com.microsoft", 1)])
            y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            np.testing.assert_allclose(y, expected, atol=1e-4, rtol=0)


def test_matmuls_with_named_weights_in_the_loop_body_become_nbits():
    """z <- (z @ W + z @ V) @ R for 3 iterations, W, V and R body initializers: W and V (named, one input) become
    one MatMulNBits over both and a Split inside the body, their float copies are dropped, R stays a float
    MatMul; the result is the loop with W's and V's stood-for weights."""
    rng = np.random.default_rng(1)
    w, v = (rng.standard_normal((2, 32, 32)) / 8).astype(np.float32)
    r = np.eye(32, dtype=np.float32)[::-1].copy()
    body = _body([helper.make_node("MatMul", ["z_in", "W"], ["zw"]), helper.make_node("MatMul", ["z_in", "V"], ["zv"]),
                  helper.make_node("Add", ["zw", "zv"], ["zs"]), helper.make_node("MatMul", ["zs", "R"], ["z_out"]),
                  helper.make_node("Identity", ["cond_in"], ["cond_out"])],
                 [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V"), numpy_helper.from_array(r, "R")])
    model = _loop(body, 32, [])
    assert step_op_counts(model.graph, 3) == {"MatMul": 9, "Add": 3, "Identity": 3, "Loop": 1}
    stands_for = matmuls_to_nbits(model, {"W", "V"}, bits=8, block=32, accuracy_level=0)
    onnx.checker.check_model(model, full_check=True)
    body = next(a.g for a in model.graph.node[0].attribute if a.name == "body")
    assert [n.op_type for n in body.node] == ["MatMulNBits", "Split", "Add", "MatMul", "Identity"]
    assert sorted(i.name for i in body.initializer) == ["R", "W+V.q8", "W+V.q8.scales", "W+V.q8.sizes"]
    assert step_op_counts(model.graph, 3) == {"MatMulNBits": 3, "Split": 3, "Add": 3, "MatMul": 3, "Identity": 3,
                                              "Loop": 1}
    x = rng.standard_normal((2, 32)).astype(np.float32)
    expected, exact = x, x
    for _ in range(3):
        expected = (expected @ stands_for["W"] + expected @ stands_for["V"]) @ r
        exact = (exact @ w + exact @ v) @ r
    np.testing.assert_allclose(_run(model, x), expected, atol=1e-4, rtol=0)
    assert np.abs(expected - exact).max() > 1e-4, "the 8-bit weights differ from the float ones"


def test_mobile_usability_is_recorded_in_process_even_with_logging_silenced(tmp_path):
    """The exporter silences third-party log records process-wide (hrm_edge.quiet): the usability report is kept
    anyway (it is not read from a logger), and a file onnxruntime cannot read gives an error line, not an exception."""
    body = _body([helper.make_node("Add", ["z_in", "z_in"], ["z_out"]), helper.make_node("Identity", ["cond_in"],
                                                                                            ["cond_out"])], [])
    path = tmp_path / "loop.onnx"
    onnx.save(_loop(body, 4, []), str(path))
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        verdict = mobile_usability(path)
    finally:
        logging.disable(previous)
    assert verdict["nnapi_or_coreml_may_help"] in (True, False) and "error" not in verdict, verdict
    assert any("NNAPI" in line for line in verdict["summary"]) or any("CoreML" in line for line in verdict["summary"])
    (tmp_path / "not.onnx").write_text("not a model")
    broken = mobile_usability(tmp_path / "not.onnx")
    assert "nnapi_or_coreml_may_help" not in broken and "Protobuf" in broken["error"], broken
