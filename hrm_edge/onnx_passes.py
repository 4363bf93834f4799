"""Graph passes over an exported ONNX Loop graph that cut the work done per Loop iteration.

A decode step runs the Loop body T times, and at batch 1 onnxruntime spends about as much per body node
(~1 us of dispatch) as on the arithmetic of most of them, so every node that computes the same value in
every iteration is moved out of the body and computed once per call (hoist_loop_invariants).
"""
from __future__ import annotations

import onnx

# ops whose result does not depend only on their inputs: never hoisted (the exporter emits none of them)
_IMPURE = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def _loop_and_body(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, onnx.GraphProto]:
    loop = next(n for n in graph.node if n.op_type == "Loop")
    return loop, next(a.g for a in loop.attribute if a.name == "body")


def _shapes_from_outside(loop: onnx.NodeProto, body: onnx.GraphProto) -> None:
    """Shape(carried state) in the body -> Shape(the value the Loop starts that state from): torch's while_loop
    requires every carried value to keep its shape, so the two are equal, and the latter is loop-invariant."""
    start_of = {body.input[i].name: loop.input[i] for i in range(2, len(body.input)) if loop.input[i]}
    for node in body.node:
        if node.op_type == "Shape" and node.input[0] in start_of:
            node.input[0] = start_of[node.input[0]]


def _invariant_nodes(body: onnx.GraphProto) -> list:
    """Body nodes whose inputs are all outer-scope values, body initializers or outputs of such nodes, and
    whose outputs are not body outputs (those must stay in the body)."""
    variant = {i.name for i in body.input}
    outputs = {o.name for o in body.output}
    invariant = []
    for node in body.node:  # topological order
        has_graph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if (has_graph or node.op_type in _IMPURE or any(i in variant for i in node.input if i)
                or any(o in outputs for o in node.output)):
            variant.update(node.output)
        else:
            invariant.append(node)
    return invariant


def hoist_loop_invariants(graph: onnx.GraphProto) -> int:
    """Move the Loop body's loop-invariant nodes into the main graph, before the Loop; returns how many.
    Body initializers they read are copied to the main graph (renamed where a main-graph value has the name)."""
    loop, body = _loop_and_body(graph)
    _shapes_from_outside(loop, body)
    hoisted = _invariant_nodes(body)
    if not hoisted:
        return 0
    main_names = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    main_names |= {o for n in graph.node for o in n.output}
    for node in hoisted:
        clash = [o for o in node.output if o in main_names]
        if clash:
            raise RuntimeError(f"hoisting {node.name}: {clash[0]} is already a main-graph value")
    body_inits = {i.name: i for i in body.initializer}
    hoisted_ids = {id(n) for n in hoisted}
    kept = [n for n in body.node if id(n) not in hoisted_ids]
    still_used = {i for n in kept for i in n.input}
    renamed = {}
    for node in hoisted:
        for k, name in enumerate(node.input):
            if name in body_inits:
                if name not in renamed:
                    renamed[name] = name if name not in main_names else f"{name}.hoisted"
                    init = onnx.TensorProto()
                    init.CopyFrom(body_inits[name])
                    init.name = renamed[name]
                    graph.initializer.append(init)
                    main_names.add(init.name)
                node.input[k] = renamed[name]
    del body.node[:]
    body.node.extend(kept)
    unused = [i for i in body.initializer if i.name in renamed and i.name not in still_used]
    for init in unused:
        body.initializer.remove(init)
    moved = {o for n in hoisted for o in n.output}
    infos = [v for v in body.value_info if v.name in moved]
    for v in infos:
        body.value_info.remove(v)
    graph.value_info.extend(infos)
    at = next(k for k, n in enumerate(graph.node) if n is loop)
    nodes = list(graph.node[:at]) + hoisted + list(graph.node[at:])
    del graph.node[:]
    graph.node.extend(nodes)
    return len(hoisted)
