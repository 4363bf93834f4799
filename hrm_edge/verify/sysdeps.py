"""Installs the Debian packages the test suite needs, and only the missing ones.

    python -m hrm_edge.sysdeps            # install what is missing (root, apt-get, network); quick no-op otherwise
    python -m hrm_edge.sysdeps --check    # list what is missing, install nothing (exit 1 if anything is)

The suite drives Debian's Chromium (the demo page, through playwright), compiles and runs the Android app's
plain-Java core with a JDK and junit4, and installs the page's pinned JS packages with npm. Each need is
checked by the file or command the tests use, not by package name, so a machine whose node or JDK came from
elsewhere keeps it. The ARM64 toolchain is fetched by `python -m hrm_edge.arm64`, without installing anything.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hrm_edge.errors import ArgumentParser, UserError, run_cli


@dataclass(frozen=True)
class Need:
    packages: tuple[str, ...]  # Debian packages that provide it
    path: str = ""  # a file the tests read ...
    command: str = ""  # ... or a command they run
    why: str = ""

    @property
    def label(self) -> str:
        return self.path or self.command


NEEDS = (
    Need(("chromium",), path="/usr/bin/chromium", why="tests/test_demo.py drives the page through playwright"),
    # junit4 depends on libhamcrest-java, which brings hamcrest-core.jar
    Need(("junit4",), path="/usr/share/java/junit4.jar", why="tests/test_android_core.py runs the Java core's tests"),
    Need(("libhamcrest-java",), path="/usr/share/java/hamcrest-core.jar", why="junit4's matchers"),
    Need(("default-jdk-headless",), command="javac", why="tests/test_android_core.py compiles the Java core"),
    Need(("nodejs", "npm"), command="npm", why="the demo installs the page's pinned JS packages with npm ci"),
)


def is_present(need: Need) -> bool:
    if need.path:
        return Path(need.path).exists()
    return shutil.which(need.command) is not None


def packages_to_install(present: set[str], needs: tuple[Need, ...] = NEEDS) -> list[str]:
    """Debian packages for the needs whose label (path or command) is not in `present`, in order, once each."""
    out: list[str] = []
    for need in needs:
        if need.label not in present:
            out += [p for p in need.packages if p not in out]
    return out


def apt_command(packages: list[str], *, is_root: bool, apt_get: str | None) -> list[list[str]]:
    """The commands that install `packages`; one clear UserError when this machine cannot run them."""
    if not packages:
        return []
    listed = " ".join(packages)
    if apt_get is None:
        raise UserError(f"apt-get not found: this step installs Debian packages; install {listed} by hand")
    if not is_root:
        raise UserError(f"installing Debian packages needs root: run `sudo apt-get install {listed}`, "
                        "then this command again")
    return [[apt_get, "update", "-q"],
            [apt_get, "install", "-y", "-q", "--no-install-recommends", *packages]]


def install(commands: list[list[str]]) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in commands:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"`{' '.join(cmd[1:3])}` failed (exit {proc.returncode}; no network?): {tail}")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hrm_edge.sysdeps", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only list what is missing (exit 1 if anything is)")
    args = ap.parse_args(argv)
    present = {n.label for n in NEEDS if is_present(n)}
    packages = packages_to_install(present)
    if not packages:
        print("sysdeps: every Debian package the tests need is present")
        return 0
    missing = [f"{n.label} ({n.why})" for n in NEEDS if n.label not in present]
    if args.check:
        print("sysdeps: missing " + "; ".join(missing) + f"\n  install: apt-get install {' '.join(packages)}")
        return 1
    commands = apt_command(packages, is_root=os.geteuid() == 0, apt_get=shutil.which("apt-get"))
    print(f"sysdeps: installing {' '.join(packages)} (missing: {', '.join(n.split(' ')[0] for n in missing)})",
          flush=True)
    install(commands)
    still = [n.label for n in NEEDS if not is_present(n)]
    if still:
        raise UserError(f"installed {' '.join(packages)}, yet still missing: {', '.join(still)}")
    print("sysdeps: done")
    return 0
