"""The on-device demo: a phone's browser runs the exported model (onnxruntime-web, WASM) as you type.

    python -m hrm_edge.demo export/out                  # open the printed http://localhost:8000/
    python -m hrm_edge.demo export/out --host 0.0.0.0   # prints the address a phone on the same network opens
    python -m hrm_edge.demo export/out --keyboard-bench # times the suggestion bar in headless Chromium, then exits

The server only hands out files; the model runs in the browser. It serves the page (hrm_edge/app/web/), its two
pinned JS packages (installed once with `npm ci` into ~/.cache/hrm-edge/web/, $XDG_CACHE_HOME honoured), and
from the export folder only what the page needs (tokenizer.json, the ONNX / ORT KV-cache programs, the web
parity bundle), each checked against the manifest's sha256 before the server starts (--no-verify skips it). An
ONNX program's graphs reach the page with their weights in one shared file (hrm_edge/app/shared_weights.py).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from hrm_edge.app.keyboard import BenchSettings, browser_keyboard_bench, heldout_pieces, heldout_text
from hrm_edge.app.shared_weights import EXTERNAL_MIN_BYTES, share_weights, weights_name
from hrm_edge.errors import ArgumentParser, UserError, run_cli
from hrm_edge.io import path_arg, refuse_out_of_range, refuse_unused, sha256_file
from hrm_edge.measure.harness import cpu_info, describe_cpu
from hrm_edge.quiet import quiet_third_party
from hrm_edge.runtime.manifest import contained_path, manifest_json, read_manifest, verify_files
from hrm_edge.verify.parity import load_bundle
from hrm_edge.verify.web_bundle import WEB_BUNDLE, web_bundle_bytes, write_web_bundle

WEB_DIR = Path(__file__).resolve().parent / "web"
# the files of the pinned packages the page imports (everything else in node_modules stays unserved)
VENDOR_FILES = {
    "/vendor/ort/ort.wasm.min.mjs": "onnxruntime-web/dist/ort.wasm.min.mjs",
    "/vendor/ort/ort-wasm-simd-threaded.mjs": "onnxruntime-web/dist/ort-wasm-simd-threaded.mjs",
    "/vendor/ort/ort-wasm-simd-threaded.wasm": "onnxruntime-web/dist/ort-wasm-simd-threaded.wasm",
    "/vendor/tokenizers/tokenizers.min.mjs": "@huggingface/tokenizers/dist/tokenizers.min.mjs",
}
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".mjs": "text/javascript; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".json": "application/json", ".wasm": "application/wasm"}
# COOP + COEP make the page cross-origin isolated (where the browser allows it: https or localhost), which
# gives onnxruntime-web SharedArrayBuffer and so its WASM threads.
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
                     "Cross-Origin-Resource-Policy": "same-origin"}


# ---- the pinned JS packages ----
def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hrm-edge"


def web_packages(log=print) -> Path:
    """node_modules of hrm_edge/app/web/package-lock.json, installed with `npm ci` on first use into a cache folder
    named by the lock file's hash (a changed lock file installs afresh)."""
    lock = (WEB_DIR / "package-lock.json").read_bytes()
    cache = cache_root() / "web"
    target = cache / hashlib.sha256(lock).hexdigest()[:16]
    if (target / ".installed").is_file():
        return target / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        raise UserError("npm not found: the demo page's JS packages are installed with `npm ci` (Debian: "
                        "apt-get install nodejs npm)")
    log(f"[demo] installing the page's pinned JS packages once (npm ci) into {target}")
    tmp = cache / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        install_web_packages(npm, tmp, target)
    except OSError as e:
        raise UserError(f"cannot write the page's package cache {cache}: {e.strerror or e}; set XDG_CACHE_HOME to a "
                        "writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / "node_modules"


def install_web_packages(npm: str, tmp: Path, target: Path) -> None:
    """`npm ci` of the page's lock file in `tmp`, then `tmp` renamed to `target`."""
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(WEB_DIR / name, tmp / name)
    proc = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                          cwd=tmp, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"npm ci failed (exit {proc.returncode}) in {tmp}: {last}")
    missing = [f for f in VENDOR_FILES.values() if not (tmp / "node_modules" / f).is_file()]
    if missing:
        raise UserError(f"npm ci did not install {', '.join(missing)}")
    (tmp / ".installed").write_text("ok\n")
    if not target.exists():  # another demo may have finished the same install meanwhile
        os.replace(tmp, target)


# ---- what is served from the export folder ----
def kv_artifacts(manifest: dict) -> list:
    """The KV programs the page may run: the ONNX graphs and the ORT-format ones, less an ORT-format MatMulNBits
    program. Its graphs cannot be given the page's form (float products over the 8-bit bytes, shared_weights), and
    onnxruntime-web's own MatMulNBits ran 3-5x slower (docs/keyboard-measurements.md); it is for native onnxruntime."""
    arts = [a for a in manifest["artifacts"] if a.program == "kv_cache" and (
        a.format == "onnx" or a.format == "ort" and (a.quantization or {}).get("mode") != "nbits")]
    if not arts:
        raise UserError("the export has no ONNX KV-cache artifact (*.kv.onnx), which the page runs; "
                        "re-run python -m hrm_edge.export with ONNX")
    return arts


def split_artifacts(manifest: dict, program: str) -> dict:
    """{KV graph path: its `program` ("draft" | "branch" | "verify") graph's artifact} for the ONNX KV graphs whose
    graph of that program was exported and passed the parity gate. The draft graph (the first outer cycle) and the
    verify graph (the rest of the depth) run Complete's adaptive depth; the branch graph (the draft's work for rows
    sharing one context) extends the suggestion bar's words (the draft graph does in an export without one)."""
    graphs = {a.path: a for a in manifest["artifacts"]
              if a.program == program and a.format == "onnx" and a.passed_gate()}
    return {a.path: graphs[a.path.replace(".kv.onnx", f".{program}.onnx")] for a in manifest["artifacts"]
            if a.program == "kv_cache" and a.path.replace(".kv.onnx", f".{program}.onnx") in graphs}


def web_bundle_path(out_dir: Path, manifest: dict, verify: bool, log=print) -> Path:
    """The web parity bundle, verified: by its manifest sha256 where the export listed it; otherwise against
    the bytes it must have (rebuilt from the sha256-checked parity bundle). Written there if missing."""
    listed = manifest.get("web_bundle")
    if listed:
        return verify_files(out_dir, manifest, [listed["path"]], no_verify=not verify)[0]
    path = contained_path(out_dir, WEB_BUNDLE)
    if path.is_file() and not verify:
        return path
    bundle = load_bundle(verify_files(out_dir, manifest, [manifest["parity_bundle"]["path"]], no_verify=not verify)[0])
    as_json = json.loads(manifest_json(manifest))  # hrm_edge.verify.web_bundle reads the manifest as JSON
    if not path.is_file():
        try:
            write_web_bundle(out_dir, as_json, bundle)
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None
        log(f"[demo] wrote the web parity bundle {path} ({path.stat().st_size:,} bytes)")
    elif path.read_bytes() != web_bundle_bytes(as_json, bundle):
        raise UserError(f"{WEB_BUNDLE} does not match the export's parity bundle (the file was modified); delete "
                        f"it to have it rebuilt, or pass --no-verify to serve it anyway")
    return path


def kind(art) -> str:
    """The selector's name for a program's numbers: its precision, and for a quantized one its mode ("int8 static",
    "int8 nbits": two int8 programs are told apart)."""
    mode = (art.quantization or {}).get("mode")
    return f"{art.precision} {mode}" if mode else art.precision


def page_default(arts: list) -> str:
    """The program the page opens with: of the KV graphs that passed the parity gate, the int8 one with 8-bit
    MatMulNBits weights (served as float MatMuls over its 8-bit bytes, shared_weights: in the browser the fastest
    program with the fp32 one and the smallest download, docs/keyboard-measurements.md), then another int8 one, then
    the rest; ONNX before ORT format. None passed: the first."""
    def rank(art) -> tuple:
        weights_only = art.precision == "int8" and (art.quantization or {}).get("mode") == "nbits"
        return not weights_only, art.precision != "int8", art.format != "onnx"

    return min((a for a in arts if a.passed_gate()), key=rank, default=arts[0]).path


def export_routes(out_dir: Path, manifest: dict, verify: bool, log=print) -> tuple[dict, dict]:
    """{url: file} of the export files the page needs (each checked against the manifest's sha256 unless not
    `verify`), and the page's configuration (/demo.json)."""
    arts = kv_artifacts(manifest)
    splits = {program: split_artifacts(manifest, program) for program in ("draft", "branch", "verify")}
    drafts, branches, verifies = splits["draft"], splits["branch"], splits["verify"]
    tok = manifest["tokenizer"]
    served = [tok["path"]] + [a.path for a in arts] + [g.path for graphs in splits.values() for g in graphs.values()]
    routes = {f"/export/{p}": f for p, f in zip(served, verify_files(out_dir, manifest, served, no_verify=not verify))}
    models = []
    for art in arts:
        depth = f", {art.cycles} outer cycle(s)" if art.cycles is not None else ""
        draft_art, branch_art, verify_art = drafts.get(art.path), branches.get(art.path), verifies.get(art.path)
        models.append({"id": art.path, "url": f"/export/{art.path}", "precision": art.precision,
                       "format": art.format, "bytes": art.bytes, "passed": art.passed_gate(),
                       "draft_url": f"/export/{draft_art.path}" if draft_art else None,
                       "verify_url": f"/export/{verify_art.path}" if verify_art and draft_art else None,
                       "branch_url": f"/export/{branch_art.path}" if branch_art else None,
                       "label": f"{kind(art)} {art.format}{depth} ({art.bytes / 1e6:.1f} MB)"})
    bundle = web_bundle_path(out_dir, manifest, verify, log)
    routes[f"/export/{bundle.name}"] = bundle
    config = {
        "models": models, "default_model": page_default(arts),
        "tokenizer": {"url": f"/export/{tok['path']}", "bos_id": tok.get("bos_id"), "eos_id": tok.get("eos_id")},
        "web_bundle": {"url": f"/export/{bundle.name}", "bytes": bundle.stat().st_size},
        "max_seq_len": manifest["model"]["max_seq_len"], "vocab_size": manifest["model"]["vocab_size"],
        "export": {"folder": out_dir.resolve().name, "passed": bool(manifest.get("passed"))},
    }
    return routes, config


def with_shared_weights(routes: dict, config: dict, log=print) -> None:
    """Serve each ONNX program's graphs (KV, branch, draft, verify) with their weights in one file (shared_weights),
    built once into a cache folder named by the graphs' sha256; edits `routes` and `config` in place: the graphs' urls
    name the new files, and the program's entry gets `weights` {url, path, bytes}, which the page's sessions need. A
    program whose graphs onnx cannot read keeps its self-contained files (a line says so)."""
    for model in (m for m in config["models"] if m["format"] == "onnx"):
        keys = [k for k in ("url", "branch_url", "draft_url", "verify_url") if model.get(k)]
        files = [routes[model[k]] for k in keys]
        key = " ".join([f"shared-weights 4 {EXTERNAL_MIN_BYTES}"] + [sha256_file(f) for f in files])
        target = cache_root() / "page" / hashlib.sha256(key.encode()).hexdigest()[:16]
        location = weights_name(model["id"])
        try:
            build_shared_weights(files, target, location)
        except (ValueError, OSError) as e:
            log(f"[demo] {model['id']}: serving its graphs as exported (their weights not shared: {e})")
            continue
        url = f"/shared/{target.name}"
        for k, f in zip(keys, files):
            model[k] = f"{url}/{f.name}"
            routes[model[k]] = target / f.name
        routes[f"{url}/{location}"] = target / location
        model["weights"] = {"url": f"{url}/{location}", "path": location, "bytes": (target / location).stat().st_size}
        shared = model["weights"]["bytes"] + sum((target / f.name).stat().st_size for f in files)
        log(f"[demo] {model['id']}: its {len(files)} graphs share one weights file ({shared / 1e6:.1f} MB to download "
            f"instead of {sum(f.stat().st_size for f in files) / 1e6:.1f} MB)")


def build_shared_weights(files: list[Path], target: Path, location: str) -> None:
    """share_weights into `target`, unless an earlier run built it (written in a temporary folder, then renamed)."""
    if (target / ".done").is_file():
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        share_weights(files, tmp, location)
        (tmp / ".done").write_text("ok\n")
        if not target.exists():  # another demo may have built the same meanwhile
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def page_routes(node_modules: Path) -> dict:
    """{url: file} of the page itself and of the vendored package files."""
    routes = {"/": WEB_DIR / "index.html", "/app/style.css": WEB_DIR / "style.css"}
    routes |= {f"/app/js/{p.name}": p for p in sorted((WEB_DIR / "js").glob("*.mjs"))}
    routes |= {url: node_modules / rel for url, rel in VENDOR_FILES.items()}
    return routes


# ---- the server ----
def served_files(routes: dict) -> dict:
    """{url: (path, identity)}: each file as it is when the server starts, after export_routes checked it (sha256,
    inside the folder); only that file is served: one changed, or swapped for a link, since is refused."""
    return {url: (path, file_identity(os.stat(path))) for url, path in routes.items()}


def file_identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_unchanged(path: Path, identity: tuple):
    """The open file if it is still the one of `identity` (not a link put in its place), else None."""
    try:
        f = open(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")
    except OSError:
        return None
    if file_identity(os.fstat(f.fileno())) != identity:
        f.close()
        return None
    return f


class DemoHandler(BaseHTTPRequestHandler):
    """GET/HEAD of a fixed table of files (served_files): no directory listing, and a path not in the table is a
    404, so `..`, absolute paths and links cannot reach anything else. Each file's ETag is its size and time: a
    reload revalidates it (304) instead of downloading the runtime's WASM and the programs again."""

    server_version = "hrm-edge-demo"

    def __init__(self, *args, routes: dict, config: bytes, quiet: bool, **kwargs):
        self.routes, self.config, self.quiet = routes, config, quiet
        super().__init__(*args, **kwargs)

    def do_GET(self):
        self.respond(send_body=True)

    def do_HEAD(self):
        self.respond(send_body=False)

    def respond(self, send_body: bool):
        url = unquote(urlsplit(self.path).path)
        if url == "/demo.json":
            self.send_body(self.config, "application/json", send_body)
            return
        if url not in self.routes:
            self.send_error(404, "not served")
            return
        path, identity = self.routes[url]
        f = open_unchanged(path, identity)
        if f is None:
            self.send_error(410, f"{path.name} changed since the server started: restart it")
            return
        with f:
            etag = f'"{identity[2]:x}-{identity[3]:x}"'
            if self.headers.get("If-None-Match") == etag:
                self.send_response(304)
                self.send_header("ETag", etag)
                for k, v in ISOLATION_HEADERS.items():
                    self.send_header(k, v)
                self.end_headers()
                return
            body = f.read()
        self.send_body(body, CONTENT_TYPES.get(path.suffix, "application/octet-stream"), send_body, etag)

    def send_body(self, body: bytes, ctype: str, send_body: bool, etag: str | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        if etag:
            self.send_header("ETag", etag)
        for k, v in ISOLATION_HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, fmt, *args):
        if not self.quiet:
            sys.stderr.write(f"[demo] {self.address_string()} {fmt % args}\n")


class DualStackServer(ThreadingHTTPServer):
    """An IPv6 server; on "::" it takes IPv4 clients too (where the system allows both on one socket)."""
    address_family = socket.AF_INET6

    def server_bind(self):
        with contextlib.suppress(AttributeError, OSError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def server_class(host: str) -> type:
    """The server for --host: IPv6 for an IPv6 address ("::", "::1"), else IPv4."""
    return DualStackServer if ":" in host else ThreadingHTTPServer


def listen(host: str, port: int, handler) -> ThreadingHTTPServer:
    """A server bound to host:port (IPv4 or IPv6 by the address), or one line saying why not."""
    try:
        return server_class(host)((host, port), handler)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def addresses_to_open(host: str, port: int) -> list[str]:
    """The URLs to print: localhost for a local server; this machine's network addresses for 0.0.0.0 or ::."""
    if host not in ("0.0.0.0", "::", ""):
        shown = "localhost" if host in ("127.0.0.1", "localhost") else f"[{host}]" if ":" in host else host
        return [f"http://{shown}:{port}/"]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        ips = sorted({i[4][0] for i in infos if not i[4][0].startswith("127.")})
    except OSError:
        ips = []
    return [f"http://{ip}:{port}/" for ip in ips] or [f"http://<this machine's address>:{port}/"]


def refuse_bad_values(a) -> None:
    """One line for the first flag whose value cannot be used (before the export folder is read)."""
    if not a.host.strip():  # the socket would take "" as every interface: say so instead
        raise UserError("--host is empty: give 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    refuse_out_of_range(("--port", a.port, 0 <= a.port <= 65535, "in 0..65535"),
                        ("--keyboard-chars", a.keyboard_chars, a.keyboard_chars >= 2, ">= 2"),
                        ("--keyboard-interval", a.keyboard_interval, 0 <= a.keyboard_interval <= 10_000,
                         "in 0..10000 ms"),
                        ("--keyboard-threads", a.keyboard_threads, 1 <= a.keyboard_threads <= 16, "in 1..16"),
                        ("--keyboard-cpu-slowdown", a.keyboard_cpu_slowdown, 1 <= a.keyboard_cpu_slowdown <= 20,
                         "in 1..20"))
    if a.keyboard_cpu_slowdown != 1 and a.keyboard_threads != 1:  # the threads past the first would run unslowed
        raise UserError("--keyboard-cpu-slowdown slows the page's main thread, not onnxruntime-web's worker threads: "
                        "leave out --keyboard-threads (or give 1)")


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m hrm_edge.demo", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=path_arg, help="export folder (holds manifest.json and a *.kv.onnx program)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0, or :: for IPv6 and IPv4: "
                        "reachable from a phone on the same network)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--no-verify", action="store_true",
                   help="serve the export's files without checking them against the manifest's sha256")
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    p.add_argument("--verbose", action="store_true", help="show the runtimes' own warnings and log lines")
    p.add_argument("--keyboard-bench", action="store_true",
                   help="type held-out code (the built corpus's validation split) into the page's suggestion bar in "
                        "headless Chromium at a phone viewport, print ms per keystroke, top-3 word accuracy and "
                        "keystroke savings, and exit")
    p.add_argument("--keyboard-chars", type=int, default=600,
                   help="characters typed by --keyboard-bench (default 600; with --keyboard-sample spread, from each "
                        "held-out project)")
    p.add_argument("--keyboard-sample", choices=("start", "spread"), default="start",
                   help="--keyboard-bench's held-out code: start (default): the start of the first validation file "
                        "that long; spread: pieces from the middles of equal stretches of each held-out project's "
                        "files, each typed from an empty context, as python -m hrm_edge.evaluate --keyboard types them")
    p.add_argument("--keyboard-text", type=path_arg, help="a text file for --keyboard-bench instead of held-out code")
    p.add_argument("--keyboard-model", metavar="ID",
                   help="--keyboard-bench: the page's program to type with, an artifact id such as "
                        "hrm.int8-nbits.kv.onnx (default: the page's default program)")
    p.add_argument("--keyboard-threads", type=int, default=1, metavar="N",
                   help="--keyboard-bench: onnxruntime-web's WASM threads (default 1: what the page gets over plain "
                        "http from a phone, without cross-origin isolation; more need the isolation this server gives)")
    p.add_argument("--keyboard-full-depth", action="store_true",
                   help="--keyboard-bench: extend the suggestions' words with the full depth instead of the branch "
                        "(or draft) graph, the first outer cycle, to compare")
    p.add_argument("--keyboard-interval", type=float, default=0, metavar="MS",
                   help="--keyboard-bench: type a key every MS milliseconds, as a typist does, the page computing the "
                        "likeliest next keys' chips in between (its lookahead); each key's time counts from when it "
                        "was due (default 0: each key as soon as the last one's chips are there, no lookahead)")
    p.add_argument("--keyboard-cpu-slowdown", type=float, default=1, metavar="X",
                   help="--keyboard-bench: slow the page's main thread down X times (1..20) with Chromium's CPU "
                        "throttling (DevTools' setting; Lighthouse's mobile runs use 4): an estimate of a slower CPU "
                        "such as a phone's, not a measurement of one; only with one WASM thread, so not with "
                        "--keyboard-threads (default 1: not slowed)")
    p.add_argument("--keyboard-profile", action="store_true",
                   help="--keyboard-bench: run Chromium's sampling profiler over the typing and print where the "
                        "page's time went: its JS functions, onnxruntime-web's WASM kernels, the browser's own work")
    a = p.parse_args(argv)
    quiet_third_party(a.verbose)
    refuse_unused(p, a, ("--keyboard-chars", "--keyboard-sample", "--keyboard-text", "--keyboard-model",
                         "--keyboard-threads", "--keyboard-full-depth", "--keyboard-interval",
                         "--keyboard-cpu-slowdown", "--keyboard-profile"), "--keyboard-bench")
    refuse_bad_values(a)
    manifest = read_manifest(a.dir)
    routes, config = export_routes(a.dir, manifest, verify=not a.no_verify)
    ids = [m["id"] for m in config["models"]]
    if a.keyboard_model is not None and a.keyboard_model not in ids:
        raise UserError(f"--keyboard-model {a.keyboard_model!r} is not one of the page's programs: {', '.join(ids)}")
    routes |= page_routes(web_packages())
    with_shared_weights(routes, config)
    handler = partial(DemoHandler, routes=served_files(routes), config=json.dumps(config).encode(),
                      quiet=a.quiet or a.keyboard_bench)
    host, port = ("127.0.0.1", 0) if a.keyboard_bench else (a.host, a.port)
    server = listen(host, port, handler)
    if a.keyboard_bench:
        return keyboard_bench(server, a)
    port = server.server_address[1]
    print(f"[demo] serving {a.dir} ({len(config['models'])} model(s); the model runs in the browser)")
    for url in addresses_to_open(a.host, port):
        print(f"open {url}", flush=True)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print("[demo] note: over plain http from another device the page is not cross-origin isolated, so "
              "onnxruntime-web runs on one thread there (still a few ms per token)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def keyboard_bench(server: ThreadingHTTPServer, a) -> int:
    """--keyboard-bench: the page's default program typing held-out code (or --keyboard-text)."""
    if a.keyboard_text is not None and not a.keyboard_text.is_file():
        raise UserError(f"--keyboard-text {a.keyboard_text} is a folder, not a text file" if a.keyboard_text.is_dir()
                        else f"--keyboard-text file not found: {a.keyboard_text}")
    if a.keyboard_text is not None and a.keyboard_sample == "spread":
        raise UserError("--keyboard-sample spread samples the held-out projects: leave it out with --keyboard-text")
    if a.keyboard_text is not None:
        try:
            texts = [a.keyboard_text.read_text(encoding="utf-8")[: a.keyboard_chars]]
        except UnicodeDecodeError as e:
            raise UserError(f"--keyboard-text {a.keyboard_text} is not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None
        if len(texts[0]) < 2:
            raise UserError(f"--keyboard-text {a.keyboard_text} holds fewer than 2 characters to type")
    else:
        texts = heldout_pieces(a.keyboard_chars) if a.keyboard_sample == "spread" else [heldout_text(a.keyboard_chars)]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    try:
        settings = BenchSettings(a.keyboard_model, a.keyboard_threads, not a.keyboard_full_depth,
                                 a.keyboard_interval, a.keyboard_cpu_slowdown, a.keyboard_profile)
        r = browser_keyboard_bench(f"http://127.0.0.1:{server.server_address[1]}/", texts, settings)
    finally:
        server.shutdown()
        server.server_close()
    pieces = f" in {r['texts']} pieces, each from an empty context" if r["texts"] > 1 else ""
    print(f"[demo] keyboard bench: {r['model']}, {r['characters']} characters typed one at a time{pieces}, "
          f"{r['browser']}")
    # every timing below belongs to this machine: the CPUs these benches ran on differed by 2x and more
    print(f"{describe_cpu(cpu_info())}; {started} UTC, load average {os.getloadavg()[0]:.1f} at the end")
    if r["cpu_slowdown"] != 1:
        print(f"the page's main thread slowed down {r['cpu_slowdown']:g}x by Chromium's CPU throttling: an estimate "
              f"of a slower CPU, not a measurement of one")
    if r["load_ms"] is not None:  # in the browser: the sessions made (graphs optimized, weights folded) and run once
        print(f"the program loaded in {r['load_ms']:.0f} ms (its weights from this server, its sessions made and run "
              f"once)")
    if r["interval_ms"] > 0:
        print(f"a key every {r['interval_ms']:g} ms; the lookahead had computed the chips of {r['ahead']:.0%} of the "
              f"keys, at {r['ahead_calls']:.2f} more graph calls a key")
    extension = "the full depth" if r["extender"] == "full depth" else f"the {r['extender']} graph"
    print(f"ms per keystroke: median {r['median_ms']:.1f}, p90 {r['p90_ms']:.1f}, p99 {r['p99_ms']:.1f}, max "
          f"{r['max_ms']:.1f} ({r['threads']} WASM thread(s); words extended by {extension})")
    for name, part in (("all keystrokes", r["time"]["all"]), ("the slowest tenth", r["time"]["slowest_tenth"])):
        rest = 1 - part["kv_share"] - part["draft_share"]
        print(f"  {name}: {part['ms_mean']:.1f} ms, {part['calls_mean']:.2f} graph calls a keystroke; time in the KV "
              f"graph {part['kv_share']:.0%}, {extension} {part['draft_share']:.0%}, the page's JS {rest:.0%}")
    kv = ", ".join(f"{tokens} token(s) {ms:.1f} ms ({n})" for tokens, (n, ms) in r["calls"]["kv"].items())
    rows = ", ".join(f"{rows} row(s) {ms:.1f} ms ({n})" for rows, (n, ms) in r["calls"]["draft"].items())
    print(f"  a call, median (how many): KV graph {kv}" + (f"; {extension} {rows}" if rows else ""))
    print(f"top-3 next-word accuracy at {r['word_starts']} word starts: {r['top3_word_accuracy']:.1%}; keystroke "
          f"savings {r['keystroke_savings']:.1%}; partial-word chips: {r['partial_chips']}")
    if r["memory"]:  # the page's renderer process, its weights and caches in onnxruntime-web's WASM memory included
        m = r["memory"]
        print(f"the page's memory after the typing: {m['anon_mb']:.0f} MB private (V8's heap: {m['js_heap_mb']:.0f} MB "
              f"of JS objects, the WASM memory; a blank page's {m['blank_anon_mb']:.0f} MB), {m['rss_mb']:.0f} MB "
              f"resident with Chromium's code (peak {m['peak_mb']:.0f} MB)")
    if r["profile"]:
        total = sum(ms for _, ms in r["profile"])
        print(f"where the page's time went (Chromium's sampling profiler, {total:.0f} ms sampled, idle left out; "
              f"the profiler's own cost makes the times above slower than an unprofiled bench's):")
        for part, ms in r["profile"]:
            print(f"  {ms / total:6.1%} {ms:8.1f} ms  {part}")
    return 0
