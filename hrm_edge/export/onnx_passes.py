"""Graph passes over an exported ONNX Loop graph that cut the work done per Loop iteration.

A decode step runs the Loop body T times, and at batch 1 onnxruntime spends about as much per body node
(~1 us of dispatch) as on the arithmetic of most of them, so every node that computes the same value in
every iteration is moved out of the body and computed once per call (hoist_loop_invariants), a Split
whose pieces are concatenated again is undone (merge_split_concat), the weights only the body reads are
stored in the body (weights_into_body), and the caches collected one slot per iteration become the Loop's scan
outputs (slots_as_scan_outputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

# ops whose result does not depend only on their inputs: never hoisted (the exporter emits none of them)
_IMPURE = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def loop_and_body(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, onnx.GraphProto]:
    """The graph's Loop node and its body graph (fetch again after rebuilding graph.node: protobuf hands out
    copies of removed nodes, so an older body reference no longer reaches the saved graph)."""
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
    loop, body = loop_and_body(graph)
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


def weights_into_body(graph: onnx.GraphProto) -> int:
    """Move the main graph's initializers that only the Loop body reads into the body graph; returns how many.

    Each is still stored once (a name the main graph no longer has, so nothing is shadowed). Why: onnxruntime
    hands every outer-scope value a body reads to each iteration as an implicit input, and the shared block's
    ~20 weights as outer-scope values cost ~10% of a decode step (int8 KV graph, batch 1, one thread:
    1.09 -> 0.96 ms at 1 past position, 1.43 -> 1.30 ms at 192; fp32 ~8%). Values the main graph, the Loop
    node or a graph output also reads (the tied table, small shared constants) stay where they are."""
    _, body = loop_and_body(graph)
    outside = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}  # (Loop: its own inputs)
    inside = names_read(body)
    body_only = inside - outside
    move = [i for i in graph.initializer if i.name in body_only]
    keep = [i for i in graph.initializer if i.name not in body_only]
    body.initializer.extend(move)  # (copies)
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return len(move)


def slots_as_scan_outputs(graph: onnx.GraphProto) -> int:
    """Loop-carried caches written one slot per iteration -> scan outputs of the Loop; returns how many.

    The body collects each block application's new keys and values into carried [T, B, H, S, hd] tensors,
    ScatterND(carried, [[slot]], Unsqueeze(x, 0)), slot = the iteration's index (StackedKVCache: slot = t -
    first_step, t counting from first_step, one slot per iteration): that is what a Loop's scan output is, the body's
    x of every iteration stacked along a new first axis. As a scan output the body no longer runs the ScatterND (nor
    the Unsqueeze of its index), and the carried buffer and its zeros are gone. Only that exact form is rewritten:
    the body output a ScatterND of its own carried input, read by nothing else, with an Unsqueeze on axis 0 as its
    update (which stays where other nodes read it)."""
    loop, body = loop_and_body(graph)
    n_carried = len(body.input) - 2
    producer = {o: n for n in body.node for o in n.output}
    readers: dict = {}
    for n in body.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    moved = []  # (carried index, the per-iteration value)
    for j in range(n_carried):
        carried_in, carried_out = body.input[2 + j].name, body.output[1 + j].name
        scatter = producer.get(carried_out)
        if (scatter is None or scatter.op_type != "ScatterND" or scatter.input[0] != carried_in
                or len(readers.get(carried_in, [])) != 1 or readers.get(carried_out)):
            continue
        update = producer.get(scatter.input[2])
        if update is None or update.op_type != "Unsqueeze" or not _unsqueezes_axis_0(update, body, graph):
            continue
        moved.append((j, scatter, update.input[0]))
    if not moved:
        return 0
    _rewire_scan_outputs(graph, loop, body, moved)
    return len(moved)


def _unsqueezes_axis_0(node: onnx.NodeProto, body: onnx.GraphProto, graph: onnx.GraphProto) -> bool:
    """An Unsqueeze whose axes (an initializer of the body or the main graph) are [0]."""
    inits = {i.name: i for i in list(body.initializer) + list(graph.initializer)}
    axes = inits.get(node.input[1]) if len(node.input) > 1 else None
    return axes is not None and onnx.numpy_helper.to_array(axes).tolist() in ([0], 0)


def _rewire_scan_outputs(graph, loop, body, moved) -> None:
    """Drop the carried values `moved` (index, ScatterND, per-iteration value) from the body and the Loop and make
    the per-iteration values scan outputs under the Loop's old output names; nodes left unread go."""
    gone = {id(scatter) for _, scatter, _ in moved}
    kept = [n for n in body.node if id(n) not in gone]
    del body.node[:]
    body.node.extend(kept)
    indices = {j for j, _, _ in moved}
    n_carried = len(body.input) - 2
    scans = []
    for j, _, value in moved:
        out = onnx.ValueInfoProto()
        out.name = value
        out.type.tensor_type.elem_type = body.output[1 + j].type.tensor_type.elem_type
        scans.append(out)
    body_inputs = [v for k, v in enumerate(body.input) if k - 2 not in indices]
    body_outputs = [v for k, v in enumerate(body.output) if k - 1 not in indices]  # cond, carried, old scans
    loop_inputs = [v for k, v in enumerate(loop.input) if k - 2 not in indices]
    loop_outputs = list(loop.output)
    finals = [v for k, v in enumerate(loop_outputs[:n_carried]) if k not in indices]
    loop_outputs = finals + loop_outputs[n_carried:] + [loop_outputs[j] for j, _, _ in moved]
    del body.input[:], body.output[:], loop.input[:], loop.output[:]
    body.input.extend(body_inputs)
    body.output.extend(body_outputs + scans)
    loop.input.extend(loop_inputs)
    loop.output.extend(loop_outputs)
    _drop_unread(body)
    _drop_unread(graph)


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs is read (by a node, a nested graph or a graph output), until none is
    left, and the initializers nothing reads."""
    while True:
        read = names_read(graph)
        kept = [n for n in graph.node if any(o in read for o in n.output if o)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    read = names_read(graph)
    unread = [i for i in graph.initializer if i.name not in read]
    for init in unread:
        graph.initializer.remove(init)


def names_read(graph: onnx.GraphProto) -> set:
    """Every value name the graph's nodes and outputs read, its nested graphs' included."""
    names = {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names |= names_read(attr.g)
    return names


def merge_split_concat(body: onnx.GraphProto, outer: onnx.GraphProto) -> int:
    """Concat(consecutive outputs of one Split) -> one output of that Split, along the same (last) axis, where
    nothing else reads those outputs: the static int8 rewrite computes wq and wk (and wv) as one integer matmul
    and splits the result, and the model concatenates queries and keys again for one RoPE over both. The Split's
    sizes (an initializer of `body` or `outer`) are rewritten into a new `outer` initializer; a Split left with
    one output is dropped. Returns how many Concats were removed."""
    readers: dict = {}
    for node in body.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    inits = {i.name: i for i in list(outer.initializer) + list(body.initializer)}
    splits = {o: n for n in body.node if n.op_type == "Split" and len(n.input) == 2 and n.input[1] in inits
              for o in n.output}  # Split output -> its Split
    graph_outputs = {o.name for o in body.output}
    renamed, dropped, merged = {}, set(), 0  # dropped: positions in body.node
    nodes = list(body.node)
    position = {n.output[0]: k for k, n in enumerate(nodes)}  # (protobuf wrappers' ids are not stable)
    for k, concat in enumerate(nodes):
        split = splits.get(concat.input[0]) if concat.op_type == "Concat" else None
        if split is None or not _mergeable(split, concat, readers, graph_outputs):
            continue
        split_at = position[split.output[0]]
        outs = list(split.output)
        first, n = outs.index(concat.input[0]), len(concat.input)
        sizes = [int(v) for v in onnx.numpy_helper.to_array(inits[split.input[1]])]
        sizes[first : first + n] = [sum(sizes[first : first + n])]
        outs[first : first + n] = [concat.output[0]]
        dropped.add(k)
        merged += 1
        if len(outs) == 1:  # the Split is gone: its input is the Concat's result
            renamed[concat.output[0]] = split.input[0]
            dropped.add(split_at)
            continue
        name = f"{split.input[1]}.merged{merged}"
        inits[name] = onnx.numpy_helper.from_array(np.array(sizes, dtype=np.int64), name)
        outer.initializer.append(inits[name])
        split.input[1] = name
        split.output[:] = outs
        position[outs[0]] = split_at  # a later Concat of the same Split finds it under its new first output
    kept = [n for k, n in enumerate(nodes) if k not in dropped]
    for node in kept:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    del body.node[:]
    body.node.extend(kept)
    return merged


def _mergeable(split: onnx.NodeProto, concat: onnx.NodeProto, readers: dict, graph_outputs: set) -> bool:
    outs = list(split.output)
    first = outs.index(concat.input[0])
    return (list(concat.input) == outs[first : first + len(concat.input)]
            and _axis(split) == _axis(concat) == -1
            and all(readers[o] == 1 for o in concat.input) and concat.output[0] not in graph_outputs)


def _axis(node: onnx.NodeProto) -> int:
    """The axis attribute of a Split (default 0) or Concat. Only the last axis, -1, is ever merged: this pass
    does not know ranks, so it cannot equate a positive axis with a negative one."""
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)


# ---- weight-only 8- and 4-bit matmuls (onnxruntime's MatMulNBits) ----
NBITS_DOMAIN = "com.microsoft"  # MatMulNBits is an onnxruntime contrib op (its CPU kernels and onnxruntime-web's)


def blockwise_quantize(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] (a MatMul's right operand) -> MatMulNBits's B [N, K / block, block * bits / 8] uint8, its scales
    [N, K / block] float32, and the weight [K, N] they stand for. Symmetric per block of `block` inputs of one
    output, all 2^bits levels used: the block's value of largest magnitude v is -2^(bits-1) quanta, scale
    v / -2^(bits-1) (negative where v > 0), q = round(w / scale) in [-2^(bits-1), 2^(bits-1) - 1], stored
    + 2^(bits-1): the op's default zero point, so the graph needs no zero-point input. 4-bit values two a
    byte, the first in the low nibble."""
    k, n = w.shape
    if k % block or bits not in (4, 8):
        raise ValueError(f"blockwise_quantize: {bits}-bit blocks of {block} do not fit K = {k}")
    half = 2 ** (bits - 1)
    blocks = np.ascontiguousarray(w.T, dtype=np.float32).reshape(n, k // block, block)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]  # [N, K / block]
    scales = (extreme / -half).astype(np.float32)
    scales[scales == 0] = 1.0  # an all-zero block: any scale stores it exactly
    q = np.clip(np.rint(blocks / scales[..., None]), -half, half - 1)
    dequantized = (q.astype(np.float32) * scales[..., None]).reshape(n, k).T
    stored = (q + half).astype(np.uint8)
    if bits == 4:
        stored = stored[..., 0::2] | (stored[..., 1::2] << 4)
    return stored, scales, np.ascontiguousarray(dequantized)


@dataclass(frozen=True)
class NbitsFormat:
    """How a MatMulNBits weight is stored and computed: bits per weight, weights per block (one scale each), and
    accuracy_level 4: int8 compute (x quantized per block at run time), onnxruntime's fast path on x86
    (VNNI/AMX) and ARM (dot product)."""

    bits: int
    block: int
    accuracy_level: int = 4


def nbits_node(x: str, y: str, stored: str, scales: str, k: int, n: int, fmt: NbitsFormat) -> onnx.NodeProto:
    """y = x @ (the [k, n] weight `stored` and `scales` stand for, in format fmt)."""
    return onnx.helper.make_node("MatMulNBits", [x, stored, scales], [y], domain=NBITS_DOMAIN, name=f"{y}.nbits",
                                 K=k, N=n, bits=fmt.bits, block_size=fmt.block, accuracy_level=fmt.accuracy_level)


def matmuls_to_nbits(model: onnx.ModelProto, weights: set, bits: int, block: int, accuracy_level: int = 4) -> dict:
    """Every MatMul of the main graph or the Loop body whose right operand is an initializer of that graph named
    in `weights` becomes MatMulNBits over its blockwise-quantized weight; MatMuls that read the same input become
    one MatMulNBits over their weights side by side, split after (wq, wk, wv; w_gate, w_up): the kernel
    quantizes its input once, and one larger matmul runs instead of several. The float weights are dropped when
    nothing else reads them. Returns {weight name: the weight [K, N] the quantized one stands for} (what an eager
    reference multiplies with: blocks run along K, so side by side or alone, a weight is quantized the same)."""
    graph = model.graph
    done: dict = {}
    for g in (loop_and_body(graph)[1], graph):  # the body first: rebuilding graph.node leaves a stale body copy
        inits = {i.name: i for i in g.initializer}
        groups: dict = {}  # input -> MatMuls reading it with a weight to quantize
        for node in g.node:
            if node.op_type == "MatMul" and node.input[1] in weights and node.input[1] in inits:
                groups.setdefault(node.input[0], []).append(node)
        first = {matmuls[0].output[0]: matmuls for matmuls in groups.values()}
        replaced = {m.output[0] for matmuls in groups.values() for m in matmuls}
        nodes = []
        for node in g.node:
            if node.op_type == "MatMul" and node.output[0] in first:
                nodes += _nbits_group(g, inits, first[node.output[0]], (bits, block, accuracy_level), done)
            elif not (node.op_type == "MatMul" and node.output[0] in replaced):
                nodes.append(node)
        del g.node[:]
        g.node.extend(nodes)
    read = names_read(graph)
    for g in (graph, loop_and_body(graph)[1]):
        unread = [i for i in g.initializer if i.name in done and i.name not in read]
        for init in unread:
            g.initializer.remove(init)
    if not any(o.domain == NBITS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(NBITS_DOMAIN, 1))
    return done


def _nbits_group(g: onnx.GraphProto, inits: dict, matmuls: list, kind: tuple, done: dict) -> list:
    """Nodes computing `matmuls` (one input, weights in `inits`) as one MatMulNBits (+ a Split where several);
    the quantized weights go into `g`, what each stands for into `done`. kind: (bits, block, accuracy_level)."""
    bits, block, accuracy_level = kind
    names = [m.input[1] for m in matmuls]
    parts = [blockwise_quantize(onnx.numpy_helper.to_array(inits[w]), bits, block) for w in names]
    done.update({w: stands_for for w, (_, _, stands_for) in zip(names, parts)})
    p = "+".join(names) + f".q{bits}"
    g.initializer.extend([onnx.numpy_helper.from_array(np.concatenate([q for q, _, _ in parts]), p),  # [sum N, ...]
                          onnx.numpy_helper.from_array(np.concatenate([s for _, s, _ in parts]), f"{p}.scales")])
    sizes = [int(inits[w].dims[1]) for w in names]
    y = matmuls[0].output[0] if len(matmuls) == 1 else f"{p}.y"
    nodes = [nbits_node(matmuls[0].input[0], y, p, f"{p}.scales", int(inits[names[0]].dims[0]), sum(sizes),
                        NbitsFormat(bits, block, accuracy_level))]
    if len(matmuls) > 1:
        g.initializer.append(onnx.numpy_helper.from_array(np.array(sizes, dtype=np.int64), f"{p}.sizes"))
        nodes.append(onnx.helper.make_node("Split", [y, f"{p}.sizes"], [m.output[0] for m in matmuls], axis=-1,
                                           name=f"{p}.split"))
    return nodes


def step_op_counts(graph: onnx.GraphProto, trip_count: int) -> dict:
    """{op type: nodes one call of a Loop graph runs}: the main graph's once, the Loop body's trip_count times
    (the KV graph's trip count is past_k's first dimension; nested graphs other than the Loop body are not
    counted)."""
    counts: dict = {}
    _, body = loop_and_body(graph)
    for nodes, times in ((graph.node, 1), (body.node, trip_count)):
        for node in nodes:
            counts[node.op_type] = counts.get(node.op_type, 0) + times
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
