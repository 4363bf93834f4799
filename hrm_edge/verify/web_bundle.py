"""The web parity bundle: a few validation windows and their fp32 eager logits, small enough for a phone.

The export's parity_bundle.npz holds 8 windows x 256 tokens x 4096 fp32 logits for the default model (32 MiB): too
much to download to a phone for a self-test. The web bundle keeps the first few windows, cut to the KV programs'
prefill length plus a few decode steps, so a phone runs the same prefill-then-decode path the parity gate runs
and compares with the same fp32 eager logits, with the manifest's tolerances (hrm_edge.verify.parity.compare).

One file, little-endian, read by the browser demo (hrm_edge/app/web/js/selftest.mjs) and the Android app's
plain-Java core (org.hrmedge.core.WebBundle):

    bytes 0..7      b"HRMWEB01"
    bytes 8..11     uint32 H: length of the JSON header (UTF-8, space-padded so 12 + H is a multiple of 4)
    bytes 12..      the JSON header: samples N, seq_len S, vocab_size V, prefill_len, windows [N][S + 1]
                    (inputs are [:, :-1], next-token targets [:, 1:]), tolerances, logits_offset, source
    logits_offset   float32 logits [N, S, V] of the fp32 eager model on the inputs

Logits of a causal model at position i depend on tokens[:i + 1] only, so the first S rows of a full
window's logits are the logits of its first S tokens (up to float summation order, ~1e-7).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hrm_edge.errors import UserError
from hrm_edge.io import atomic_write_bytes
from hrm_edge.runtime.decoders import OnnxDecoder, decode_logits
from hrm_edge.verify.parity import Tolerance, compare

WEB_BUNDLE = "web_bundle.bin"
MAGIC = b"HRMWEB01"
FORMAT_VERSION = 1
MAX_BYTES = 2 * 1024 * 1024  # a phone downloads this for every self-test: keep it at ~2 MB
N_WINDOWS = 3
DECODE_STEPS = 8  # decode steps after the prefill: the KV path a phone runs per typed token


@dataclass
class WebBundle:
    header: dict
    windows: np.ndarray  # [N, S + 1] int64
    logits: np.ndarray  # [N, S, V] float32

    @property
    def prefill_len(self) -> int:
        return int(self.header["prefill_len"])

    def tolerance(self, precision: str) -> Tolerance:
        """fp32 artifacts are held to the fp32 gate; quantized ones to what their quantization may cost vs fp32 (int4
        to the int4 bounds; a bundle written before it carried them: the int8 ones)."""
        key = f"{precision}_vs_fp32_eager"
        return Tolerance(**self.header["tolerances"].get(key, self.header["tolerances"]["int8_vs_fp32_eager"]))


def kv_prefill_len(manifest: dict) -> int:
    lens = {a["prefill_len"] for a in manifest["artifacts"] if a["program"] == "kv_cache" and "prefill_len" in a}
    if not lens:
        raise UserError("the manifest has no KV-cache artifact with a prefill_len; re-run python -m hrm_edge.export")
    return min(lens)


def web_bundle_bytes(manifest: dict, bundle: dict, n_windows: int = N_WINDOWS, decode_steps: int = DECODE_STEPS,
                     max_bytes: int = MAX_BYTES) -> bytes:
    """The web bundle's bytes (deterministic: the same export gives the same bytes). bundle: the parity
    bundle's arrays (hrm_edge.verify.parity.load_bundle). Fewer windows are kept when n_windows would pass max_bytes."""
    windows, fp32_logits = bundle["windows"], bundle["fp32_logits"]  # [N, S0 + 1], [N, S0, V]
    prefill = kv_prefill_len(manifest)
    seq_len = min(prefill + decode_steps, fp32_logits.shape[1])
    vocab = fp32_logits.shape[2]
    n = int(np.clip(max_bytes // (seq_len * vocab * 4), 1, min(n_windows, len(windows))))
    logits = np.ascontiguousarray(fp32_logits[:n, :seq_len], dtype="<f4")
    header = {
        "format": "hrm-edge web parity bundle", "format_version": FORMAT_VERSION,
        "samples": n, "seq_len": seq_len, "vocab_size": vocab, "prefill_len": min(prefill, seq_len),
        "windows": windows[:n, : seq_len + 1].astype(int).tolist(),
        "tolerances": {k: manifest["tolerances"][k] for k in ("fp32_vs_fp32_eager", "int8_vs_fp32_eager",
                                                              "int4_vs_fp32_eager") if k in manifest["tolerances"]},
        "source": {"parity_bundle_sha256": manifest["parity_bundle"]["sha256"],
                   "tokenizer_sha256": manifest["tokenizer"]["sha256"]},
        "logits_offset": 0,
    }
    # the offset is part of the header, whose length depends on the offset's digits: repeat until stable
    while True:
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
        text += b" " * (-(12 + len(text)) % 4)  # float32 data 4-byte aligned (a Float32Array view needs it)
        if header["logits_offset"] == 12 + len(text):
            break
        header["logits_offset"] = 12 + len(text)
    return MAGIC + struct.pack("<I", len(text)) + text + logits.tobytes()


def write_web_bundle(out_dir: Path, manifest: dict, bundle: dict) -> Path:
    """Write out_dir/web_bundle.bin from the export's parity bundle and manifest; returns its path.
    (To be called by the export pipeline, which also lists its sha256 in the manifest.)"""
    path = Path(out_dir) / WEB_BUNDLE
    atomic_write_bytes(path, web_bundle_bytes(manifest, bundle))
    return path


def read_web_bundle(path: Path) -> WebBundle:
    data = Path(path).read_bytes()
    if data[:8] != MAGIC or len(data) < 12:
        raise UserError(f"{path} is not a web parity bundle (bad magic)")
    (n_header,) = struct.unpack("<I", data[8:12])
    try:
        header = json.loads(data[12 : 12 + n_header].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: the web bundle's header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: the web bundle's header is not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: unsupported web bundle format {header.get('format_version')!r}")
    problem = shape_problem(header, len(data), 12 + n_header)
    if problem:
        raise UserError(f"{path}: {problem}")
    n, s, v = header["samples"], header["seq_len"], header["vocab_size"]
    logits = np.frombuffer(data, dtype="<f4", count=n * s * v, offset=header["logits_offset"]).reshape(n, s, v)
    return WebBundle(header, np.array(header["windows"], dtype=np.int64), logits.astype(np.float32))


def shape_problem(header: dict, size: int, header_end: int) -> str | None:
    """What does not fit in a web bundle's header (a cut or edited file), or None. WebBundle.java checks the same."""
    n, s, v, p = (header.get(k) for k in ("samples", "seq_len", "vocab_size", "prefill_len"))
    if not all(isinstance(x, int) and x >= 1 for x in (n, s, v, p)) or p > s:
        return "samples, seq_len, vocab_size must be >= 1 and prefill_len in 1..seq_len"
    windows = header.get("windows")
    if not (isinstance(windows, list) and len(windows) == n and all(
            isinstance(w, list) and len(w) == s + 1 and all(isinstance(t, int) and 0 <= t < v for t in w)
            for w in windows)):
        return f"windows must be {n} rows of {s + 1} token ids below {v}"
    offset = header.get("logits_offset")
    if not isinstance(offset, int) or offset < header_end or offset + 4 * n * s * v > size:
        return f"cut short or edited: {size:,} bytes, the header needs logits at {offset} for {4 * n * s * v:,} bytes"
    return None


def kv_logits(artifact_path: Path, web: WebBundle) -> np.ndarray:
    """Run a *.kv.onnx / *.kv.ort graph over the web bundle the way the page does: prefill prefill_len tokens,
    then one decode step per token. Returns logits [N, S, V]."""
    return decode_logits(OnnxDecoder(artifact_path), web.windows[:, :-1], web.prefill_len)


def check_web_bundle(logits: np.ndarray, web: WebBundle, precision: str) -> dict:
    """What the page's Self-test shows, computed in Python: hrm_edge.verify.parity.compare against the bundle."""
    return compare(logits, web.logits, web.windows[:, 1:], web.tolerance(precision), "fp32 eager (web bundle)")
