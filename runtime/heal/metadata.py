"""The records of a heal: its configuration, each group's errors and the whole result, which the healed
model carries as metadata under HEAL_METADATA_KEY."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from passes.errors import UserError
from passes.plan import Plan

# sha256 of each initializer heal.py wrote, over its stored bytes (onnx_ir's tensor.tobytes(), the dtype and
# layout of the file): runtime/verify checks a healed file against them. Files healed before this key have
# none and are refused by the verifier.
TENSOR_HASHES_KEY = "tensor_sha256"
INPUT_MODES = ("healed", "original")
LOSSES = ("mse", "token")


@dataclass(frozen=True)
class HealConfig:
    steps: int = 0  # Adam steps on all weights before the refit; measured: no gain over the refit alone
    lr: float = 3e-4
    batch_tokens: int = 1024  # tokens per Adam step (sampled from the calibration tokens)
    inputs: str = "healed"
    loss: str = "mse"  # "mse": squared error over all tokens; "token": each token's error over its target
    seed: int = 0
    ridge: float = 0.1  # closed-form refit of the down projection after Adam (0: none), see fit.refit_down

    def check(self) -> None:
        if self.steps < 0 or self.batch_tokens < 1 or not self.lr > 0:
            raise UserError("--steps must be >= 0, --batch-tokens >= 1 and --lr > 0")
        if self.inputs not in INPUT_MODES or self.loss not in LOSSES:
            raise UserError(f"--inputs must be one of {INPUT_MODES}, --loss one of {LOSSES}")


DEFAULT_CONFIG = HealConfig()  # frozen: one default shared by heal() and run_heal()


@dataclass
class GroupHeal:
    group: tuple[int, int]
    width: int
    calib_before: float
    calib_after: float
    heldout_before: float
    heldout_after: float
    seconds: float
    norm_weight: str  # "norm weight" (fitted) or "fixed" (fold: its scale lies in the gate/up rows)
    start_sha256: str = ""  # the fused weights it started from (runtime.heal.ffn.fingerprint)
    kind: str = "ffn"  # "ffn": a fused FFN group; "parallel": a full-block parallel group (its members' FFNs)

    def line(self) -> str:
        i, j = self.group
        kind = f"parallel group [{i}, {j}] ({j - i + 1} FFNs, " if self.kind == "parallel" else None
        what = kind or f"group [{i}, {j}] ("
        return (
            f"{what}width {self.width}): relative squared error calibration "
            f"{self.calib_before:.4f} -> {self.calib_after:.4f}, held-out {self.heldout_before:.4f} -> "
            f"{self.heldout_after:.4f} ({self.seconds:.1f} s)"
        )


@dataclass
class HealResult:
    output: Path | None
    plan: Plan
    config: HealConfig
    groups: list[GroupHeal] = field(default_factory=list)
    calib_tokens: int = 0
    heldout_tokens: int = 0
    calib_source: str = ""
    nodes: int = 0
    seconds: float = 0.0
    weights_from: Path | None = None  # the healed model the weights were taken from (heal.py --weights-from)
    tensors: dict[str, str] = field(default_factory=dict)  # initializer name -> sha256 (TENSOR_HASHES_KEY)

    def metadata(self) -> dict:
        source = {} if self.weights_from is None else {"weights_from": str(self.weights_from)}
        return {
            **source,
            "config": asdict(self.config),
            "calibration": self.calib_source,
            "calib_tokens": self.calib_tokens,
            "heldout_tokens": self.heldout_tokens,
            "groups": [
                {k: (list(v) if k == "group" else v) for k, v in asdict(g).items() if k != "seconds"}
                for g in self.groups
            ],
            **({TENSOR_HASHES_KEY: dict(sorted(self.tensors.items()))} if self.tensors else {}),
        }
