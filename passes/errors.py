"""User-facing errors: one line, no traceback, exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input that the user can fix; the message says what is wrong and how to fix it."""


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
    sys.exit(code or 0)
