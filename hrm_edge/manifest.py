"""The export folder's manifest.json: its file names, its format version, and the record of one artifact.

The manifest is the contract between the export, the parity gate, the ARM64 check, bench and complete: it
is read here (read_manifest) and written by the gate (hrm_edge.parity.write_manifest). In memory its
"artifacts" are Artifact records; JSON only at the boundary (Artifact.to_json / from_json, which
round-trip a manifest's entries exactly: the same keys and values, absent optional keys left out).
numpy-free and torch-free: a phone-side check imports it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from hrm_edge.errors import UserError

MANIFEST = "manifest.json"
REPORT = "parity_report.md"
BUNDLE = "parity_bundle.npz"
MANIFEST_FORMAT = 1


@dataclass
class Artifact:
    """One exported file, as manifest.json lists it. The first six fields are always there; the others are
    None where they do not apply and are then absent from the JSON."""

    path: str  # file name inside the export folder
    format: str  # "onnx" | "ort" | "pte"
    runtime: str  # "onnxruntime" | "executorch"
    precision: str  # "fp32" | "int8" | "int4" (4-bit weights, 8-bit dynamic activations)
    program: str  # "full_sequence" | "kv_cache"
    iteration: str  # "onnx_loop" | "unrolled"
    backend: str | None = None  # "xnnpack" (.pte)
    prefill_len: int | None = None  # KV-cache programs: the gate prefills this many tokens, then decodes
    cycles: int | None = None  # depth dial: outer cycles the program runs (None: all of them)
    fp32_reference: str | None = None  # bundle key of its fp32 reference when not the full depth's
    reference: str | None = None  # int8: name of its eager int8 reference in the bundle
    weight_bytes: int | None = None  # int8: its own weight bytes (size rule); else the model's unique bytes
    quantization: dict | None = None  # int8: hrm_edge.quantize's record of the mode
    mobile_usability: dict | None = None  # ONNX: check_onnx_model_mobile_usability's verdict
    converted_from: str | None = None  # .ort: the ONNX file it was converted from
    # .pte: copies of the tied embedding table it stores (2: the gather's and the XNNPACK head's, which decodes
    # 90x faster than the head on the portable kernels; the size rule counts both)
    table_copies: int | None = None
    bytes: int | None = None  # file size and digest (set once the file is final; always in a manifest)
    sha256: str | None = None
    parity: dict | None = None  # {host target: check result}
    targets: dict | None = None  # {target: {CPU model: check result}} (hrm_edge.arm64)

    @classmethod
    def new(cls, path: Path | str, fmt: str, precision: str, program: str, iteration: str, **optional) -> "Artifact":
        """A freshly exported file: its runtime (and backend) follow from its format."""
        return cls(Path(path).name, fmt, "onnxruntime" if fmt in ("onnx", "ort") else "executorch", precision, program,
                   iteration, **({"backend": "xnnpack"} if fmt == "pte" else {}) | optional)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None or f.name in ("bytes", "sha256")}

    @classmethod
    def from_json(cls, entry: dict) -> "Artifact":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(entry) - set(names))
        missing = [k for k in names[:6] + ["bytes", "sha256"] if k not in entry]
        if unknown or missing:
            raise UserError(f"manifest artifact {entry.get('path', '?')!r}: "
                            + (f"unknown field(s) {', '.join(unknown)}" if unknown else
                               f"missing field(s) {', '.join(missing)}"))
        return cls(**entry)

    def record_parity(self, target: str, result: dict) -> None:
        """The gate's result on this host (`target` = its CPU architecture); replaces an earlier one."""
        self.parity = (self.parity or {}) | {target: result}

    def clear_target(self, target: str) -> dict:
        """An empty {CPU model: result} table for `target` (replacing an earlier run's), to be filled."""
        self.targets = (self.targets or {}) | {target: {}}
        return self.targets[target]


def manifest_json(manifest: dict) -> str:
    """The manifest as written to manifest.json."""
    return json.dumps(manifest | {"artifacts": [a.to_json() for a in manifest["artifacts"]]}, indent=2) + "\n"


def read_manifest(out_dir: Path) -> dict:
    """manifest.json of an export folder, its artifacts as Artifact records; a user error if it is not one."""
    path = Path(out_dir) / MANIFEST
    if not Path(out_dir).is_dir():
        raise UserError(f"export folder not found: {out_dir}")
    if not path.is_file():
        raise UserError(f"{out_dir} has no {MANIFEST} (not an export folder, or the export did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format_version") != MANIFEST_FORMAT:
        raise UserError(f"{path}: unsupported manifest format {manifest.get('format_version')!r}")
    manifest["artifacts"] = [Artifact.from_json(a) for a in manifest.get("artifacts", [])]
    return manifest
