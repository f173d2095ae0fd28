"""Every picture the project saves is drawn with matplotlib's file backend, set up here once."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only, no display), chosen before pyplot loads."""
    import matplotlib  # noqa: PLC0415 (about a second to import: only a picture needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (after matplotlib.use: the backend comes first)

    return plt
