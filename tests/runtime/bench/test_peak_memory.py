"""runtime.bench.peak_memory: the child's own peak RSS and exit code, for scripts and module functions."""

from __future__ import annotations

from runtime.bench.peak_memory import measure, timed_copy


def test_peak_counts_the_child_only(tmp_path):
    script = tmp_path / "grow.py"
    script.write_text(
        "import sys\nblock = bytearray(int(sys.argv[1]) << 20)\nblock[::4096] = b'x' * len(block[::4096])\n"
    )
    small, big = measure(script, [1]), measure(script, [300])
    assert small.code == big.code == 0
    assert big.peak_mib - small.peak_mib > 250  # the 300 MiB buffer, touched page by page
    assert small.peak_mib < 100  # not the parent's (pytest's) resident size


def test_exit_codes_and_errors_are_reported(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    assert measure(script).code == 3
    failed = measure("json:no_such_function")
    assert failed.code == 1 and "AttributeError" in failed.last_line


def test_timed_copy(tmp_path):
    source = tmp_path / "a.bin"
    source.write_bytes(b"z" * 1000)
    assert timed_copy([source], tmp_path / "copy").code == 0
    assert (tmp_path / "copy" / "a.bin").read_bytes() == source.read_bytes()


def test_cpu_seconds_are_the_childs_work_not_its_wall_time(tmp_path):
    script = tmp_path / "work.py"
    script.write_text(
        "import sys, time\nif sys.argv[1] == 'spin':\n    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end:\n        pass\nelse:\n    time.sleep(0.3)\n"
    )
    spin, sleep = measure(script, ["spin"]), measure(script, ["sleep"])
    assert spin.cpu_seconds >= 0.3 and spin.seconds >= 0.3
    assert sleep.cpu_seconds < 0.1 and sleep.seconds >= 0.3
