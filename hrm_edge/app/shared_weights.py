"""One weights file for a program's graphs, as the demo page downloads them.

The KV graph, its branch graph (the suggestion bar's chains) and the draft and verify graphs (Complete's adaptive
depth) of one program are exported self-contained, each with every weight: four copies of the same tensors (2.86 MB
each for the int8 program). The demo serves each program's graphs with their large initializers moved into one
file that the page fetches once and hands to every session (onnxruntime-web's `externalData`). The tensors are the
exported bytes, stored outside the graph: nothing computes differently (tests/test_demo.py runs both forms).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, TensorProto

EXTERNAL_MIN_BYTES = 1024  # smaller initializers (shapes, scalars, norms' gains) stay in the graph
ALIGN = 64  # each tensor starts at a multiple of this in the weights file


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
        externalize(model, location, weights, offsets)
        onnx.save(model, dest / path.name)
        written.append(dest / path.name)
    (dest / location).write_bytes(bytes(weights))
    return written + [dest / location]
