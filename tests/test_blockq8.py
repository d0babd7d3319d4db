"""GGUF block weights against q8 activation rows (the "gguf-q8" format, npud/kernels/host/blockq8.c):
the layout holds gguf's own weights, the kernel computes the chain blockq8.c documents (exact
integer group sums, then one float step per group in k order), on every ISA path and thread
count, and a row's bits do not depend on the other rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernel_fixtures import _fma32, isa_and_threads  # noqa: F401  (a fixture)
from npud.kernels.ggml.backend import BlockHostBackend, check_block_invariance, random_block_rows
from npud.kernels.ggml.blocks import LAYOUTS, BlockFormat, unpack_matrix, widen
from npud.kernels.ggml.gemm import LAYOUT_FLOAT, LAYOUT_Q8, dense_weights, pack_block_matrix
from npud.kernels.host import QB, TILE, native

K = 512


def _paths() -> list[str]:
    return list(native.ISA_NAMES[: native.ISA_NAMES.index(native.best_isa()) + 1])


def _reference(x: np.ndarray, q: np.ndarray, factors: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """blockq8.c's chain in numpy: per group G of g weights, i = exact sum of q * xq, v = f32(i) * S,
    v = fma(-D, f32(sum xq), v) (with an offset), acc = fma(v, d[block of G], acc); then + bias."""
    xq, xs, _ = native.quantize_q8(x, x.shape[1])
    m, n, g = x.shape[0], q.shape[0], q.shape[1] // factors.shape[1]
    acc = np.zeros((m, n), np.float32)
    for G in range(factors.shape[1]):
        ks = slice(G * g, (G + 1) * g)
        isum = xq[:, ks].astype(np.int64) @ q[:, ks].astype(np.int64).T  # [M, N], exact
        v = isum.astype(np.float32) * factors[None, :, G, 0]
        if factors.shape[2] == 2:
            s = xq[:, ks].astype(np.int64).sum(axis=1).astype(np.float32)
            v = _fma32(-np.broadcast_to(factors[None, :, G, 1], (m, n)), np.repeat(s[:, None], n, axis=1), v)
        acc = _fma32(v, np.repeat(xs[:, G * g // QB][:, None], n, axis=1), acc)
    return acc + bias


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_layout_holds_ggufs_weights_and_the_kernel_computes_the_documented_chain(fmt, isa_and_threads):
    raw = random_block_rows(fmt, 70, K, seed=5)
    q, factors = unpack_matrix(raw, fmt, K)
    w = pack_block_matrix(raw, fmt, K, layout=LAYOUT_Q8)
    packed = {BlockFormat.Q4_0: 1024, BlockFormat.Q5_0: 1280, BlockFormat.Q4_K: 1024, BlockFormat.Q5_K: 1280}
    # (npud/kernels/ggml/nibbles.py: bytes a tile's group)
    shape = (2, K // 32, packed[fmt]) if fmt in packed else (2, K // 4, TILE, 4)
    assert w.layout == LAYOUT_Q8 and w.data.shape == shape and w.data.dtype == np.uint8
    dense = widen(q, factors)
    assert np.array_equal(dense_weights(w).view(np.uint32), dense.view(np.uint32))
    b = BlockHostBackend(parallel=True)
    rows = np.array([69, 0, 64, 63, 7])
    assert np.array_equal(b.embed(w, rows).view(np.uint32), dense[rows].view(np.uint32))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, K)).astype(np.float32)
    x[3] *= 1e-4  # a row of another magnitude
    bias = rng.standard_normal(70).astype(np.float32)
    expected = _reference(x, q, factors, bias)
    wb = b.prepare_linear(dataclasses.replace(w, bias=bias))
    for path in _paths():
        assert native.set_isa(path) == path
        for threads in (1, 2):
            native.set_threads(threads)
            assert np.array_equal(b.linear(x, wb).view(np.uint32), expected.view(np.uint32)), (path, threads)


@pytest.mark.parametrize("fmt", [BlockFormat.Q5_0, BlockFormat.Q4_K, BlockFormat.Q6_K])
def test_every_path_and_thread_count_gives_the_same_bits_for_every_row_count(fmt, isa_and_threads):
    """Rows 1..64 in one call (every row block size, one and several k chunks at K = 1024), on
    each path and thread count, equal the one-row calls of the best path."""
    b = BlockHostBackend(parallel=True)
    w = b.prepare_linear(pack_block_matrix(random_block_rows(fmt, 136, 1024, seed=2), fmt, 1024, layout=LAYOUT_Q8))
    x = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    native.set_isa(None)
    single = np.concatenate([b.linear(x[i : i + 1], w) for i in range(64)]).view(np.uint32)
    for path in _paths():
        native.set_isa(path)
        for threads in (1, 3):
            native.set_threads(threads)
            for m in (1, 5, 8, 17, 64):
                assert np.array_equal(b.linear(x[:m], w).view(np.uint32), single[:m]), (path, threads, m)


def test_start_up_check_covers_the_q8_layout_on_every_path():
    """check_block_invariance runs both layouts; a backend whose q8 rows depend on the batch fails
    it with the q8 layout's names (the other layout's rows are its own)."""
    assert check_block_invariance(BlockHostBackend()) == []

    class SharedScale(BlockHostBackend):  # every row quantized with the first row's block scales
        def linear(self, x, w):
            if w.layout != LAYOUT_Q8 or x.shape[0] == 1:
                return super().linear(x, w)
            xq, xs, _ = native.quantize_q8(x, x.shape[1])
            return (xq * np.repeat(xs[:1], QB, axis=1)) @ dense_weights(w).T

    failures = check_block_invariance(SharedScale(), rows=6)
    assert failures and all("/q8 M=" in f or "/q8 isa=" in f or "/q8f32 M=" in f or "/q8f32 isa=" in f
                            for f in failures)
    assert {f.split(" ")[0] for f in failures} >= {f"{fmt.value}/q8" for fmt in BlockFormat}
    assert all(f.split(" ")[0].removesuffix("f32").endswith("/q8") for f in failures)


def test_gguf_q8_needs_a_gguf_file(tmp_path):
    from npud.engine.model import Model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="gguf-q8.*GGUF"):
        Model.load(tmp_path, "gguf-q8")


def test_groups_and_offsets_are_the_block_types():
    # the kernel takes g = 16 only with one factor (Q6_K) and the offset only with g = 32
    for fmt, lay in LAYOUTS.items():
        assert (lay.group, lay.has_offset) in ((32, False), (32, True), (16, False)), fmt


@pytest.mark.parametrize("fmt", [BlockFormat.Q8_0, BlockFormat.Q4_0, BlockFormat.Q5_0])
def test_float16_factor_tiles_hold_ggufs_scales_and_give_the_float32_tiles_bits(fmt, isa_and_threads):
    """One factor per 32 weights (gguf's fp16 d) is packed as float16: the same values, widened exactly
    by every path (subnormal, zero, -0 and the largest scales among them), so the bits are the
    float32 tiles' and the documented chain's."""
    raw = random_block_rows(fmt, 70, K, seed=6)
    lay = LAYOUTS[fmt]
    blocks = raw.reshape(-1, lay.block_bytes)
    special = np.array([2.0**-24, 3 * 2.0**-20, 0.0, -0.0, -(2.0**-14), 6.0e4, -6.0e4], np.float16).view(np.uint8)
    blocks[: len(special) // 2 * 7 : 7, 0:2] = special.reshape(-1, 2)  # every 7th block a special scale
    w = pack_block_matrix(raw, fmt, K, layout=LAYOUT_Q8)
    q, factors = unpack_matrix(raw, fmt, K)
    assert w.scale.dtype == np.float16
    assert np.array_equal(w.scale.astype(np.float32).view(np.uint32)[:, :, 0, :].transpose(0, 2, 1).reshape(-1, K // 32)[:70],
                          factors[:, :, 0].view(np.uint32))
    b = BlockHostBackend(parallel=True)
    wide = dataclasses.replace(w, scale=np.ascontiguousarray(w.scale, dtype=np.float32))
    x = np.random.default_rng(7).standard_normal((9, K)).astype(np.float32)
    expected = _reference(x, q, factors, np.zeros(70, np.float32))
    for path in _paths():
        native.set_isa(path)
        half = b.linear(x, w)
        if w.data.ndim == 4:  # Q8_0's byte tiles also run with float32 factors (packed tiles: float16 only)
            assert np.array_equal(half.view(np.uint32), b.linear(x, wide).view(np.uint32)), path
        assert np.array_equal(half.view(np.uint32), (expected + np.float32(0)).view(np.uint32)), path
    native.set_isa(None)


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_0, BlockFormat.Q5_0, BlockFormat.Q4_K, BlockFormat.Q5_K])
def test_packed_q_tiles_hold_the_same_integers_in_4_or_5_bits(fmt):
    """Q4_0 / Q5_0 / Q4_K / Q5_K q tiles packed to nibbles (and a fifth-bit plane): every weight's q read back
    from them is gguf's (the row gather and dense_weights read them too), in 1024 / 1280 bytes a
    tile's group of 32 k instead of 2048."""
    from npud.kernels.ggml import nibbles

    raw = random_block_rows(fmt, 130, K, seed=8)
    q, _ = unpack_matrix(raw, fmt, K)
    w = pack_block_matrix(raw, fmt, K, layout=LAYOUT_Q8)
    assert w.data.shape == (3, K // 32, 1024 if nibbles.PACKED_BITS[fmt] == 4 else 1280)
    tokens = np.arange(130)
    assert np.array_equal(nibbles.q_columns(w.data, tokens // TILE, tokens % TILE, nibbles.ZERO[fmt]), q)
    assert (q.min(), q.max()) == {BlockFormat.Q4_0: (-8, 7), BlockFormat.Q5_0: (-16, 15), BlockFormat.Q4_K: (0, 15),
                                  BlockFormat.Q5_K: (0, 31)}[fmt]


def test_float16_factors_of_another_shape_are_refused():
    w = pack_block_matrix(random_block_rows(BlockFormat.Q4_K, 64, K, seed=1), BlockFormat.Q4_K, K, layout=LAYOUT_Q8)
    assert w.scale.dtype == np.float32  # two factors a group: kept float32
    with pytest.raises(ValueError, match="float16 factor tiles"):
        native.linear_bq8(np.ones((1, K), np.float32), w.data, w.scale.astype(np.float16), 64, None, False)


@pytest.mark.parametrize("layout", [LAYOUT_Q8, LAYOUT_FLOAT])
def test_a_prefill_sized_call_prepares_its_rows_on_the_threads_with_the_one_row_bits(layout):
    """Rows of M x K >= gemm.h's PREP_PARALLEL_MIN at 2 threads: the entry quantizes (gguf-q8) or
    transposes (the exact path's qtiles) them in blocks on the pool's threads (pool.c's pool_for),
    and every row keeps the bits of its one-row call."""
    fmt = BlockFormat.Q4_K
    w = pack_block_matrix(random_block_rows(fmt, 136, 1024, seed=4), fmt, 1024, layout=layout)
    b = BlockHostBackend(parallel=True)
    w = b.prepare_linear(w)
    x = np.random.default_rng(5).standard_normal((40, 1024)).astype(np.float32)  # 40 x 1024 >= 1 << 15
    native.set_isa(None)
    try:
        native.set_threads(1)
        single = np.concatenate([b.linear(x[i : i + 1], w) for i in range(40)]).view(np.uint32)
        native.set_threads(2)
        native.stall_workers(200)  # a worker takes the first block of rows for certain
        before = native.pool_for_stats()
        got = b.linear(x, w).view(np.uint32)
        after = native.pool_for_stats()
    finally:
        native.stall_workers(0)
        native.set_threads(0)
    assert np.array_equal(got, single)
    assert after[0] - before[0] == 1 and after[1] - before[1] == 8, (before, after)  # 4 x 2 blocks
    assert after[2] > before[2], "no worker prepared a block: the bits above checked only the caller's"


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_row_blocks_interleaved_per_group_give_the_one_row_bits(fmt, isa_and_threads):
    """blockq8.c's bq_vnni_multi (several row blocks over each weight group in turn, taken by weights
    of at least bq8_stream_min bytes: the output layer) forced on a small weight: every row count
    (each split into blocks of 2..4 rows, up to the driver's 64 rows and past them) and thread count
    gives the one-row calls' bits, on every path, and the same bits as the chunked row blocks."""
    b = BlockHostBackend(parallel=True)
    w = b.prepare_linear(pack_block_matrix(random_block_rows(fmt, 136, 768, seed=4), fmt, 768, layout=LAYOUT_Q8))
    x = np.random.default_rng(6).standard_normal((70, 768)).astype(np.float32)
    x[9] *= 1e-3  # a row of another magnitude
    native.set_isa(None)
    single = np.concatenate([b.linear(x[i : i + 1], w) for i in range(70)]).view(np.uint32)
    before = native.bq8_stream_min()
    try:
        for path in _paths():
            native.set_isa(path)
            for threads in (1, 2):
                native.set_threads(threads)
                for m in (5, 6, 7, 8, 9, 13, 16, 17, 64, 70):
                    native.bq8_stream_min(0)
                    assert native.bq8_stream_min() == 0  # the threshold took: the interleaved blocks run
                    interleaved = b.linear(x[:m], w).view(np.uint32)
                    native.bq8_stream_min(1 << 40)
                    chunked = b.linear(x[:m], w).view(np.uint32)
                    assert np.array_equal(interleaved, single[:m]), (path, threads, m)
                    assert np.array_equal(chunked, single[:m]), (path, threads, m)
    finally:
        native.bq8_stream_min(before)
    assert native.bq8_stream_min() == before == 8 << 20
    with pytest.raises(ValueError, match="a size in bytes"):
        native.bq8_stream_min(-5)
