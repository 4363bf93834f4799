"""User mistakes become one line on stderr and exit code 2; everything else is a bug and keeps its traceback."""
from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Callable


class UserError(Exception):
    """Bad input from the user (a path, a flag, a corpus): reported as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose refusals (an unknown flag, a bad choice, a missing argument) are one line like the
    commands' own, not its usage block: `error: MESSAGE (see PROG --help)`, exit code 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (a library's multi-line dump becomes one line of an error)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a shell tool does on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush cannot fail again
        code = 141
    except OSError as e:  # a full disk (the output, or stdout redirected to a file): one line, not a traceback
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # stdout may be the full file
        print(f"error: {e.strerror}" + (f" ({e.filename})" if e.filename else " (writing the output)"),
              file=sys.stderr)
        code = 1
    sys.exit(code)
