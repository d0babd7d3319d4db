"""The host backend with GGML block weights: npud/kernels/host's HostBackend plus the block GEMM.

Only linear layers and embedding tables in a BlockFormat take the block path; every
other weight and operation is HostBackend's, unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from collections.abc import Sequence

from npud.kernels.base import FusedLinear, LinearWeight
from npud.kernels.ggml.blocks import LAYOUTS, BlockFormat
from npud.kernels.ggml.gemm import (
    LAYOUT_FLOAT, LAYOUT_Q8, block_embed, block_linear, native_block_linear, pack_block_matrix,
)
from npud.kernels.host import CHECK_ROWS, TILE, HostBackend
from npud.kernels.host.resident import resident_copy


def is_block(w: LinearWeight) -> bool:
    return isinstance(w.fmt, BlockFormat)


class BlockHostBackend(HostBackend):
    """HostBackend that also runs "qtiles" weights (GGUF quant blocks)."""

    def prepare_linear(self, w: LinearWeight) -> LinearWeight:
        if is_block(w):
            if w.layout not in (LAYOUT_FLOAT, LAYOUT_Q8):
                raise ValueError(f"host backend cannot use {w.fmt.value} weights in layout {w.layout!r}")
            if w.bias is not None:  # the kernel adds it: float32, contiguous
                w = dataclasses.replace(w, bias=np.ascontiguousarray(w.bias, dtype=np.float32))
            return w
        return super().prepare_linear(w)

    def fuse_linears(self, parts: Sequence[LinearWeight]) -> FusedLinear | None:
        """Block weights of one type and one K as one "qtiles" weight: each part's tiles (its own
        padding included) one after another, so each part is a view and each column's chain its
        own; None where the types differ, or a bias is on some parts only. Other weights: the host's."""
        if not any(is_block(p) for p in parts):
            return super().fuse_linears(parts)
        first = parts[0]
        if len(parts) < 2 or any(
            p.fmt is not first.fmt or p.layout != first.layout or p.in_features != first.in_features
            or (p.bias is None) != (first.bias is None) for p in parts
        ):
            return None
        starts = np.cumsum([0] + [p.data.shape[0] * TILE for p in parts[:-1]]).tolist()
        data = np.concatenate([p.data for p in parts])
        factors = np.concatenate([p.scale for p in parts])
        if first.layout == LAYOUT_Q8:  # huge pages, as pack_block_matrix's
            data, factors = resident_copy(data), resident_copy(factors)
        bias = None
        if first.bias is not None:
            bias = np.zeros(data.shape[0] * TILE, np.float32)
            for p, s in zip(parts, starts):
                bias[s : s + p.out_features] = p.bias
        fused = LinearWeight(first.fmt, data, factors, bias, first.layout, data.shape[0] * TILE, first.in_features)
        views = []
        for p, s in zip(parts, starts):
            tiles = slice(s // TILE, s // TILE + p.data.shape[0])
            views.append(LinearWeight(p.fmt, data[tiles], factors[tiles],
                                      None if bias is None else bias[s : s + p.out_features], first.layout,
                                      p.out_features, p.in_features))
        return FusedLinear(fused, tuple(views), tuple(starts))

    def native_linear(self, w: LinearWeight):
        """Block weights as the host decoder layer calls them (native_block_linear); other weights: the host's."""
        if is_block(w):
            return native_block_linear(w)
        return super().native_linear(w)

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        if is_block(w):
            return block_linear(x, w, self.parallel)
        return super().linear(x, w)

    def embed(self, table: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        if not is_block(table):
            return super().embed(table, tokens)
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        vocab = table.out_features
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary of {vocab}")
        return block_embed(table, tokens)


def random_block_weight(fmt: BlockFormat, n: int, k: int, seed: int = 0, layout: str = LAYOUT_FLOAT) -> LinearWeight:
    """A [n, k] weight of random blocks with finite scales (for self-checks and tests)."""
    return pack_block_matrix(random_block_rows(fmt, n, k, seed), fmt, k, layout=layout)


def random_block_rows(fmt: BlockFormat, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k / block_weights * block_bytes] uint8: n rows of random blocks with finite scales."""
    lay = LAYOUTS[fmt]
    rng = np.random.default_rng(seed)
    blocks = n * (k // lay.block_weights)
    raw = rng.integers(0, 256, size=(blocks, lay.block_bytes), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=(blocks, 2)).astype(np.float16).view(np.uint8)
    # where each type keeps its f16 scale(s): the first bytes, or Q6_K's last two
    if fmt is BlockFormat.Q6_K:
        raw[:, 208:210] = scales[:, 0:2]
    elif lay.has_offset:
        raw[:, 0:4] = scales
    else:
        raw[:, 0:2] = scales[:, 0:2]
    return raw.reshape(n, -1)


def check_block_invariance(backend, rows: int = CHECK_ROWS, k: int = 512, n: int = 136, seed: int = 0,
                           k_q8: int = 768) -> list[str]:
    """Run every block format's GEMM for M = 1..rows and compare row bits with one-row calls.

    Returns failure descriptions (empty when every row of every M matched). N is not a
    multiple of the tile, so a padded tile is exercised too; rows up to 64 take every row
    block size and k chunk size of the kernel (blockgemm.c), K = 512 two of the largest chunks.
    The q8 layout (blockq8.c) runs at K = k_q8: 768 is one 512-k chunk and a part of another,
    so the partial sums that wait between chunks are checked too. Every slower ISA path (down to
    the generic C) gives the M-row call's bits on both layouts; a smaller form of the same
    numbers (packed q, float16 factors) gives the one-row bits of the plain form.
    """
    x_all = np.random.default_rng(seed).standard_normal((rows, max(k, k_q8))).astype(np.float32)
    x_all[rows // 2] *= 1e-3  # a row of another magnitude: its own q8 block scales
    failures = []
    for layout in (LAYOUT_FLOAT, LAYOUT_Q8):
        tag = "" if layout == LAYOUT_FLOAT else "/q8"
        kk = k if layout == LAYOUT_FLOAT else k_q8
        x = np.ascontiguousarray(x_all[:, :kk])
        for fmt in BlockFormat:
            w = backend.prepare_linear(random_block_weight(fmt, n, kk, seed, layout))
            variants = [(tag, w)]
            if w.scale.dtype == np.float16 and w.data.ndim == 4:  # float16 factor tiles, and float32 ones too
                # (Q8_0; packed Q4_0 / Q5_0 tiles come with float16 factors only: npud/kernels/ggml/nibbles.py)
                variants.append((tag + "f32", dataclasses.replace(w, scale=w.scale.astype(np.float32))))
            if layout == LAYOUT_FLOAT and (w.data.shape[2] != TILE or w.scale.dtype == np.float16):
                # the exact path's packed q / float16 factors against int8 and float32 tiles of the same blocks
                raw = random_block_rows(fmt, n, kk, seed)
                variants.append(("/bytes", backend.prepare_linear(pack_block_matrix(raw, fmt, kk, compact=False))))
            for name, wv in variants:
                single = np.concatenate([backend.linear(x[i : i + 1], wv) for i in range(rows)])
                if name != tag and not np.array_equal(single.view(np.uint32), first.view(np.uint32)):
                    failures.append(f"{fmt.value}{name} != {fmt.value}{tag}")
                    continue
                first = single
                if name == "/bytes":  # the same bits as the served form, checked in full just above
                    continue
                for m in range(1, rows + 1):
                    if not np.array_equal(backend.linear(x[:m], wv).view(np.uint32), single[:m].view(np.uint32)):
                        failures.append(f"{fmt.value}{name} M={m}")
                failures += _isa_failures(backend, x, wv, single, f"{fmt.value}{name}")
    return failures


def _isa_failures(backend, x: np.ndarray, w: LinearWeight, best: np.ndarray, name: str) -> list[str]:
    """The block kernel on every slower ISA path this CPU has (down to the generic C) against the
    path in use: one-row calls and the whole M-row call must give the same bits on each."""
    from npud.kernels.host import native

    in_use = native.isa()
    failures = []
    try:
        for path in native.ISA_NAMES[: native.ISA_NAMES.index(in_use)]:
            native.set_isa(path)
            if not np.array_equal(backend.linear(x, w).view(np.uint32), best.view(np.uint32)):
                failures.append(f"{name} isa={path}")
    finally:
        native.set_isa(in_use)
    return failures
