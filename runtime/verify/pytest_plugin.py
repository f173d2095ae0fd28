"""pytest plugin (entry point `ffn_fusion_verify` in pyproject.toml): the fixture `verify_artifact`, so that a
project's own tests check the artifacts it ships, as `fuse_onnx.py --verify` does:

    def test_my_model(verify_artifact):
        verify_artifact("orig.onnx", "healed.onnx", max_kl=0.1)

A failed check fails the test with one line per failed check (no traceback into this package); keywords are
runtime.verify.VerifyOptions' fields (max_kl, max_error, tp_tolerance, checkpoint_tolerance, decode_tolerance,
window, eval_tokens, text, seq). The fixture returns the VerifyReport for further asserts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def verify_artifact() -> Callable[..., object]:
    # Imported here, not at plugin load: every pytest run in an environment with this package installed loads
    # the plugin, and runtime.verify brings ONNX Runtime and the project's passes.
    from passes.errors import UserError  # noqa: PLC0415 (not at plugin load: see above)
    from runtime.verify import VerifyOptions  # noqa: PLC0415 (not at plugin load: see above)
    from runtime.verify import verify_artifact as verify  # noqa: PLC0415 (not at plugin load: see above)

    fields = {f.name for f in dataclasses.fields(VerifyOptions)}

    def check(original: str | Path, artifact: str | Path, **options: object):
        unknown = sorted(set(options) - fields)
        if unknown:
            pytest.fail(
                f"verify_artifact: unknown option(s) {unknown}; choose from {sorted(fields)}", pytrace=False
            )
        if "text" in options:
            options["text"] = tuple(Path(p) for p in options["text"] or ())
        try:
            report = verify(original, artifact, VerifyOptions(**options))
        except UserError as exc:
            pytest.fail(f"cannot verify {artifact} against {original}: {exc}", pytrace=False)
        if not report.ok:
            lines = [f"{artifact} ({report.kind}) does not verify against {original}:"]
            lines += [f"  {c.line()}" for c in report.failures]
            pytest.fail("\n".join(lines), pytrace=False)
        return report

    return check
