"""Builds kernels_cpu's C++ library at install (pyproject.toml holds everything else).

The library is a plain shared object that kernels_cpu/library.py loads with ctypes and
registers with XLA (`jax.ffi`), so it is built against the FFI headers jaxlib ships. Each
instruction set is chosen at run time inside the library, so the build targets no particular
CPU. Without a C++ compiler the extension is skipped (`optional`) and the install still works:
the engine then runs XLA's path and says so once.
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildFFI(build_ext):
  """build_ext with jaxlib's FFI headers on the include path, and no Python module init."""

  def build_extensions(self):
    jaxlib = importlib.util.find_spec("jaxlib").submodule_search_locations[0]
    for ext in self.extensions:
      ext.include_dirs.append(os.path.join(jaxlib, "include"))
    super().build_extensions()

  def get_export_symbols(self, ext):
    return []  # A ctypes library, not a Python module: there is no PyInit_ to export.


setup(
    ext_modules=[Extension(
        "kernels_cpu._kernels", ["kernels_cpu/qmatmul.cc", "kernels_cpu/qmatmul_int8.cc",
                                 "kernels_cpu/ragged.cc"],
        language="c++", optional=True,
        depends=["kernels_cpu/common.h", "kernels_cpu/qmatmul.h", "kernels_cpu/qmatmul_tiles.inc",
                 "kernels_cpu/qmatmul_int8.inc",
                 "kernels_cpu/ragged_attend.inc"],
        # -fno-trapping-math: no program of ours traps on a float exception, and without it GCC
        # keeps a clamp's branch in ragged.cc's exp, which then does not vectorize.
        extra_compile_args=["-O3", "-std=c++17", "-fno-trapping-math", "-w"])],
    cmdclass={"build_ext": BuildFFI},
)
