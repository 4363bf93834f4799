"""The export folder's manifest.json: its file names, its format version, and the record of one artifact.

The manifest is the contract between the export, the parity gate, the ARM64 check, bench and complete: it
is read here (read_manifest) and written by the gate (hrm_edge.verify.parity.write_manifest). In memory its
"artifacts" are Artifact records; JSON only at the boundary (Artifact.to_json / from_json, which
round-trip a manifest's entries exactly: the same keys and values, absent optional keys left out).
numpy-free and torch-free: a phone-side check imports it.

Trust: an export folder is copied, shared and served, so its readers check it rather than believe it.
read_manifest refuses a manifest naming any path that could leave the folder (contained_path), before
any listed file is opened; verify_files checks the files a command is about to load against the
manifest's sha256 (the one check every reader uses: complete, bench, demo, parity).
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path

from hrm_edge.config import ModelConfig
from hrm_edge.errors import UserError
from hrm_edge.io import sha256_file

MANIFEST = "manifest.json"
REPORT = "parity_report.md"
BUNDLE = "parity_bundle.npz"
MANIFEST_FORMAT = 1
MODEL_SIZES = ("vocab_size", "d_model", "max_seq_len", "H_cycles", "L_cycles")  # what readers of "model" index


@dataclass
class Artifact:
    """One exported file, as manifest.json lists it. The first six fields are always there; the others are
    None where they do not apply and are then absent from the JSON."""

    path: str  # file name inside the export folder
    format: str  # "onnx" | "ort" | "pte"
    runtime: str  # "onnxruntime" | "executorch"
    precision: str  # "fp32" | "int8" | "int4" (4-bit weights, 8-bit dynamic activations)
    # "full_sequence" | "kv_cache" | "draft" | "verify" (self-speculative decoding's two ONNX graphs) |
    # "speculative" (the ExecuTorch program holding both, beside the KV program's forward) | "branch" (the draft's
    # first outer cycle for rows sharing one context: the suggestion bar's)
    program: str
    iteration: str  # "onnx_loop" | "unrolled"
    backend: str | None = None  # "xnnpack" (.pte)
    prefill_len: int | None = None  # KV-cache programs: the gate prefills this many tokens, then decodes
    cycles: int | None = None  # depth dial: outer cycles the program runs (None: all of them)
    fp32_reference: str | None = None  # bundle key of its fp32 reference when not the full depth's
    reference: str | None = None  # int8: name of its eager int8 reference in the bundle
    weight_bytes: int | None = None  # int8: its own weight bytes (size rule); else the model's unique bytes
    quantization: dict | None = None  # int8: hrm_edge.export.quantize's record of the mode
    mobile_usability: dict | None = None  # ONNX: onnxruntime's mobile usability verdict (export.onnx)
    converted_from: str | None = None  # .ort: the ONNX file it was converted from
    # .pte: copies of the tied embedding table it stores (2: the gather's and the XNNPACK head's, which decodes
    # 90x faster than the head on the portable kernels; the size rule counts both)
    table_copies: int | None = None
    bytes: int | None = None  # file size and digest (set once the file is final; always in a manifest)
    sha256: str | None = None
    parity: dict | None = None  # {host target: check result}
    targets: dict | None = None  # {target: {CPU model: check result}} (hrm_edge.verify.arm64_gate)

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
        optional = set(names[6:])  # may be null
        wrong = [f"{k} ({type(v).__name__}, not {FIELD_TYPES[k].__name__})" for k, v in entry.items()
                 if not (_of_type(v, FIELD_TYPES[k]) or v is None and k in optional)]
        wrong += [f"{k} (a value not a dict: {{target: {{...}}}})" for k in ("parity", "targets")
                  if isinstance(entry.get(k), dict) and not all(isinstance(r, dict) for r in entry[k].values())]
        if wrong:  # a hand-edited manifest: one line, not a readers' traceback far from the cause
            raise UserError(f"manifest artifact {entry.get('path', '?')!r}: field(s) of the wrong type: "
                            + ", ".join(wrong))
        return cls(**entry)

    def passed_gate(self) -> bool:
        """Every parity verdict recorded for it (one per kind of host CPU it was checked on) passed."""
        return bool(self.parity) and all(r.get("passed") for r in self.parity.values())

    def record_parity(self, target: str, result: dict) -> None:
        """The gate's result on this host (`target` = its CPU architecture); replaces an earlier one."""
        self.parity = (self.parity or {}) | {target: result}

    def clear_target(self, target: str) -> dict:
        """An empty {CPU model: result} table for `target` (replacing an earlier run's), to be filled."""
        self.targets = (self.targets or {}) | {target: {}}
        return self.targets[target]


# each field's type in the JSON (str, int or dict; the optional ones may also be null)
FIELD_TYPES = {name: next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
               for name, hint in typing.get_type_hints(Artifact).items()}


def _of_type(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def manifest_json(manifest: dict) -> str:
    """The manifest as written to manifest.json."""
    return json.dumps(manifest | {"artifacts": [a.to_json() for a in manifest["artifacts"]]}, indent=2) + "\n"


def read_manifest(out_dir: Path, needs: tuple[str, ...] = ()) -> dict:
    """manifest.json of an export folder, its artifacts as Artifact records; a user error if it is not one, or if
    it lacks an entry in `needs` that the caller reads (every export writes "model", "tokenizer", "parity_bundle";
    small manifests built by tests may not)."""
    path = Path(out_dir) / MANIFEST
    if not Path(out_dir).is_dir():
        raise UserError(f"export folder not found: {out_dir}")
    if not path.is_file():
        raise UserError(f"{out_dir} has no {MANIFEST} (not an export folder, or the export did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: not a manifest (a JSON object was expected)")
    if manifest.get("format_version") != MANIFEST_FORMAT:
        raise UserError(f"{path}: unsupported manifest format {manifest.get('format_version')!r}")
    check_structure(path, manifest)
    manifest["artifacts"] = [Artifact.from_json(a) for a in manifest["artifacts"]]
    for art in manifest["artifacts"]:
        if not (isinstance(art.sha256, str) and isinstance(art.bytes, int) and isinstance(art.format, str)):
            raise UserError(f"{path}: artifact {art.path!r} needs a string sha256 and format and an integer bytes")
    for rel in listed_paths(manifest):  # before any listed file is opened
        contained_path(out_dir, rel)
    missing = [k for k in needs if not isinstance(manifest.get(k), dict)]
    if "model" in needs and not missing:
        missing = [f"model.{k}" for k in MODEL_SIZES if not positive_int(manifest["model"].get(k))]
    if missing:  # a hand-edited manifest: one line, not a KeyError deep in the command
        raise UserError(f"{path} has no {', '.join(repr(k) for k in missing)} entry (every export writes it): "
                        "re-export the folder")
    return manifest


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_structure(path: Path, manifest: dict) -> None:
    """The parts readers index without looking: a user error (not a KeyError or TypeError) if one is malformed."""
    if not isinstance(manifest.get("model", {}), dict):
        raise UserError(f"{path}: 'model' is not an object")
    for key in ("tokenizer", "parity_bundle", "web_bundle"):
        entry = manifest.get(key)
        if entry is not None and not (isinstance(entry, dict) and all(isinstance(entry.get(k), str)
                                                                     for k in ("path", "sha256"))):
            raise UserError(f"{path}: {key!r} needs a \"path\" and a \"sha256\" string")
    for key in ("checkpoint", "calibration"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            raise UserError(f"{path}: {key!r} is not an object")
    artifacts = manifest.setdefault("artifacts", [])
    if not isinstance(artifacts, list) or not all(isinstance(a, dict) for a in artifacts):
        raise UserError(f"{path}: 'artifacts' must be a list of objects")


# ---- trust: paths stay inside the folder, files are what the manifest says ----
def listed_paths(manifest: dict) -> list:
    """Every file path a manifest names (artifacts, the files they came from, tokenizer, bundles, checkpoint,
    calibration), as written in it."""
    paths = []
    for art in manifest["artifacts"]:
        paths += [art.path] + ([art.converted_from] if art.converted_from is not None else [])
    for key in ("tokenizer", "parity_bundle", "web_bundle"):
        if manifest.get(key) is not None:
            paths.append(manifest[key]["path"])
    for key, fields in (("checkpoint", ("config", "weights")), ("calibration", ("set", "ranges"))):
        paths += [manifest[key][f] for f in fields if f in (manifest.get(key) or {})]
    return paths


def contained_path(out_dir: Path, rel) -> Path:
    """out_dir / rel for a path the manifest names; a user error for anything that could leave the folder: not
    a plain relative path (absolute, `..`, empty, a NUL byte), or a link resolving outside it. Opens nothing."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise UserError(f"{Path(out_dir) / MANIFEST} names {rel!r}, which is not a plain path inside the export "
                        "folder; refusing the folder")
    path = Path(out_dir) / rel
    try:
        inside = path.resolve().is_relative_to(Path(out_dir).resolve())
    except (OSError, RuntimeError):  # a link loop
        inside = False
    if not inside:
        raise UserError(f"{rel} in {out_dir} is a link to a file outside the export folder; refusing the folder")
    return path


def expected_sha256(manifest: dict) -> dict:
    """{path: sha256} of every file whose digest the manifest records."""
    digests = {art.path: art.sha256 for art in manifest["artifacts"]}
    for key in ("tokenizer", "parity_bundle", "web_bundle"):
        if manifest.get(key) is not None:
            digests[manifest[key]["path"]] = manifest[key]["sha256"]
    ckpt = manifest.get("checkpoint")
    if isinstance(ckpt, dict) and isinstance(ckpt.get("weights"), str) and "weights_sha256" in ckpt:
        digests[ckpt["weights"]] = ckpt["weights_sha256"]
    return digests


NO_VERIFY_HINT = "re-export, or pass --no-verify to load it anyway"


def verify_files(out_dir: Path, manifest: dict, paths=None, no_verify: bool = False,
                 hint: str = NO_VERIFY_HINT) -> list[Path]:
    """The files `paths` (as the manifest names them; None: every file it records a digest for, and the model
    config) that a command is about to load: each inside the folder, present and, unless no_verify, with the
    sha256 the manifest records; the config (which has no digest) must be the manifest's model. A user error
    naming the first file that is not. Returns their paths."""
    digests = expected_sha256(manifest)
    config = (manifest.get("checkpoint") or {}).get("config")
    if paths is None:
        paths = list(digests) + ([config] if config is not None else [])
    checked = []
    for rel in paths:
        path = contained_path(out_dir, rel)
        if not path.is_file():
            raise UserError(f"{rel} is missing from {out_dir} (listed in its {MANIFEST})")
        if not no_verify:
            if rel in digests:
                actual = sha256_file(path)
                if actual != digests[rel]:
                    raise UserError(f"{rel} does not match the sha256 in {Path(out_dir) / MANIFEST} (manifest "
                                    f"{str(digests[rel])[:12]}…, file {actual[:12]}…: the file was modified); {hint}")
            elif rel == config:
                check_model_config(path, manifest, hint)
            else:
                raise ValueError(f"{rel}: the manifest records no digest for it")  # a caller's mistake
        checked.append(path)
    return checked


def check_model_config(path: Path, manifest: dict, hint: str = NO_VERIFY_HINT) -> None:
    """config.json carries no digest: it must describe the model the manifest records."""
    config = dataclasses.asdict(ModelConfig.load(path))
    diff = sorted(k for k, v in manifest.get("model", {}).items() if config.get(k) != v)
    if diff:
        raise UserError(f"{path.name} in {path.parent} does not match the manifest's model (differs in "
                        f"{', '.join(diff)}: the file was modified); {hint}")
