"""What mlir-aie's toolchain accepts for a `whole_array` GEMM design, checked before building
and again when npud loads a table.

The design's runtime sequence moves A, B and C with one shim DMA transfer each per column
(`npu_dma_memcpy_nd`), whose sizes and strides the verifier (NpuDmaMemcpyNdOp::verify, then
the buffer descriptor's fields) bounds:

- the outermost size (the BD's iteration count) is at most 64;
- every inner size is at most 1023, the innermost counted in 32-bit words (two bf16 values
  make one word);
- every stride is at most 1M (2^20) 32-bit words.

A's and B's outermost size is N / (n * columns), so one pass can cover at most
64 * n * columns output columns (8192 with n = 32 on 4 columns): a wider layer (the output
layer, N = vocabulary) runs as several passes of one design over slices of its weight.
K has no such escape (a split K would change the order of the sums), so a K past the limits
stays on the host.

The generator's own asserts: columns in {1, 2, 4, 8} (npu1 has 4), and with B column-major
(`b_col_maj`) m, k and n multiples of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REPEAT = 64  # the outermost size of a shim transfer (the BD's iteration count)
MAX_WRAP = 1023  # each inner size; the innermost in 32-bit words
MAX_STRIDE_WORDS = 1 << 20  # every stride, in 32-bit words
COLUMNS = {"npu1": (1, 2, 4), "npu2": (1, 2, 4, 8)}  # whole_array's --n-aie-cols on each device
COL_MAJOR_MULTIPLE = 32  # whole_array asserts m, k, n % 32 == 0 when B is column-major
N_AIE_ROWS = 4
IN_BYTES, OUT_BYTES = 2, 4  # bf16 in, f32 out (int8 designs: 1 in, i32 out, `in_bytes`)


@dataclass(slots=True, frozen=True)
class Transfer:
    """One shim DMA transfer of the runtime sequence: sizes and strides outermost first, in
    elements of `elem_bytes` (the innermost stride is 1)."""

    name: str
    sizes: tuple[int, int, int, int]
    strides: tuple[int, int, int]  # of the three outer dimensions; the innermost's is 1
    elem_bytes: int

    def errors(self) -> list[str]:
        out = []
        words_inner = self.sizes[3] * self.elem_bytes / 4
        if self.sizes[0] > MAX_REPEAT:
            out.append(f"{self.name}'s outermost size {self.sizes[0]} exceeds {MAX_REPEAT}")
        for i, size in enumerate(self.sizes[1:3], 1):
            if size > MAX_WRAP:
                out.append(f"{self.name}'s size {i} = {size} exceeds {MAX_WRAP}")
        if words_inner > MAX_WRAP or words_inner != int(words_inner):
            out.append(f"{self.name}'s innermost size {self.sizes[3]} is {words_inner:g} words (at most "
                       f"{MAX_WRAP} whole words)")
        for i, stride in enumerate(self.strides):
            words = stride * self.elem_bytes / 4
            if words > MAX_STRIDE_WORDS:
                out.append(f"{self.name}'s stride {i} = {stride} is {words:g} words (at most 1M)")
        return out


def transfers(M: int, K: int, N: int, m: int, k: int, n: int, columns: int, b_col_major: bool,
              in_bytes: int = IN_BYTES) -> list[Transfer]:
    """The three transfers of a whole_array design compiled for M x K x N (one pass); `in_bytes`
    is the size of an A and B element (2: bf16, 1: int8; C is 4 bytes either way: f32 or i32)."""
    a_tiles_per_shim = N_AIE_ROWS // columns if columns < N_AIE_ROWS else 1
    blocks_n = N // (n * columns)
    rows_per_block = min(2, M // (m * N_AIE_ROWS))  # two tile rows per ping or pong
    a = Transfer("A", (blocks_n, K // k, m * a_tiles_per_shim, k), (0, k, K), in_bytes)
    if b_col_major:
        b = Transfer("B", (blocks_n, K // k, n, k), (n * columns * K, k, K), in_bytes)
    else:
        b = Transfer("B", (blocks_n, K // k, k, n), (n * columns, k * N, N), in_bytes)
    c = Transfer("C", (rows_per_block, blocks_n, m * N_AIE_ROWS, n), (m * N_AIE_ROWS * N, n * columns, N), OUT_BYTES)
    return [a, b, c]


def transfer_errors(M: int, K: int, N: int, m: int, k: int, n: int, columns: int, b_col_major: bool,
                    in_bytes: int = IN_BYTES) -> list[str]:
    """Why the verifier would refuse the design's transfers (empty when it accepts them)."""
    return [e for t in transfers(M, K, N, m, k, n, columns, b_col_major, in_bytes) for e in t.errors()]


def generator_errors(device: str, m: int, k: int, n: int, columns: int, b_col_major: bool) -> list[str]:
    """The whole_array generator's asserts that are not divisibility of the shape."""
    errors = []
    if columns not in COLUMNS.get(device, ()):
        errors.append(f"columns = {columns}: whole_array takes {list(COLUMNS.get(device, ()))} on {device}")
    if b_col_major:
        bad = [f"{name} = {v}" for name, v in (("tile_m", m), ("tile_k", k), ("tile_n", n)) if v % COL_MAJOR_MULTIPLE]
        if bad:
            errors.append(f"B column-major needs tile_m, tile_k, tile_n multiples of {COL_MAJOR_MULTIPLE} ("
                          + ", ".join(bad) + ")")
    return errors


def split_n(N: int, M: int, K: int, m: int, k: int, n: int, columns: int, b_col_major: bool,
            max_passes: int = 64, in_bytes: int = IN_BYTES) -> tuple[int, int] | None:
    """(passes, compiled N of one pass): the fewest passes whose one design, padded up to
    n * columns, the verifier accepts; None when no number of passes up to `max_passes` does
    (then a limit that does not depend on N is broken: K, or the tiles)."""
    step = n * columns
    for passes in range(1, max_passes + 1):
        per_pass = -(-(-(-N // passes)) // step) * step
        if per_pass * (passes - 1) >= N:
            continue  # an empty last pass
        if not transfer_errors(M, K, per_pass, m, k, n, columns, b_col_major, in_bytes):
            return passes, per_pass
    return None
