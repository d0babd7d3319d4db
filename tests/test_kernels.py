"""Host kernels: batch invariance by construction, widening, packing; the xrt backend's
host-side pieces (the rest of the NPU backend: tests/test_xrt.py)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from kernels.select import RowwiseBackend, select_backend
from kernels.base import LinearWeight, WeightFormat
from kernels.host import TILE, HostBackend, check_batch_invariance, pack_tiles
from kernels import xrt


@pytest.fixture(scope="module")
def host():
    return HostBackend()


def test_self_check_passes_on_this_machine(host):
    assert check_batch_invariance(host) == []


class _NumpyBackend(HostBackend):
    """BLAS GEMM: gemv for one row, gemm for several — the thing the contract rules out."""

    def linear(self, x, w):
        dense = w.data.transpose(0, 2, 1).reshape(-1, w.data.shape[1])[: w.out_features].astype(np.float32)
        if w.fmt is WeightFormat.BF16:
            dense = (w.data.transpose(0, 2, 1).reshape(-1, w.data.shape[1])[: w.out_features].astype(np.uint32) << 16).view(np.float32)
        out = x @ dense.T
        if w.scale is not None:
            out = out * w.scale
        if w.bias is not None:
            out = out + w.bias
        return out


def test_self_check_catches_a_blas_gemm():
    # negative control: the self-check must be able to fail
    assert check_batch_invariance(_NumpyBackend(), k=1024, n=256) != []


def test_rowwise_fallback_is_invariant():
    assert check_batch_invariance(RowwiseBackend(_NumpyBackend()), k=1024, n=256) == []


@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_linear_matches_float64_reference(host, fmt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 130)).astype(np.float32)
    w = rng.standard_normal((70, 130)).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    if fmt is WeightFormat.FP32:
        lw, dense = LinearWeight(fmt, w, None, bias), w
    elif fmt is WeightFormat.BF16:
        bits = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        lw, dense = LinearWeight(fmt, bits, None, bias), torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    else:
        scale = (np.abs(w).max(1) / 127).astype(np.float32)
        q = np.rint(w / scale[:, None]).astype(np.int8)
        lw, dense = LinearWeight(fmt, q, scale, bias), q * scale[:, None]
    got = host.linear(x, host.prepare_linear(lw))
    want = x.astype(np.float64) @ dense.astype(np.float64).T + bias
    assert got.shape == (5, 70)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_pack_tiles_layout():
    w = np.arange(70 * 3, dtype=np.float32).reshape(70, 3)
    t = pack_tiles(w)
    assert t.shape == (2, 3, TILE)
    assert t[1, 2, 5] == w[TILE + 5, 2]
    assert np.all(t[1, :, 70 - TILE :] == 0)  # padded columns


def test_embed_reads_rows_of_tiled_table(host):
    rng = np.random.default_rng(2)
    table = rng.standard_normal((200, 16)).astype(np.float32)
    bits = torch.from_numpy(table).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    ids = np.array([0, 63, 64, 199])
    for lw, dense in ((LinearWeight(WeightFormat.FP32, table), table),
                      (LinearWeight(WeightFormat.BF16, bits), torch.from_numpy(table).to(torch.bfloat16).float().numpy())):
        got = host.embed(host.prepare_linear(lw), ids)
        assert np.array_equal(got, dense[ids])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        host.embed(host.prepare_linear(LinearWeight(WeightFormat.FP32, table)), np.array([200]))


def test_attention_window_and_gqa_match_reference(host):
    rng = np.random.default_rng(3)
    T, H, KVH, D = 12, 4, 2, 8
    q = rng.standard_normal((3, H, D)).astype(np.float32)
    k = rng.standard_normal((T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((T, KVH, D)).astype(np.float32)
    pos = np.array([9, 10, 11])
    for window in (0, 4):
        got = host.attention(q, k, v, pos, window, D**-0.5)
        for m, p in enumerate(pos):
            lo = 0 if window == 0 else max(0, p - window + 1)
            for h in range(H):
                s = k[lo : p + 1, h // 2] @ q[m, h] * D**-0.5
                e = np.exp(s - s.max())
                want = (e / e.sum()) @ v[lo : p + 1, h // 2]
                assert np.allclose(got[m, h], want, atol=1e-5)


def test_bf16_rounding_matches_torch():
    x = np.random.default_rng(4).standard_normal(10_000).astype(np.float32) * 1e3
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(xrt._bf16_bits(x), want)


def test_xrt_probe_reports_what_is_missing(tmp_path):
    ok, why = xrt.probe(tmp_path / "no-accel")
    assert not ok and "no NPU device node" in why
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "accel0").touch()
    ok, why = xrt.probe(tmp_path / "accel")
    assert not ok and "pyxrt" in why  # the binding is not installed on our machines


def test_select_backend_auto_falls_back_to_host_with_reason():
    backend, why = select_backend("auto")
    assert backend.name.startswith("host")
    assert why.startswith("host backend:")
    with pytest.raises(xrt.XrtUnavailable):
        select_backend("xrt")
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("gpu")


# the NPU backend's design table, call protocol and device tests: tests/test_xrt.py
