"""The one compiled piece: passes/io/_half_scale.c (float16 "fold" in one pass). Optional: where it does not
build (no C compiler), the fusion scales float16 through ONNX Runtime instead, more slowly."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("passes.io._half_scale", ["passes/io/_half_scale.c"], optional=True)])
