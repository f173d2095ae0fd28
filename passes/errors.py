"""User-facing errors: one line, no traceback, exit status 2 (3 for an internal error, a bug)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import onnx_ir as ir

# A bug, not bad input: a distinct exit status, and the traceback only when this variable is set.
INTERNAL_ERROR_STATUS = 3
TRACEBACK_VARIABLE = "FFN_FUSION_TRACEBACK"


class UserError(Exception):
    """Bad input that the user can fix; the message says what is wrong and how to fix it."""


class PassInputError(UserError, ir.passes.PreconditionError):
    """A pass's `requires` refusing its input model: a UserError (exit 2), and a PreconditionError, which
    onnx-ir's PassBase lets through unwrapped (it wraps any other exception from `requires`)."""


def user_error_in(exc: BaseException) -> UserError | None:
    """The UserError behind `exc`: a PassManager wraps a pass's errors in PassError (from ...)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, UserError):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


def run_cli(main: Callable[[], int | None]) -> None:
    """Run a tool's main(); turn a UserError into `error: ...` on stderr and exit status 2."""
    try:
        code = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # a failed pass post-condition or any other bug: one line, no traceback
        if (user := user_error_in(exc)) is not None:  # bad input, refused by a pass inside a PassManager
            print(f"error: {user}", file=sys.stderr)
            sys.exit(2)
        if os.environ.get(TRACEBACK_VARIABLE):
            raise
        print(
            f"error: internal error: {describe_internal_error(exc)} (a bug, not your input; "
            f"rerun with {TRACEBACK_VARIABLE}=1 for the traceback and report it)",
            file=sys.stderr,
        )
        sys.exit(INTERNAL_ERROR_STATUS)
    sys.exit(code or 0)


def describe_internal_error(exc: BaseException) -> str:
    """One line: the exception and its causes (onnx-ir wraps a failed post-condition around its cause)."""
    parts = []
    while exc is not None and len(parts) < 4:
        text = (str(exc).strip().splitlines() or [""])[0]
        parts.append(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        exc = exc.__cause__
    return " <- ".join(parts)
