"""One weights file for a program's graphs, as the demo page downloads them.

The KV graph, its branch graph (the suggestion bar's chains) and the draft and verify graphs (Complete's adaptive
depth) of one program are exported self-contained, each with every weight: four copies of the same tensors (2.86 MB
each for the int8 program). The demo serves each program's graphs with their large initializers moved into one
file that the page fetches once and hands to every session (onnxruntime-web's `externalData`). The tensors are the
exported bytes, stored outside the graph: nothing computes differently (tests/test_demo.py runs both forms).

One change of form comes with it: a MatMulNBits (the int8-nbits and int4-nbits programs) becomes a float MatMul over
the weight its blocks stand for, computed from the stored bytes by constant operators that onnxruntime folds once, when
the session starts (`float_matmuls_of_nbits_weights`). onnxruntime-web's MatMulNBits ran 3-5x slower in the browser
than the integer graph (docs/keyboard-measurements.md); the folded MatMul runs as fast as the fp32 program's, and the
page still downloads the 8-bit (4-bit) bytes.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, TensorProto, helper, numpy_helper

EXTERNAL_MIN_BYTES = 1024  # smaller initializers (shapes, scalars, norms' gains) stay in the graph
ALIGN = 64  # each tensor starts at a multiple of this in the weights file
NBITS = ("MatMulNBits", "com.microsoft")  # onnxruntime's weight-only op (hrm_edge/export/onnx_passes.py writes it)


def weights_name(kv_path: str) -> str:
    """The weights file of the program whose KV graph is `kv_path`: hrm.fp32.kv.onnx -> hrm.fp32.weights."""
    return kv_path.removesuffix(".kv.onnx") + ".weights"


def hoist_subgraph_initializers(model: onnx.ModelProto) -> None:
    """Move the initializers of the main graph's subgraphs (the Loop body) into the main graph, where the body still
    reads them by name (a subgraph may use its outer graph's names). onnxruntime-web 1.30 finds external data only
    for the main graph's initializers ("external data path could not be canonicalized" for a Loop body's). A name
    the model has already (ONNX's names are unique across a graph and its subgraphs) is renamed, in the body's node
    inputs too."""
    names = value_names(model.graph)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type != AttributeProto.GRAPH:
                continue
            body = attr.g
            if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for n in body.node for a in n.attribute):
                raise ValueError(f"{node.name or node.op_type}: a subgraph inside a subgraph is not handled")
            renamed = {}
            for tensor in body.initializer:
                new = tensor.name
                while new in names:
                    new = f"{node.name or node.op_type}.{new}"
                renamed[tensor.name], tensor.name = new, new
                names.add(new)
                model.graph.initializer.append(tensor)
            del body.initializer[:]
            for n in body.node:
                n.input[:] = [renamed.get(x, x) for x in n.input]


def value_names(graph: onnx.GraphProto, initializers: bool = True) -> set[str]:
    """Every name `graph` and its subgraphs define (inputs, node outputs, and the initializers of `graph` itself,
    not its subgraphs': those are the names being moved)."""
    names = {v.name for v in graph.input} | ({t.name for t in graph.initializer} if initializers else set())
    for node in graph.node:
        names.update(node.output)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)):
                names |= value_names(sub, initializers=False)
    return names


def externalize(model: onnx.ModelProto, location: str, weights: bytearray, offsets: dict) -> None:
    """Move every main-graph initializer of at least EXTERNAL_MIN_BYTES into `weights` ({sha256: (offset, length)}
    in `offsets`: the same bytes are stored once, whichever graph and name they come from). Only tensors held as raw
    bytes move, which is how the exporters write them; one in typed fields stays in the graph."""
    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL or len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
            continue
        key = hashlib.sha256(tensor.raw_data).hexdigest()
        if key not in offsets:
            weights.extend(bytes(-len(weights) % ALIGN))
            offsets[key] = (len(weights), len(tensor.raw_data))
            weights.extend(tensor.raw_data)
        offset, length = offsets[key]
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = k, v


def share_weights(graphs: list[Path], dest: Path, location: str) -> list[Path]:
    """Write each of `graphs` (self-contained ONNX files) into `dest` under its own name, its weights in the one file
    dest/`location`. Returns the files written: the graphs, then the weights file."""
    weights, offsets, written = bytearray(), {}, []
    for path in graphs:
        try:
            model = onnx.load(path)
        except DecodeError:
            raise ValueError(f"{path.name} is not an ONNX graph") from None
        hoist_subgraph_initializers(model)
        float_matmuls_of_nbits_weights(model)
        externalize(model, location, weights, offsets)
        onnx.save(model, dest / path.name)
        written.append(dest / path.name)
    (dest / location).write_bytes(bytes(weights))
    return written + [dest / location]


def float_matmuls_of_nbits_weights(model: onnx.ModelProto) -> int:
    """Every 8- or 4-bit MatMulNBits whose weight and scales are main-graph initializers (a Loop body's, once hoisted)
    becomes MatMul(x, W), W [K, N] computed at the start of the main graph from initializers only:
    Transpose(Reshape((Cast(B) - 2^(bits-1)) * scales)), 4-bit B unpacked first, which onnxruntime folds into a
    constant at session start. W is the weight MatMulNBits dequantizes (B around its default zero point, one scale a
    block), so this computes what MatMulNBits computes at accuracy_level 0 (float products); the export's
    accuracy_level 4 quantizes the activations to 8 bits too, where onnxruntime has such a kernel. One with a
    zero-point, group-index or bias input is left as it is, and a 4-bit one in a model below opset 18 (BitwiseAnd).
    Returns how many nodes changed."""
    initializers = {t.name for t in model.graph.initializer}
    names = value_names(model.graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    widths = (8, 4) if opset >= 18 else (8,)
    prologue, weights = [], {}  # weights: (B, scales) -> W's name, one W per stored weight whatever reads it

    def float_weight(node) -> str:
        b, scales = node.input[1], node.input[2]
        if (b, scales) not in weights:
            at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            w = b + ".float"
            while any(x == w or x.startswith(w + ".") for x in names):  # w and the names made from it are new
                w += "_"
            names.add(w)
            weights[b, scales] = w
            shape = (at["K"], at["N"], at["block_size"], at["bits"])
            prologue.extend(dequantize_nodes(model.graph, b, scales, w, shape))
        return weights[b, scales]

    def rewrite(graph: onnx.GraphProto) -> int:
        nodes, changed = [], 0
        for node in graph.node:
            for attr in node.attribute:
                changed += rewrite(attr.g) if attr.type == AttributeProto.GRAPH else 0
            bits = next((a.i for a in node.attribute if a.name == "bits"), None)
            if ((node.op_type, node.domain) == NBITS and bits in widths and len(node.input) == 3
                    and {node.input[1], node.input[2]} <= initializers):
                node = helper.make_node("MatMul", [node.input[0], float_weight(node)], list(node.output),
                                        name=f"{node.name}.float")
                changed += 1
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
        return changed

    changed = rewrite(model.graph)
    nodes = prologue + list(model.graph.node)  # the prologue reads initializers only: first, it is in order
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return changed


def dequantize_nodes(graph: onnx.GraphProto, b: str, scales: str, w: str, knbb: tuple) -> list:
    """The nodes computing w [K, N] from MatMulNBits's weight b (8 bits: [N, K / block, block]; 4 bits: [N, K / block,
    block / 2], two a byte, the first in the low nibble) and scales (N x K / block of them); their small constants are
    added to `graph`'s initializers."""
    k, n, block, bits = knbb
    consts = {f"{w}.zero_point": np.array(2.0 ** (bits - 1), np.float32),
              f"{w}.scales_shape": np.array([n, k // block, 1]), f"{w}.nk": np.array([n, k])}
    nodes, q = [], b  # q: the weight's values, one a byte [N, K / block, block]
    if bits == 4:
        consts |= {f"{w}.blocks_shape": np.array([n, k // block, block]), f"{w}.last": np.array([-1]),
                   f"{w}.low_mask": np.array(15, np.uint8), f"{w}.four": np.array(4, np.uint8)}
        nodes, q = [helper.make_node("BitwiseAnd", [b, f"{w}.low_mask"], [f"{w}.low"]),  # [N, K / block, block / 2]
                    helper.make_node("BitShift", [b, f"{w}.four"], [f"{w}.high"], direction="RIGHT"),
                    helper.make_node("Unsqueeze", [f"{w}.low", f"{w}.last"], [f"{w}.low1"]),
                    helper.make_node("Unsqueeze", [f"{w}.high", f"{w}.last"], [f"{w}.high1"]),
                    helper.make_node("Concat", [f"{w}.low1", f"{w}.high1"], [f"{w}.pairs"], axis=-1),
                    helper.make_node("Reshape", [f"{w}.pairs", f"{w}.blocks_shape"], [f"{w}.bytes"])], f"{w}.bytes"
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in consts.items())
    return nodes + [helper.make_node("Cast", [q], [f"{w}.q"], to=TensorProto.FLOAT),  # [N, K / block, block]
                    helper.make_node("Sub", [f"{w}.q", f"{w}.zero_point"], [f"{w}.centred"]),
                    helper.make_node("Reshape", [scales, f"{w}.scales_shape"], [f"{w}.block_scales"]),  # [N, K/bk, 1]
                    helper.make_node("Mul", [f"{w}.centred", f"{w}.block_scales"], [f"{w}.blocks"]),
                    helper.make_node("Reshape", [f"{w}.blocks", f"{w}.nk"], [f"{w}.t"]),  # [N, K]
                    helper.make_node("Transpose", [f"{w}.t"], [w], perm=[1, 0])]  # [K, N]


def page_form(kv_graph: Path, dest: Path) -> Path:
    """The KV graph at `kv_graph` (hrm.X.kv.onnx) and the branch and draft graphs beside it, as the demo serves them to
    the page, written into `dest` (their weights in one file, MatMulNBits as float MatMuls). Returns the KV
    graph written, beside which the others keep their names (hrm_edge.runtime.suggest.draft_beside finds them)."""
    stem = kv_graph.name.removesuffix(".kv.onnx")
    beside = [kv_graph.with_name(f"{stem}.{p}.onnx") for p in ("branch", "draft")]
    graphs = [kv_graph] + [g for g in beside if g.is_file()]
    return share_weights(graphs, dest, weights_name(kv_graph.name))[0]
