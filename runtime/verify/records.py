"""What a verification returns: typed check records, the report they make, and its JSON and JUnit XML forms
(the reports CI systems read)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Check:
    """One check of an artifact against its source: `numbers` holds what it measured (errors, bounds)."""

    name: str
    ok: bool
    message: str
    numbers: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        return f"{'ok' if self.ok else 'FAIL'}  {self.name}: {self.message}"


@dataclass
class VerifyReport:
    kind: str  # "fused", "healed", "fp8", "tp", "checkpoint", "decode"
    original: Path
    artifact: Path
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: dict | None = None  # the plan a fused or healed artifact records

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def add(self, name: str, ok: bool, message: str, **numbers: float) -> Check:
        check = Check(name, bool(ok), message, {k: float(v) for k, v in numbers.items()})
        self.checks.append(check)
        return check

    def add_mismatches(
        self,
        name: str,
        bad: Sequence[str],
        total: int,
        differ: str,
        passed: str,
        *,
        sep: str = ", ",
        **numbers: float,
    ) -> Check:
        """One check over `total` compared items of which `bad` (each one naming where) differ: failed, it
        says "<n> of <total> <differ>: " and the first 5 of `bad` joined by `sep`; passed, `passed`. Its
        numbers: compared, differing and `numbers`."""
        if not bad:
            return self.add(name, True, passed, compared=total, **numbers)
        shown = sep.join(bad[:5]) + (" ..." if len(bad) > 5 else "")
        message = f"{len(bad)} of {total} {differ}: {shown}"
        return self.add(name, False, message, compared=total, differing=len(bad), **numbers)

    def lines(self) -> list[str]:
        head = f"{self.artifact}: {self.kind} artifact of {self.original}"
        return [head, *(f"note: {n}" for n in self.notes), *(c.line() for c in self.checks)]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "kind": self.kind,
            "original": str(self.original),
            "artifact": str(self.artifact),
            "notes": self.notes,
            **({"plan": self.plan} if self.plan is not None else {}),
            "checks": [asdict(c) for c in self.checks],
        }

    def junit(self) -> ET.ElementTree:
        """One <testsuite> of one <testcase> per check; a failed check is a <failure> with its message."""
        suite = ET.Element(
            "testsuite",
            name=f"ffn_fusion.verify.{self.kind}",
            tests=str(len(self.checks)),
            failures=str(len(self.failures)),
            errors="0",
            skipped="0",
        )
        for check in self.checks:
            case = ET.SubElement(
                suite, "testcase", classname=f"{self.kind}.{self.artifact.name}", name=check.name
            )
            if not check.ok:
                failure = ET.SubElement(case, "failure", message=check.message, type="VerificationFailure")
                failure.text = check.message
            if check.numbers:
                ET.SubElement(case, "system-out").text = " ".join(
                    f"{k}={v:.6g}" for k, v in check.numbers.items()
                )
        root = ET.Element("testsuites", tests=suite.get("tests"), failures=suite.get("failures"))
        root.append(suite)
        ET.indent(root)
        return ET.ElementTree(root)

    def write_junit(self, path: Path) -> None:
        self.junit().write(path, encoding="utf-8", xml_declaration=True)
