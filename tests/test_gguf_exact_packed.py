"""The exact float path's packed forms (npud/kernels/ggml/nibbles.py's pack_rows, blockgemm.c): Q4_0 /
Q5_0 / Q4_K / Q5_K q tiles in 4 or 5 bits a weight and float16 factor tiles where every factor is a
float16 value give the bits of the int8 / float32 tiles of the same blocks, and of the numpy
reference chain, on every kernel path and thread count; gemma-3-270m's prefill logits too."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kernel_fixtures import _fma32, isa_and_threads  # noqa: F401  (a fixture)
from npud.kernels.ggml import nibbles
from npud.kernels.ggml.backend import BlockHostBackend, random_block_rows
from npud.kernels.ggml.blocks import BlockFormat, unpack_matrix, widen
from npud.kernels.ggml.gemm import dense_weights, pack_block_matrix
from npud.kernels.host import TILE, native

N, K = 133, 768  # three tiles, the last one padded; three of the k chunks the multi-block rows take
HALF = {BlockFormat.Q8_0, BlockFormat.Q4_0, BlockFormat.Q5_0}  # S is the block's fp16 d


def test_pack_rows_puts_each_column_where_the_kernel_reads_it():
    """Byte b of a k row: column b's u in the low nibble, column b + 32's in the high one; then
    (5 bits) bit c of the little-endian 64-bit word is column c's fifth bit."""
    u = np.arange(64, dtype=np.int16) % 32  # column c holds u = c mod 32: every nibble and fifth bit
    q = (u - 16).astype(np.int8)[None, None, :]  # Q5_0: Z = 16
    row = nibbles.pack_rows(q, BlockFormat.Q5_0)[0, 0]
    assert row.shape == (40,) and row.dtype == np.uint8
    for b in range(32):
        assert row[b] & 15 == u[b] & 15 and row[b] >> 4 == u[b + 32] & 15
    word = int.from_bytes(row[32:].tobytes(), "little")
    assert [word >> c & 1 for c in range(64)] == [int(v) >> 4 for v in u]
    q4 = (np.arange(64) % 16 - 8).astype(np.int8)[None, None, :]  # Q4_0: Z = 8, 32 bytes a row
    assert nibbles.pack_rows(q4, BlockFormat.Q4_0)[0, 0].tolist() == [(c % 16) | ((c + 32) % 16) << 4
                                                                       for c in range(32)]
    with pytest.raises(ValueError, match="do not fit 4 bits"):
        nibbles.pack_rows(np.full((1, 1, 64), 8, np.int8), BlockFormat.Q4_0)


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_packed_forms_hold_the_same_integers_and_factors(fmt):
    raw = random_block_rows(fmt, N, K, seed=11)
    packed = pack_block_matrix(raw, fmt, K)
    plain = pack_block_matrix(raw, fmt, K, compact=False)
    assert plain.data.shape == (3, K, TILE) and plain.data.dtype == np.int8 and plain.scale.dtype == np.float32
    bits = nibbles.PACKED_BITS.get(fmt, 8)
    assert packed.data.shape == (3, K, nibbles.ROW_BYTES[bits])
    assert packed.scale.dtype == (np.float16 if fmt in HALF else np.float32)  # random K-quant S: products
    assert np.array_equal(packed.scale.astype(np.float32).view(np.uint32), plain.scale.view(np.uint32))
    tiles, cols = np.arange(N) // TILE, np.arange(N) % TILE
    zero = nibbles.row_zero(fmt, packed.data)
    assert np.array_equal(nibbles.row_columns(packed.data, tiles, cols, zero), unpack_matrix(raw, fmt, K)[0])
    dense = widen(*unpack_matrix(raw, fmt, K))
    assert np.array_equal(dense_weights(packed).view(np.uint32), dense.view(np.uint32))


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_packed_gemm_bits_equal_the_byte_tiles_and_the_reference(fmt, isa_and_threads):
    """M = 1..9 (one row block, then two in k chunks) and 30 (weights widened once into L1), odd N,
    K of three chunks; every ISA path this CPU has down to the generic C; threads 1 and 2."""
    raw = random_block_rows(fmt, N, K, seed=12)
    packed = pack_block_matrix(raw, fmt, K)
    plain = pack_block_matrix(raw, fmt, K, compact=False)
    dense = widen(*unpack_matrix(raw, fmt, K))
    x = np.random.default_rng(2).standard_normal((30, K)).astype(np.float32)
    acc = np.zeros((30, N), np.float32)
    for k in range(K):
        acc = _fma32(np.repeat(x[:, k : k + 1], N, axis=1), np.broadcast_to(dense[:, k], (30, N)), acc)
    b = BlockHostBackend(parallel=True)
    for path in native.ISA_NAMES[: native.ISA_NAMES.index(native.best_isa()) + 1]:
        native.set_isa(path)
        for threads in (1, 2):
            native.set_threads(threads)
            for m in (*range(1, 10), 30):
                want = acc[:m].view(np.uint32)
                assert np.array_equal(b.linear(x[:m], packed).view(np.uint32), want), (path, threads, m)
                assert np.array_equal(b.linear(x[:m], plain).view(np.uint32), want), (path, threads, m)
    # the padded columns of the packed tiles hold q = 0 and S = D = 0 (u = Z): zeros
    out = native.linear_qtiles(x[:2], packed.data, packed.scale, N, None, False, nibbles.row_zero(fmt, packed.data))
    assert out.shape == (2, 3 * TILE) and not out[:, N:].any()


def test_q_tiles_of_another_row_width_are_refused():
    w = pack_block_matrix(random_block_rows(BlockFormat.Q4_0, 64, 32), BlockFormat.Q4_0, 32)
    with pytest.raises(ValueError, match="bytes a k row"):
        native.linear_qtiles(np.zeros((1, 32), np.float32), np.zeros((1, 32, 48), np.uint8), w.scale, 64, None, False)


def test_gemma_prefill_logits_bit_identical_packed_or_not(monkeypatch):
    """The real gemma-3-270m on the exact path: the packed tiles (244 MiB) and the int8 / float32
    ones (292 MiB) give the same logits at every position of a 40-token prefill."""
    from real_gemma import gemma_gguf_path

    from npud.engine.forward import Forward
    from npud.engine.gguf import weights as gguf_weights
    from npud.engine.gguf.load import load_gguf_model
    from npud.engine.model import Model, rows_equal

    path = gemma_gguf_path()
    backend = BlockHostBackend(parallel=True)
    ids = [2] + list(range(1000, 1039))
    cfg, packed, _ = load_gguf_model(path)
    model = Model(cfg, packed, backend)
    tiles = model.nbytes
    got = Forward(model).step_batch_all(ids, 0)
    del model, packed
    monkeypatch.setattr(gguf_weights, "pack_block_matrix", functools.partial(pack_block_matrix, compact=False))
    cfg, plain, _ = load_gguf_model(path)
    model = Model(cfg, plain, backend)
    assert tiles < model.nbytes * 0.9
    print(f"gemma-3-270m exact-path weights: {tiles / 2**20:.1f} MiB packed, {model.nbytes / 2**20:.1f} MiB plain")
    assert rows_equal(got, Forward(model).step_batch_all(ids, 0))
