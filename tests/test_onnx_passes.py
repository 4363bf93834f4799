"""hoist_loop_invariants on a hand-built Loop: what may leave the body does, the result does not change."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from hrm_edge.onnx_passes import hoist_loop_invariants


def _loop_model() -> onnx.ModelProto:
    """y = x carried through 3 iterations of: z <- Reshape(z, Concat(Shape(z))) * scale + i, where the shape
    chain and `scale = w * 2` are loop-invariant and `+ i` (the iteration counter) is not."""
    body = helper.make_graph(
        [
            helper.make_node("Shape", ["z_in"], ["shape"]),  # of a carried value: invariant (while_loop keeps shapes)
            helper.make_node("Concat", ["shape"], ["shape2"], axis=0),
            helper.make_node("Reshape", ["z_in", "shape2"], ["z_r"]),
            helper.make_node("Mul", ["w", "two"], ["scale"]),  # outer value x body initializer: invariant
            helper.make_node("Mul", ["z_r", "scale"], ["z_s"]),
            helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),  # the counter: stays
            helper.make_node("Add", ["z_s", "i_f"], ["z_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("z_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("z_out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.array(3, np.int64), "n"), numpy_helper.from_array(np.full(3, 0.5, np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


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
