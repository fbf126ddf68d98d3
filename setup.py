"""Build hook for the optional C modules (D-PERF-26, D-PERF-35, D-PERF-39); everything else is in pyproject.toml.

The modules ``pagedkv.optimized._native``, ``._tokens`` and ``._decode`` are built only when a C
compiler and Python's headers work here: the probe below compiles a one-line file that includes
``Python.h``. Without them (or with ``PAGEDKV_NO_NATIVE=1``) the package installs without them and
runs its pure-Python code, the same behaviour, slower. (setuptools' own ``optional=True`` is not enough: an
editable install still tries to copy a module it failed to build, and fails.)
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
import tempfile

from setuptools import Extension, setup


def c_compiler_works() -> bool:
    if os.environ.get("PAGEDKV_NO_NATIVE", "") not in ("", "0"):
        return False
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "probe.c")
        with open(source, "w", encoding="utf-8") as handle:
            handle.write("#include <Python.h>\nint pagedkv_probe(void) { return 0; }\n")
        command = [*compiler, "-I", sysconfig.get_paths()["include"], "-c", source,
                   "-o", os.path.join(folder, "probe.o")]
        try:
            return subprocess.run(command, capture_output=True, check=False).returncode == 0
        except OSError:
            return False


# The pool's per-block loops (D-PERF-26), token checking / prompt hashing (D-PERF-35) and the
# decode step's no-op test (D-PERF-39).
SOURCES = {"_native": ["optimized/_native.c", "optimized/_native_map.c", "optimized/_native_admit.c",
                       "optimized/_native_calls.c"],
           "_tokens": ["optimized/_tokens.c"],
           "_decode": ["optimized/_decode.c"]}
NATIVE = [Extension(f"pagedkv.optimized.{name}", sources,
                    depends=["optimized/_native.h"],
                    optional=True, extra_compile_args=["-O2"])
          for name, sources in SOURCES.items()]

setup(ext_modules=NATIVE if c_compiler_works() else [])
