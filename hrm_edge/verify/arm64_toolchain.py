"""The ARM64 emulation toolchain: what `python -m hrm_edge.parity DIR --target aarch64` runs the artifacts with.

    python -m hrm_edge.arm64 [--no-pte]     # only fetch it (the gate, hrm_edge.verify.arm64_gate, fetches on first use)

What runs: Debian bookworm's arm64 CPython 3.11 (its .debs unpacked into one folder, nothing installed)
under the static qemu-aarch64 of Debian trixie's qemu-user (10.x; bookworm's 7.2 segfaults when
onnxruntime loads), with the aarch64 wheels of the host's own onnxruntime and numpy versions. For .pte
files also torch + executorch + torchao (ExecuTorch's pybindings link libtorch), and, because torch's
aarch64 wheel links CUDA libraries it never calls on a CPU, the NVIDIA aarch64 wheels (~3 GB) unpacked
only for the dynamic linker.

Everything is fetched once per machine into cache_dir(). Each piece is built in a ".partial" folder and
renamed into place only when complete (a marker file records what and how big), so an interrupted
download is redone, never half-used. apt runs with a private configuration and state inside that
folder: the system's sources, architectures and package database are never touched (no
`dpkg --add-architecture`, no trixie source left behind, nothing installed).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from hrm_edge.errors import ArgumentParser, UserError

TARGET = "aarch64"
# A phone-class big core (Armv8.2-A: NEON + dot product, no i8mm/SVE) and QEMU's everything-on model
# (adds i8mm, SVE/SVE2, SME, bf16): onnxruntime and XNNPACK pick different int8 kernels on each.
DEFAULT_CPU_MODELS = ("cortex-a76", "max")
PYTHON_VERSION = "3.11"  # the project's Python (setup.cfg); the arm64 root and the wheels must match it

DEBIAN_MIRROR = os.environ.get("HRM_EDGE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_SECURITY = os.environ.get("HRM_EDGE_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# python3.11-minimal and the libraries it and its stdlib extension modules load (ctypes, ssl, sqlite3, ...)
PYTHON_DEBS = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libc6", "libexpat1",
               "zlib1g", "libffi8", "libssl3", "libbz2-1.0", "liblzma5", "libgcc-s1", "libstdc++6", "libsqlite3-0",
               "libuuid1", "libncursesw6", "libtinfo6", "libreadline8", "libgomp1", "libdb5.3", "libnsl2",
               "libtirpc3", "libcrypt1")
# manylinux tags an aarch64 wheel of our dependencies may carry (NVIDIA's use 2_17..2_39 and manylinux2014)
AARCH64_PLATFORMS = ("manylinux2014_aarch64",) + tuple(f"manylinux_2_{v}_aarch64" for v in range(17, 40))
# What `import torch; import executorch.runtime; import executorch.kernels.quantized` imports beyond torch,
# executorch, torchao and numpy (measured with sys.modules); installed --no-deps at the host's versions.
PTE_PURE_PYTHON_DEPS = ("filelock", "typing_extensions", "sympy", "mpmath", "networkx", "Jinja2", "MarkupSafe",
                        "ruamel.yaml", "tabulate", "tqdm")
# The CUDA libraries torch's aarch64 wheel is linked against (its metadata's cuda-toolkit 13.0.3 extras and
# pins). nccl 2.29.7, the version torch names, has no aarch64 wheel; 2.32.3 has the same soname. Never called
# on a CPU: they only have to be there for the dynamic linker.
NVIDIA_WHEELS = {
    "2.13.0": ("nvidia-cublas==13.1.1.3.*", "nvidia-cuda-cupti==13.0.85.*", "nvidia-cuda-nvrtc==13.0.88.*",
               "nvidia-cufft==12.0.0.61.*", "nvidia-cufile==1.15.1.6.*", "nvidia-curand==10.4.0.35.*",
               "nvidia-cusolver==12.0.4.66.*", "nvidia-cusparse==12.6.3.3.*", "nvidia-nvjitlink>=13.0.88,<14",
               "nvidia-nvtx==13.0.85.*", "nvidia-cuda-runtime==13.0.96.*", "nvidia-cudnn-cu13==9.20.0.48",
               "nvidia-cusparselt-cu13==0.8.1", "nvidia-nccl-cu13==2.32.3", "nvidia-nvshmem-cu13==3.4.5"),
}
DONE = ".complete.json"  # written last into a step's folder: the step finished


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/hrm-edge/aarch64, else ~/.cache/hrm-edge/aarch64."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hrm-edge" / TARGET


# ---- small helpers ----
def _host_version(dist: str) -> str:
    """The host's installed version of a distribution without its local part (2.13.0+cpu -> 2.13.0)."""
    try:
        return version(dist).split("+")[0]
    except PackageNotFoundError:
        raise UserError(f"{dist} is not installed on this host; the aarch64 target uses the host's {dist} "
                        f"version (pip install {dist})") from None


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def _run(cmd: list, what: str, hint: str, log=None, cwd=None, env=None, timeout: float = 1800) -> str:
    """Run a fetch command; relay its download lines to log; raise a one-line UserError when it fails."""
    try:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=cwd, env=env, errors="replace")
    except FileNotFoundError:
        raise UserError(f"{what} failed: {cmd[0]} not found; {hint}") from None
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if log and line.lstrip().startswith(("Downloading", "Get:", "Fetched", "Installing collected")):
                log(f"      {line.strip()[:150]}")
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode != 0:
        errs = [ln for ln in lines if ln.strip().startswith(("E:", "Err:", "ERROR", "error", "W: Failed"))] or lines[-1:]
        detail = " | ".join(e.strip() for e in errs[-2:])[:400] or "no output"
        if proc.returncode < 0:
            detail = f"killed after {timeout:.0f} s; {detail}"
        raise UserError(f"{what} failed (exit {proc.returncode}): {detail}; {hint}")
    return "\n".join(lines)


@contextlib.contextmanager
def _locked(path: Path, log):
    """One process fetches at a time (a second one waits, then finds the steps done)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[aarch64] waiting for another process that is fetching into {path.parent}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def step(root: Path, name: str, build, log, what: str, need_bytes: float = 0) -> Path:
    """root/name, built once: build(tmp) fills root/.name.partial, which is renamed to root/name only after a
    marker recording the step was written into it; a killed or failed build leaves no root/name."""
    final = root / name
    marker = final / DONE
    if marker.is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise UserError(f"fetching {what} needs ~{_gb(int(need_bytes))} in {root}; only {_gb(free)} free (point "
                        "XDG_CACHE_HOME elsewhere)")
    tmp = root / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)  # an old folder without its marker is not trusted
    tmp.mkdir(parents=True)
    log(f"[aarch64] fetching {what} into {final}")
    t0 = time.time()
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = _folder_bytes(tmp)
    record = {"step": name, "what": what, "bytes": size, "seconds": round(time.time() - t0, 1),
              "fetched_unix": int(time.time())}
    (tmp / DONE).write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, final)
    log(f"[aarch64]   done: {_gb(size)} in {record['seconds']:.0f} s")
    return final


# ---- apt with a private configuration (the system's sources, architectures and dpkg state stay as they are) ----
def _apt_options(state: Path, arch: str) -> list[str]:
    opts = {
        "Dir::State": state, "Dir::State::Lists": state / "lists", "Dir::State::status": state / "status",
        "Dir::Cache": state / "cache", "Dir::Etc::SourceList": state / "sources.list",
        "Dir::Etc::SourceParts": state / "sources.list.d", "Dir::Etc::Preferences": state / "preferences",
        "Dir::Etc::PreferencesParts": state / "preferences.d", "APT::Architecture": arch,
        "Debug::NoLocking": "1",  # the locks guard the system's state; ours is private (and under _locked)
    }
    if os.geteuid() == 0:  # apt would drop to user _apt, who cannot write into root's cache folder
        opts["APT::Sandbox::User"] = "root"
    return [f"-o{k}={v}" for k, v in opts.items()] + [f"-oAPT::Architectures::={arch}"]


def apt_download(state: Path, suites: list[tuple[str, str]], arch: str, packages, dest: Path, log) -> list[Path]:
    """apt-get update + apt-get download of `packages` for `arch` from `suites` [(mirror, suite)] into dest."""
    if not DEBIAN_KEYRING.is_file():
        raise UserError(f"{DEBIAN_KEYRING} not found: apt needs Debian's archive keyring to verify the packages "
                        "(apt-get install debian-archive-keyring)")
    for d in ("lists/partial", "cache/archives/partial", "sources.list.d", "preferences.d"):
        (state / d).mkdir(parents=True, exist_ok=True)
    (state / "status").touch()
    (state / "sources.list").write_text("".join(f"deb [signed-by={DEBIAN_KEYRING}] {m} {s} main\n" for m, s in suites))
    opts = _apt_options(state, arch)
    hint = f"are the Debian mirrors ({', '.join(sorted({m for m, _ in suites}))}) reachable?"
    # --error-on=any: an unreachable mirror fails the update (by default apt only warns, and exits 0)
    _run(["apt-get", *opts, "update", "--error-on=any"], f"apt-get update ({', '.join(s for _, s in suites)}, {arch})", hint, log)
    dest.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", *opts, "download", *packages], f"apt-get download of {len(packages)} {arch} package(s)",
         hint, log, cwd=dest)
    debs = sorted(dest.glob("*.deb"))
    if len(debs) < len(packages):
        raise UserError(f"apt-get download fetched {len(debs)} of {len(packages)} packages into {dest}")
    return debs


def _debian_arch() -> str:
    try:
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise UserError("dpkg not found: the aarch64 target fetches its arm64 Python and QEMU as Debian packages "
                        "(a Debian or Ubuntu host is needed)") from None


# ---- the toolchain ----
@dataclass
class Toolchain:
    qemu: Path
    root: Path  # the arm64 Python's root folder (qemu -L)
    python_path: list[Path]  # aarch64 site folders
    library_path: list[Path] = field(default_factory=list)  # NVIDIA libraries for the dynamic linker (.pte)
    versions: dict = field(default_factory=dict)

    @property
    def python(self) -> Path:
        return self.root / "usr" / "bin" / f"python{PYTHON_VERSION}"

    def command(self, cpu_model: str, args: list) -> list[str]:
        return [str(self.qemu), "-cpu", cpu_model, "-L", str(self.root), str(self.python), *map(str, args)]

    def env(self, extra_python_path: list[Path] = ()) -> dict:
        """A clean environment for the emulated Python (nothing of the host's venv leaks in)."""
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
               "PYTHONPATH": os.pathsep.join(map(str, [*extra_python_path, *self.python_path])),
               "PYTHONNOUSERSITE": "1", "PYTHONUNBUFFERED": "1",
               # emulated imports are slow (torch ~20-40 s); keep their bytecode between runs
               "PYTHONPYCACHEPREFIX": str(cache_dir() / "pycache")}
        if self.library_path:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(map(str, self.library_path))
        return env

    def run_python(self, cpu_model: str, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cpu_model, ["-c", code]), capture_output=True, text=True,
                              env=self.env(), timeout=timeout)


def _pip(target: Path, requirements: list[str], what: str, log, no_deps: bool = False) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--no-input",
           "--target", target, "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for plat in AARCH64_PLATFORMS:
        cmd += ["--platform", plat]
    if no_deps:
        cmd.append("--no-deps")
    _run(cmd + requirements, f"pip install of {what} for aarch64", "is PyPI reachable, and does that version have "
         "an aarch64 wheel for CPython 3.11?", log)


def _fetch_qemu(tmp: Path, log) -> None:
    arch = _debian_arch()
    if arch != "amd64":
        raise UserError(f"the aarch64 target emulates ARM64 on an x86_64 (amd64) host; this host is {arch} "
                        "(on an ARM64 host run `python -m hrm_edge.parity DIR` natively)")
    debs = apt_download(tmp / "apt", [(DEBIAN_MIRROR, "trixie")], "amd64", ["qemu-user"], tmp / "debs", log)
    # only the one static binary we need out of the package (dpkg-deb's data tarball, read as a stream)
    dpkg = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(debs[0])], stdout=subprocess.PIPE)
    found = False
    with tarfile.open(fileobj=dpkg.stdout, mode="r|") as tar:
        for member in tar:
            if member.name in ("./usr/bin/qemu-aarch64", "usr/bin/qemu-aarch64") and member.isfile():
                member.name = "qemu-aarch64"
                tar.extract(member, tmp / "bin", filter="data" if hasattr(tarfile, "data_filter") else None)
                found = True
    dpkg.wait()
    if dpkg.returncode or not found:
        raise UserError(f"{debs[0].name} has no usr/bin/qemu-aarch64 (dpkg-deb exit {dpkg.returncode})")
    os.chmod(tmp / "bin" / "qemu-aarch64", 0o755)
    shutil.rmtree(tmp / "apt")
    shutil.rmtree(tmp / "debs")


def _fetch_python_root(tmp: Path, log) -> None:
    # bookworm only: with a trixie source in the same apt configuration apt picks trixie's libc6 and the
    # root breaks ("Could not open '/lib/ld-linux-aarch64.so.1'")
    suites = [(DEBIAN_MIRROR, "bookworm"), (DEBIAN_MIRROR, "bookworm-updates"), (DEBIAN_SECURITY, "bookworm-security")]
    work = tmp.parent / f"{tmp.name}.apt"
    shutil.rmtree(work, ignore_errors=True)
    try:
        debs = apt_download(work / "apt", suites, "arm64", PYTHON_DEBS, work / "debs", log)
        for deb in debs:  # unpacked, not installed: no maintainer scripts, no dpkg database
            _run(["dpkg", "-x", deb, tmp], f"dpkg -x {deb.name}", "is the download complete?")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not (tmp / "usr" / "bin" / f"python{PYTHON_VERSION}").is_file():
        raise UserError(f"the unpacked arm64 packages hold no usr/bin/python{PYTHON_VERSION}")


def _checked(tc: Toolchain, marker: Path, code: str, what: str, expect: str, log, timeout: float = 900) -> str:
    """Run `code` in the emulated Python once (its last output line is kept in `marker`): proves the piece works
    before anything relies on it; the first emulated torch import also fills the bytecode cache."""
    if marker.is_file():
        return marker.read_text().strip()
    log(f"[aarch64] checking {what} under emulation (once; up to a few minutes for torch)")
    try:
        proc = tc.run_python(DEFAULT_CPU_MODELS[0], code, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what} under qemu-aarch64 did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0 or expect not in proc.stdout:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise UserError(f"{what} under qemu-aarch64 failed (exit {proc.returncode}): {err}")
    line = proc.stdout.strip().splitlines()[-1]
    marker.write_text(line + "\n")
    return line


def ensure_toolchain(need_pte: bool, log=print) -> Toolchain:
    """Fetch (once per machine, into cache_dir()) what running the artifacts on emulated ARM64 needs: qemu-aarch64,
    an arm64 Python root, aarch64 onnxruntime + numpy, and with need_pte torch + executorch (+ NVIDIA libraries)."""
    if platform.system() != "Linux":
        raise UserError("the aarch64 target needs a Linux host (QEMU user-mode emulation)")
    root = cache_dir()
    ort_v, np_v = _host_version("onnxruntime"), _host_version("numpy")
    with _locked(root / ".lock", log):
        qemu_dir = step(root, "qemu-trixie", lambda t: _fetch_qemu(t, log), log,
                        "QEMU user mode (qemu-aarch64 from Debian trixie's qemu-user, ~71 MB download)")
        py_root = step(root, "python-bookworm-arm64", lambda t: _fetch_python_root(t, log), log,
                       f"an arm64 Python {PYTHON_VERSION} root (Debian bookworm .debs, ~12 MB)")
        ort_site = step(root, f"site-onnxruntime-{ort_v}-numpy-{np_v}",
                        lambda t: _pip(t, [f"onnxruntime=={ort_v}", f"numpy=={np_v}"],
                                       f"onnxruntime {ort_v} + numpy {np_v}", log), log,
                        f"aarch64 wheels of onnxruntime {ort_v} and numpy {np_v} (~40 MB)")
        tc = Toolchain(qemu=qemu_dir / "bin" / "qemu-aarch64", root=py_root, python_path=[ort_site])
        version_line = subprocess.run([str(tc.qemu), "--version"], capture_output=True, text=True).stdout
        tc.versions = {"qemu": version_line.splitlines()[0].removeprefix("qemu-aarch64 version ") if version_line else "?",
                       "onnxruntime": ort_v, "numpy": np_v}
        tc.versions["python"] = _checked(tc, ort_site / ".imports-ok", "import platform, ctypes, ssl, sqlite3, "
                                         "onnxruntime, numpy; print(platform.machine(), platform.python_version())",
                                         "python + onnxruntime import", "aarch64", log, timeout=300).split()[-1]
        if need_pte:
            torch_v, et_v, ao_v = _host_version("torch"), _host_version("executorch"), _host_version("torchao")
            if torch_v not in NVIDIA_WHEELS:
                raise UserError(f"no list of the NVIDIA libraries torch {torch_v}'s aarch64 wheel links; add one to "
                                "hrm_edge.verify.arm64_toolchain.NVIDIA_WHEELS (see the wheel's Requires-Dist)")
            nv = step(root, f"nvidia-for-torch-{torch_v}",
                      lambda t: _pip(t, list(NVIDIA_WHEELS[torch_v]), "the NVIDIA CUDA libraries torch links", log,
                                     no_deps=True), log,
                      f"the NVIDIA aarch64 libraries torch {torch_v} links (never called on a CPU; ~3 GB)",
                      need_bytes=3.5e9)
            deps = []
            for dist in PTE_PURE_PYTHON_DEPS:
                try:
                    deps.append(f"{dist}=={_host_version(dist)}")
                except UserError:
                    deps.append(dist)
            torch_site = step(root, f"site-torch-{torch_v}-executorch-{et_v}",
                              lambda t: _pip(t, [f"torch=={torch_v}", f"executorch=={et_v}", f"torchao=={ao_v}", *deps],
                                             f"torch {torch_v} + executorch {et_v}", log, no_deps=True), log,
                              f"aarch64 wheels of torch {torch_v}, executorch {et_v}, torchao {ao_v} (~1.1 GB)",
                              need_bytes=1.5e9)
            tc.python_path += [torch_site, nv]
            tc.library_path = sorted(nv.glob("nvidia/*/lib"))
            tc.versions |= {"torch": torch_v, "executorch": et_v, "torchao": ao_v}
            _checked(tc, torch_site / ".imports-ok", "import torch, executorch.runtime, executorch.kernels.quantized; "
                     "print('ok')", "import torch + executorch.runtime (needed for .pte files; --formats onnx checks "
                     "the ONNX and ORT artifacts without it)", "ok", log)
    return tc


def qemu_cpu_models(tc: Toolchain) -> list[str]:
    out = subprocess.run([str(tc.qemu), "-cpu", "help"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines()[1:] if ln.strip()]


# ---- CLI: fetch only ----
def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m hrm_edge.arm64", description=(
        "Fetch (once per machine) what `python -m hrm_edge.parity DIR --target aarch64` needs, into "
        f"$XDG_CACHE_HOME/hrm-edge/{TARGET} (default ~/.cache/hrm-edge/{TARGET}): qemu-aarch64 from Debian trixie's "
        "qemu-user, Debian bookworm's arm64 Python 3.11, aarch64 wheels of the host's onnxruntime and numpy, and for "
        ".pte files torch, executorch, torchao and the NVIDIA libraries torch links (~4.6 GB in all). "
        "Already fetched pieces are not fetched again."))
    p.add_argument("--no-pte", action="store_true", help="skip the .pte part (torch, executorch, NVIDIA libraries; "
                                                         "~4.3 GB): enough for ONNX and ORT artifacts")
    a = p.parse_args(argv)
    t0 = time.time()
    tc = ensure_toolchain(need_pte=not a.no_pte)
    total = sum(_folder_bytes(d) for d in cache_dir().iterdir() if d.is_dir() and not d.name.startswith("."))
    print(f"[{TARGET}] ready in {time.time() - t0:.0f} s: {', '.join(f'{k} {v}' for k, v in tc.versions.items())}; "
          f"{_gb(total)} in {cache_dir()}; CPU models: {', '.join(qemu_cpu_models(tc))}")
    return 0
