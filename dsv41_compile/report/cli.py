"""What the tools under `tools/` share: their argument parser and how they end on an error.

    parser = tool_parser(__doc__)        # --help prints the tool's whole docstring
    ...
    if __name__ == "__main__":
        run(main)                        # an error: its message, exit 1; --traceback: all of it

An error met through a tool -- the backend's, raised inside Dynamo's compile -- is printed as
the project's message, which says what to change, not as Dynamo's traceback around it; every
tool takes `--traceback` to see the whole traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from dsv41_compile.core.errors import InternalError

__all__ = ["describe", "run", "tool_parser"]


def tool_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose `--help` prints `doc` (the tool's docstring) whole, as written,
    with the `--traceback` flag every tool takes."""
    parser = argparse.ArgumentParser(
        description=(doc or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="on an error, raise it with its whole traceback (Dynamo's frames included) "
        "instead of printing its message",
    )
    return parser


def describe(error: BaseException) -> str:
    """The message of the error a user acts on: the innermost of the exceptions Dynamo wraps
    a backend's in (`BackendCompilerFailed` and the like), its type named where it is not a
    user's mistake (`ValueError`, `NotImplementedError`) or our bug (`InternalError`, whose
    message says so)."""
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception  # type: ignore[attr-defined]
    if isinstance(error, (ValueError, NotImplementedError, InternalError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def run(main: Callable[[], int | None]) -> None:
    """Call a tool's `main` and exit with its code; on an error, print `describe(error)` to
    stderr and exit 1 -- or, with `--traceback` among the arguments, raise it."""
    try:
        code = main()
    except Exception as error:
        if "--traceback" in sys.argv[1:]:
            raise
        tool = os.path.basename(sys.argv[0])
        if "RANK" in os.environ:  # under torchrun: every rank says it
            tool += f" (rank {os.environ['RANK']})"
        print(
            f"{tool}: error: {describe(error)}\n(run with --traceback for the whole traceback)",
            file=sys.stderr,
        )
        sys.exit(1)
    sys.exit(code or 0)
