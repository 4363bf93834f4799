"""Atomic file writes: an interrupted run never leaves a truncated file under its final name. A whole folder is
written the same way: into a staging folder beside its files, under a lock, and published at the end (an
export that fails part-way leaves the folder's earlier contents as they were)."""
from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from hrm_edge.errors import UserError

# a write that failed for want of room: disk full, over a file-size limit (RLIMIT_FSIZE), over quota, read-only
WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)


@contextlib.contextmanager
def atomic_path(path: Path):
    """Yield a temporary path beside `path`; on success it is fsynced and renamed onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode a plain open() would
        os.replace(tmp, path)
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        # name the file being written (the error names the temp file, or nothing when numpy or onnx wrote it)
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _not_empty(text: str, what: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty {what} (an unset shell variable?)")
    return text


def path_arg(text: str) -> Path:
    """argparse type of every path flag: an empty path (an unset shell variable: `--out "$OUT"`) is refused instead
    of meaning the working folder."""
    return Path(_not_empty(text, "path"))


def text_arg(text: str) -> str:
    """argparse type of a flag that names something (a corpus, int8 modes, CPU models): an empty value (an unset
    shell variable) is refused instead of meaning the default, or nothing."""
    return _not_empty(text, "value")


def some_names(names: list[str], shown: int = 3) -> str:
    """The first few of `names` for a one-line error ("a, b, c, …")."""
    return ", ".join(names[:shown]) + (", …" if len(names) > shown else "")


def refuse_unused(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: tuple[str, ...], mode: str) -> None:
    """Flags that only shape `mode` (a flag of its own): a user error when one is set to other than its default while
    `mode` is off, instead of being ignored without a word (`--draft-len 8` without `--speculative`)."""
    if getattr(args, mode.lstrip("-").replace("-", "_")):
        return
    refuse_flags(flags_given(parser, args, flags), (f"only applies with {mode}", f"only apply with {mode}"),
                 f"add {mode}, or ")


def flags_given(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """Those of `flags` set to other than their default, in the order given."""
    dests = {f: f.lstrip("-").replace("-", "_") for f in flags}
    return [f for f, d in dests.items() if getattr(args, d) != parser.get_default(d)]


def refuse_out_of_range(*checks: tuple[str, object, bool, str]) -> None:
    """The first check (flag, value, in range, its range) that fails: a one-line user error naming that flag and the
    value given ("--seq-len must be >= 2, not 1"), not a list of every flag's range."""
    for flag, value, ok, allowed in checks:
        if not ok:
            raise UserError(f"{flag} must be {allowed}, not {value:g}" if isinstance(value, float)
                            else f"{flag} must be {allowed}, not {value}")


def refuse_flags(given: list[str], why: tuple[str, str], fix: str = "") -> None:
    """Flags `given` that this run would ignore: a user error instead, `--a, --b WHY: FIX leave them out`, with why's
    singular or plural form (("applies ...", "apply ...")) and "it" for one flag."""
    if given:
        one = len(given) == 1
        raise UserError(f"{', '.join(given)} {why[0] if one else why[1]}: {fix}leave {'it' if one else 'them'} out")


def check_writable_dir(path: Path) -> Path:
    """Create `path` if needed and prove we can write there, before any long work starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"output folder {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"output folder {path} is not writable: {e.strerror or e}") from None
    return path


def check_writable_file(path: Path) -> Path:
    """`path` can be written as a file: not a folder, its folder made if needed and writable; checked before the
    work whose result goes there."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a file to write")
    check_writable_dir(path.parent)
    return path


# ---- a folder written as a whole ----
def write_failure(e: BaseException) -> OSError | None:
    """The failed write (disk full, file-size limit, quota, read-only) behind `e`, or None: an OSError with one of
    WRITE_ERRNOS in e's chain of causes (a worker process's error arrives with its type), or such an error's text
    in a message (a tool run as a subprocess reports it in its stderr)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return e
        for code in WRITE_ERRNOS:
            if os.strerror(code) in str(e):
                return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def one_line_write_errors(where: Path):
    """A failed write inside the with-block becomes a user error naming the file (one line, exit code 2)."""
    try:
        yield
    except Exception as e:
        failure = write_failure(e)
        if failure is None:
            raise
        what = f"{Path(failure.filename).name} into {where}" if failure.filename else f"into {where}"
        raise UserError(f"cannot write {what}: {failure.strerror} (out of disk space, or over a file-size limit or "
                        "quota); nothing was published, the folder holds what it held before") from None


@contextlib.contextmanager
def folder_lock(folder: Path, name: str, log=print):
    """Hold an exclusive lock on folder/name (created if missing), which records the holder's pid while it is
    held. flock: the kernel releases it when the holder dies, so the file of a killed run is recognised as a
    stale lock and taken over. Another live holder is a user error naming its pid."""
    import fcntl

    f = open(Path(folder) / name, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown pid"
            raise UserError(f"{folder} is being written by another run ({holder}); wait for it to finish, or choose "
                            "another folder") from None
        except OSError as e:  # a file system without locks (some network mounts): go on, and say so
            log(f"[lock] {folder}: cannot lock {name} ({e.strerror or e}); not guarded against a second run")
        f.seek(0)
        stale = f.read().strip()
        if stale:
            log(f"[lock] {folder}: the run of {stale} did not finish (killed?); taking over its stale lock")
        _rewrite(f, f"pid {os.getpid()}\n")
        try:
            yield
        finally:
            _rewrite(f, "")  # an empty file: a finished run, not a stale lock
    finally:
        f.close()  # releases the flock


def _rewrite(f, text: str) -> None:
    f.seek(0)
    f.truncate()
    f.write(text)
    f.flush()


@contextlib.contextmanager
def removed_if_failed(folder: Path, leftovers: tuple[str, ...] = (), setup: tuple[str, ...] = ()):
    """For a folder the with-block may create: if the block fails and the folder was not there before and holds
    nothing but empty `leftovers` (a released lock marker) and the run's `setup` files (what it wrote before any
    work: a study's study_config.json), it is removed. A run refused on an input it could only judge by reading it (a
    corpus with no text) leaves nothing behind; a folder that was there, holds work, or whose lock another run holds
    (its pid inside) is kept."""
    folder = Path(folder)
    existed = folder.exists()
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir() and all(
                p.is_file() and (p.name in setup or p.name in leftovers and p.stat().st_size == 0)
                for p in folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
        raise


@contextlib.contextmanager
def staging_folder(folder: Path, name: str):
    """A new empty folder/name for the with-block to write into (a leftover of a killed run is removed first);
    removed with its contents if the block fails. Call it under folder_lock: it is the only writer's."""
    staging = Path(folder) / name
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, folder: Path, last: tuple[str, ...]) -> None:
    """Move every file of `staging` into `folder` (renames on one file system), replacing files of the same name.
    The names in `last` (the manifest, which lists the others) are removed from `folder` first and moved in last,
    in that order: a reader meanwhile sees no manifest, never one listing files being replaced."""
    for name in last:
        (Path(folder) / name).unlink(missing_ok=True)
    files = sorted(p for p in Path(staging).iterdir() if p.name not in last)
    for path in files + [Path(staging) / n for n in last if (Path(staging) / n).exists()]:
        os.replace(path, Path(folder) / path.name)
