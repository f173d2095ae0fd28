"""The two compiled pieces, both optional: where they do not build (no C compiler), the slower paths run.

- passes/io/_half_scale.c: float16 "fold" in one pass (else through ONNX Runtime);
- exporters/nas/_q8_0.c: the GGUF writer's Q8_0 blocks in one pass (else numpy, the same bytes).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("passes.io._half_scale", ["passes/io/_half_scale.c"], optional=True),
    # x * id rounded before the addition that rounds it to an integer: never one fused multiply-add
    Extension("exporters.nas._q8_0", ["exporters/nas/_q8_0.c"], optional=True,
              extra_compile_args=["-ffp-contract=off"]),
])
