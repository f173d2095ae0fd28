"""The pytest plugin (entry point ffn_fusion_verify): a project's test using the `verify_artifact` fixture
passes on a good artifact and fails, with the failed check's line, on a tampered one."""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest

from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY
from runtime.heal.metadata import TENSOR_HASHES_KEY
from tests.runtime.verify.artifacts import tampered

pytest_plugins = ["pytester"]


def test_entry_point_registered():
    [entry] = [e for e in entry_points(group="pytest11") if e.name == "ffn_fusion_verify"]
    assert entry.value == "runtime.verify.pytest_plugin"


@pytest.mark.slow  # a pytest subprocess
def test_fixture_passes_and_fails_in_a_users_tests(pytester, healed, tmp_path):
    record = json.loads(load_model(healed["healed"]).metadata_props[HEAL_METADATA_KEY])
    name = sorted(record[TENSOR_HASHES_KEY])[0]
    bad = tampered(healed["healed"], tmp_path / "bad.onnx", name, lambda a: (a * 1.01).astype(a.dtype))
    pytester.makepyfile(
        test_models=f"""
        def test_good(verify_artifact):
            report = verify_artifact({str(healed["original"])!r}, {str(healed["healed"])!r}, max_kl=0.5,
                                     eval_tokens=512)
            assert report.kind == "healed"

        def test_bad(verify_artifact):
            verify_artifact({str(healed["original"])!r}, {str(bad)!r}, max_kl=0.5, eval_tokens=512)

        def test_typo(verify_artifact):
            verify_artifact({str(healed["original"])!r}, {str(healed["healed"])!r}, max_kl_=0.5)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert f"FAIL  healed weights: 1 of {len(record[TENSOR_HASHES_KEY])} differ" in out and repr(name) in out
    assert "unknown option(s) ['max_kl_']" in out
    assert "runtime/verify/" not in out  # readable: no traceback into the plugin
