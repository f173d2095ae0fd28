"""runtime/tp/gloo.die_with_parent: spawned rank processes end when the process that spawned them is killed
(they used to wait in gloo as orphans, spinning)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.tp.gloo import die_with_parent

ROOT = Path(__file__).resolve().parents[3]
PARENT = """
import multiprocessing as mp, sys
from tests.runtime.tp.test_die_with_parent import rank
ranks = [mp.get_context("spawn").Process(target=rank, args=(sys.argv[1],)) for _ in range(2)]
for p in ranks:
    p.start()
for p in ranks:
    p.join()
"""


def rank(folder: str) -> None:
    die_with_parent()
    (Path(folder) / str(os.getpid())).touch()
    time.sleep(120)  # as a rank waiting in a collective


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_end_with_a_killed_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "rank processes outlived their parent"
