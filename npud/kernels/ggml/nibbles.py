"""Q4_0, Q5_0, Q4_K and Q5_K q tiles packed in 4 or 5 bits a weight, for both block kernels.

gguf-q8 (npud/kernels/host/blockq8.c says the layout; pack, q_columns):

The 8-bit "q8blocks" tiles hold u = q + 128 as [T, K / 4, TILE, 4] bytes: 64 columns by 4 k a
row of 256 bytes, four 64-byte vectors (columns 0-15, 16-31, 32-47, 48-63). Q4_0's and Q4_K's q
need 4 bits, Q5_0's and Q5_K's 5, so their tiles hold u = q + Z (Z = 8, 0, 16, 0) packed per
group of 32 k (8 such rows):
[T, K / 32, 1024 (+ 256)] bytes, row k4's 128 bytes first (byte b of the first 64: vector 0's
byte b in the low nibble, vector 1's in the high; the next 64: vectors 2 and 3), then for 5 bits
a plane of 4 x 64 bytes whose byte b of vector v holds, in bit k4, the fifth bit of row k4's u.
The integers are the same; the q tiles take 1/2 (4 bits) or 5/8 (5 bits) of the bytes.

The exact float path (npud/kernels/host/blockgemm.c; pack_rows): its q tiles [T, K, TILE] int8 hold
one k row of 64 columns each; packed, a k row is 32 bytes (byte b: column b's u in the low
nibble, column b + 32's in the high one: two 16-byte loads widen to columns 0-15 and 16-31 by a
mask, 32-47 and 48-63 by a shift), then for 5 bits 8 bytes whose bit c (little-endian) is column
c's fifth bit (a 16-bit lane mask per vector): [T, K, 32 | 40] uint8, u = q + Z as above.
"""

from __future__ import annotations

import numpy as np

from npud.kernels.ggml.blocks import BlockFormat

PACKED_BITS = {BlockFormat.Q4_0: 4, BlockFormat.Q5_0: 5, BlockFormat.Q4_K: 4, BlockFormat.Q5_K: 5}
ZERO = {BlockFormat.Q4_0: 8, BlockFormat.Q5_0: 16, BlockFormat.Q4_K: 0, BlockFormat.Q5_K: 0}  # u = q + Z
BYTE_ZERO = 128  # the byte tiles' Z
GROUP_BYTES = {4: 1024, 5: 1280}
ROW_BYTES = {8: 64, 4: 32, 5: 40}  # the exact path's bytes a k row (native.QT_ROW_BITS's inverse)


def zero_of(fmt, data: np.ndarray) -> int:
    """Z of a weight's q tiles: 128 for byte tiles, else its format's."""
    return BYTE_ZERO if data.ndim == 4 else ZERO[fmt]


def qbits_of(data: np.ndarray) -> int:
    """8 for [T, K / 4, TILE, 4] byte tiles, else 4 or 5 from a packed [T, K / 32, 1024 | 1280]."""
    if data.ndim == 4:
        return 8
    return {v: k for k, v in GROUP_BYTES.items()}[data.shape[2]]


def _u(q: np.ndarray, fmt, zero: int) -> np.ndarray:
    """u = q - zero + ZERO[fmt] as uint8, or ValueError when some u does not fit the format's bits."""
    bits = PACKED_BITS[fmt]
    u = q.astype(np.int16) - zero + ZERO[fmt]
    if u.min(initial=0) < 0 or u.max(initial=0) >= 1 << bits:
        raise ValueError(f"{fmt.value}: q values do not fit {bits} bits")
    return u.astype(np.uint8)


def row_zero(fmt, data: np.ndarray) -> int:
    """Z of the exact path's q tiles: 0 for int8 tiles [T, K, 64], else the format's."""
    return 0 if data.shape[2] == ROW_BYTES[8] else ZERO[fmt]


def pack_rows(q_tiles: np.ndarray, fmt) -> np.ndarray:
    """The exact path's [T, K, TILE] int8 q tiles -> packed [T, K, ROW_BYTES[bits]] uint8."""
    u = _u(q_tiles, fmt, 0)
    nib = (u[:, :, :32] & 15) | ((u[:, :, 32:] & 15) << 4)
    if PACKED_BITS[fmt] == 4:
        return np.ascontiguousarray(nib)
    fifth = np.packbits((u >> 4) & 1, axis=2, bitorder="little")  # [T, K, 8]: bit c of the 64-bit word
    return np.ascontiguousarray(np.concatenate([nib, fifth], axis=2))


def row_columns(data: np.ndarray, tiles: np.ndarray, cols: np.ndarray, zero: int) -> np.ndarray:
    """The int8 q [n, K] of columns cols [n] of tiles [n] of the exact path's q tiles (int8 or packed)."""
    rows = data[tiles]  # [n, K, bytes]
    if data.shape[2] == ROW_BYTES[8]:
        return rows[np.arange(len(tiles)), :, cols].astype(np.int8)
    n = np.arange(len(tiles))
    byte = rows[n, :, cols % 32].astype(np.int16)  # [n, K]
    u = np.where((cols >= 32)[:, None], byte >> 4, byte & 15)
    if data.shape[2] == ROW_BYTES[5]:
        u = u | (((rows[n, :, 32 + cols // 8].astype(np.int16) >> (cols % 8)[:, None]) & 1) << 4)
    return (u - zero).astype(np.int8)


def pack(u8_tiles: np.ndarray, fmt) -> np.ndarray:
    """[T, K / 4, TILE, 4] uint8 tiles of q + 128 -> the packed [T, K / 32, GROUP_BYTES[bits]] uint8."""
    t, k4s = u8_tiles.shape[:2]
    bits = PACKED_BITS[fmt]
    u = _u(u8_tiles, fmt, BYTE_ZERO)
    u = u.reshape(t, k4s // 8, 8, 4, 64)  # [tile, group, k4, vector, byte]
    nib = (u[:, :, :, 0::2] & 15) | ((u[:, :, :, 1::2] & 15) << 4)  # [tile, group, k4, 2, 64]
    parts = [nib.reshape(t, k4s // 8, 1024)]
    if bits == 5:
        fifth = ((u >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, None, :, None, None]
        parts.append(np.bitwise_or.reduce(fifth, axis=2).reshape(t, k4s // 8, 256))
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def q_columns(data: np.ndarray, tiles: np.ndarray, cols: np.ndarray, zero: int = BYTE_ZERO) -> np.ndarray:
    """The int8 q [n, K] of columns cols [n] of tiles [n] of byte or packed q tiles (u = q + zero)."""
    bits = qbits_of(data)
    if bits == 8:
        return (data[tiles, :, cols, :].astype(np.int16) - 128).astype(np.int8).reshape(len(tiles), -1)
    g = data[tiles]  # [n, K / 32, bytes]
    v, b = cols // 16, (cols % 16) * 4
    n, groups = g.shape[:2]
    k4 = np.arange(8)[:, None]
    i = np.arange(4)[None, :]
    rows = []
    for r in range(n):
        idx = k4 * 128 + (v[r] // 2) * 64 + b[r] + i  # [8, 4]
        u = (g[r][:, idx] >> (4 * (v[r] % 2))) & 15  # [groups, 8, 4]
        if bits == 5:
            u = u | (((g[r][:, 1024 + v[r] * 64 + b[r] + i] >> k4[None]) & 1) << 4)
        rows.append((u.astype(np.int16) - zero).astype(np.int8).reshape(-1))
    return np.stack(rows) if rows else np.zeros((0, groups * 32), np.int8)
