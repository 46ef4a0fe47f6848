"""CPU kernels of our own, called from inside the compiled step through `jax.ffi`: XLA:CPU's dot
reads float only (a quantized weight is first written out as a float32 copy) and runs the
few-row matmuls of decode far below its GEMM rate.

The four pieces of every kernel (as in kernels_pallas/): the C++ kernel (`qmatmul.cc`, its tiles
in `qmatmul_tiles.inc`), a checked wrapper (`qmatmul.py`), a jnp reference (`reference.py`) and
the sweep test (`tests/test_kernels_cpu.py`); its int8 activation mode (`qmatmul_int8.cc`, its
tiles in `qmatmul_int8.inc`; `reference.qmatmul_int8_reference`;
`tests/test_cpu_activations.py`). Ragged paged attention (`ragged.cc`, its loops in
`ragged_attend.inc`; `ragged.py`) has the Pallas kernels' reference
(`kernels_pallas/ragged_reference.py`) and `tests/test_kernels_cpu_ragged.py`. `common.h`: the
run-time choice of instruction set and the thread pool's ParallelFor, which both use.
`library.py` finds the library that `pip install` built (setup.py) and registers its targets
with XLA once; without it (no compiler at install) `available()` is False, one log line says
so, and the engine keeps XLA's path.
"""

from kernels_cpu.library import ISAS, available, measured_faster, supported_isas
from kernels_cpu.qmatmul import qmatmul
from kernels_cpu.qmatmul import takes_int8 as qmatmul_takes_int8
from kernels_cpu.ragged import ragged_paged_attention

__all__ = ["ISAS", "available", "measured_faster", "qmatmul", "qmatmul_takes_int8",
           "ragged_paged_attention", "supported_isas"]
