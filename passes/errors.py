"""User-facing errors: one line, no traceback, exit status 2 (3 for an internal error, a bug)."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# A bug, not bad input: a distinct exit status, and the traceback only when this variable is set.
INTERNAL_ERROR_STATUS = 3
TRACEBACK_VARIABLE = "FFN_FUSION_TRACEBACK"


class UserError(Exception):
    """Bad input that the user can fix; the message says what is wrong and how to fix it."""


# A full disk or quota is the environment, not a bug: exit 2 with what to do, no traceback.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

_pass_input_error: type[UserError] | None = None


def __getattr__(name: str) -> Any:
    """PassInputError, made on first use: its base comes from onnx_ir (~1.5 s to import), which a tool's
    --help and early errors should not pay."""
    global _pass_input_error
    if name != "PassInputError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _pass_input_error is None:
        import onnx_ir as ir  # noqa: PLC0415 (onnx_ir: ~1 s; a tool's --help and early errors must not pay it, see the docstring)

        class PassInputError(UserError, ir.passes.PreconditionError):
            """A pass's `requires` refusing its input model: a UserError (exit 2), and a PreconditionError,
            which onnx-ir's PassBase lets through unwrapped (it wraps any other exception from `requires`)."""

        PassInputError.__module__, PassInputError.__qualname__ = __name__, "PassInputError"
        _pass_input_error = PassInputError
    return _pass_input_error


def user_error_in(exc: BaseException) -> UserError | None:
    """The UserError behind `exc`: a PassManager wraps a pass's errors in PassError (from ...)."""
    return next((e for e in _chain(exc, interrupted=False) if isinstance(e, UserError)), None)


def no_space_error_in(exc: BaseException) -> OSError | None:
    """The OSError(ENOSPC or EDQUOT) behind `exc`, through its causes and the exceptions it interrupted."""
    chain = _chain(exc, interrupted=True)
    return next((e for e in chain if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS), None)


def _chain(exc: BaseException | None, interrupted: bool, depth: int = 8) -> Iterator[BaseException]:
    """`exc`, then what it was raised from (and, with `interrupted`, what it interrupted), `depth` deep."""
    for _ in range(depth):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or (exc.__context__ if interrupted else None)


def describe_no_space(exc: OSError) -> str:
    """`no space left on device writing PATH: ...`; the path only when the OSError knows it."""
    what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    where = f" writing {exc.filename}" if exc.filename else ""
    return f"{what}{where}: free space or choose another output folder"


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
        if (full := no_space_error_in(exc)) is not None:
            print(f"error: {describe_no_space(full)}", file=sys.stderr)
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
