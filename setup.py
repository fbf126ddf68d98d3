"""Build hook for the one optional C module (D-PERF-26); everything else is in pyproject.toml.

``optional=True``: without a C compiler the build skips ``pagedkv.optimized._native`` with a
warning and the package runs its pure-Python loops (the same behaviour, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pagedkv.optimized._native", ["optimized/_native.c"], optional=True,
                             extra_compile_args=["-O2"])])
