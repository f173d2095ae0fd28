"""LiveSessions: counts the ONNX Runtime sessions a module opens and how many are alive at once (its
`session` function wrapped), for the tests that a streamed run holds one block at a time."""

from __future__ import annotations

import weakref
from types import ModuleType


class LiveSessions:
    def __init__(self, monkeypatch, module: ModuleType) -> None:
        self.live = self.peak = self.opened = 0
        original = module.session

        def counted(*args, **kwargs):
            sess = original(*args, **kwargs)
            self.live += 1
            self.opened += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(sess, self._closed)
            return sess

        monkeypatch.setattr(module, "session", counted)

    def _closed(self) -> None:
        self.live -= 1
