import subprocess
import sys

from passes.block_table import attention_free_runs, format_runs


def test_runs_are_maximal_and_inclusive() -> None:
    flags = [True, False, False, True, False, True, True, False]
    assert attention_free_runs(flags) == [(1, 2), (4, 4), (7, 7)]
    assert attention_free_runs([True, True]) == []
    assert format_runs(attention_free_runs(flags)) == "1-2, 4, 7"
    assert format_runs([]) == "none"


def test_runs_load_without_onnx_ir() -> None:
    """An exporter prints runs before onnx_ir loads (export_model.py --hf starts copying at once)."""
    modules = "passes.block_table, exporters.spec, exporters.export_record"
    code = f"import sys, {modules}; print('onnx_ir' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
