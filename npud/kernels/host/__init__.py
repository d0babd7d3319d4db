"""The host (CPU) backend: kernels whose bits do not depend on the batch size.

Why not numpy: OpenBLAS takes gemv for one row and gemm for several, and the two sum in
different orders, so row i of a batched call differs in the last bits from the same row
alone; which gemm kernel runs also depends on the CPU. A speculative verify compares the
base's choice in a batched row with what plain decoding would have chosen, so the rows
must be the same computation, not merely close.

How: every output element of a GEMM is one chain of operations over its own row, in k
order, with an explicit FMA per k (or, on the q8 path, an exact integer sum per block and
an FMA per block); vector lanes run across output columns, threads split output columns,
and rows are blocked only to share each weight load, so a row's bits are a function of
that row alone. The GEMMs, attention, norms, RoPE and SiLU (and the fused residual add + norm and
head norm + RoPE) are C (native.py says why; gemm.c, attention.c and pointwise.c how); the other
kernels are numba (recurrent.py). formats.py holds the weight formats and their layouts (a fused
q/k/v or gate/up weight is one of them with its parts side by side: backend.py's fuse_linears),
check.py the self-check that proves the property on this machine at start-up. layer.c runs a
step's attention layers in one call of those same kernels with the same arguments (layer.py), so
it has their bits and their batch invariance.
"""

from npud.kernels.host import native
from npud.kernels.host.backend import PARALLEL_MIN_WORK, HostBackend
from npud.kernels.host.check import CHECK_ROWS, check_batch_invariance
from npud.kernels.host.formats import KERNELS, pack_q8, pack_tiles, register
from npud.kernels.host.native import QB, TILE


def num_threads() -> int:
    """Threads a GEMM splits its output columns across."""
    return native.threads()


__all__ = ["CHECK_ROWS", "HostBackend", "KERNELS", "PARALLEL_MIN_WORK", "QB", "TILE", "check_batch_invariance",
           "num_threads", "pack_q8", "pack_tiles", "register"]
