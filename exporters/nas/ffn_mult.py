"""The `ffn_mult` that gives back an FFN width through the engines' own rule (docs/design.md §7).

vLLM (nemotron_nas), TensorRT-LLM and transformers' DeciLM code all size a SwiGLU FFN as
`ceil256(int(2 * ffn_mult * hidden / 3))`. A fused group's width W is the sum of its members' widths, so
its layer needs the `ffn_mult` m with rule(m) == W. The exact solution is m = 3W / (2 hidden), for which
2 m hidden / 3 is W up to one rounding of the float product: int() of W + e is W and int() of W - e is
W - 1, which ceil256 brings back to W whenever W is a multiple of 256. Of the decimal roundings of that
value, the shortest one that is W to within half a unit before rounding (2 m hidden / 3 in [W - 0.5,
W + 0.5]) and that the rule maps to W is written: 36.5625 for Ultra-253B's 399360 at hidden 16384 (36.56
would also give 399360 through ceil256, but 2 m hidden / 3 would be 399333: a reader computing the width
without the rounding would be off), 4.0 for SmolLM2's 1536 at hidden 576.
"""

from __future__ import annotations

from exporters.spec import PAPER_FFN_GRANULARITY as GRANULARITY
from exporters.spec import ffn_width
from passes.errors import UserError


def ffn_mult_for(width: int, hidden: int) -> float:
    """The shortest decimal ffn_mult, within half a unit of exact, whose `ffn_width` is exactly `width`;
    UserError when the rule cannot give that width (it gives multiples of 256 only)."""
    if width <= 0 or width % GRANULARITY:
        raise UserError(
            f"an FFN of width {width} has no ffn_mult: Nemotron-NAS block_configs give widths "
            f"ceil256(int(2 * ffn_mult * hidden / 3)), multiples of {GRANULARITY} only (docs/design.md §7)"
        )
    exact = 3 * width / (2 * hidden)
    for digits in range(0, 18):
        candidate = round(exact, digits)
        close = abs(2 * candidate * hidden / 3 - width) <= 0.5
        if candidate > 0 and close and ffn_width(candidate, hidden) == width:
            return float(candidate)
    raise RuntimeError(f"internal error: no ffn_mult for width {width} at hidden {hidden}")
