"""Which backend serves: the host backend after its batch-invariance self-check (once per
process), the row-at-a-time fallback when that check fails, and `select_backend` for xrt."""

from __future__ import annotations

import threading

import numpy as np
import structlog

from npud.kernels.base import Backend, LinearWeight, numerics_identity

log = structlog.get_logger(__name__)

_lock = threading.Lock()
_default: Backend | None = None


class RowwiseBackend:
    """A backend whose GEMM and attention run one row per call: batch-invariant by construction.

    Used when the start-up self-check finds that the fast kernels' rows depend on M on
    this machine. Every other operation is delegated unchanged.
    """

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = f"{inner.name}-rowwise"

    def numerics_id(self) -> str:
        # its own, not the inner backend's through __getattr__: the GEMM runs another way
        return f"rowwise({numerics_identity(self.inner)})"

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        return np.concatenate([self.inner.linear(x[i : i + 1], w) for i in range(x.shape[0])])

    def attention(self, q, k_cache, v_cache, positions, window, scale):
        return np.concatenate([self.inner.attention(q[i : i + 1], k_cache, v_cache, positions[i : i + 1], window, scale)
                               for i in range(q.shape[0])])

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def default_backend() -> Backend:
    """The host backend, after its batch-invariance self-check on this machine (run once per
    process, and reused from the kernel cache for the same build, ISA path, threads and CPU).

    If any row of an M-row GEMM (M = 1..64: decode, verify, prefill chunks) differs in its
    bits from the one-row call, the result is logged and the row-at-a-time wrapper is
    returned instead.
    """
    global _default
    with _lock:
        if _default is None:
            from npud.kernels import base
            from npud.kernels.ggml.backend import BlockHostBackend, check_block_invariance
            from npud.kernels.host import CHECK_ROWS, check_batch_invariance, checkcache, native, num_threads

            # HostBackend plus GGUF's block formats; the self-check covers both kinds of weight
            host = BlockHostBackend()
            # a pass on these very library bytes, ISA path, thread count and CPU is reused (checkcache.py says why)
            key = checkcache.check_key(native.library_sha256(), native.isa(), num_threads(), base.NUMERICS_VERSION)
            stored = checkcache.read_pass(key)
            if stored is not None:
                native.bf16_dot_hardware(stored["bf16_dot_hardware"])
                log.info("kernel_self_check_reused", backend=host.name, rows=f"1..{CHECK_ROWS}", threads=num_threads(),
                         key=key[:16])
                _default = host
                return _default
            failures = check_batch_invariance(host) + check_block_invariance(host)
            if failures:
                log.warning("kernel_self_check_failed", backend=host.name, failures=failures, fallback="rowwise")
                _default = RowwiseBackend(host)
            else:
                log.info("kernel_self_check_passed", backend=host.name, rows=f"1..{CHECK_ROWS}", threads=num_threads())
                checkcache.write_pass(key, native.bf16_dot_hardware())
                _default = host
        return _default


def select_backend(kind: str = "auto", xrt_design: str | None = None, *,
                   xrt_timeout_ms: int | None = None) -> tuple[Backend, str]:
    """The backend to serve with, and why: "host", "xrt", or "auto" (xrt where it can run).

    Raises ValueError for an unknown kind, and npud.kernels.xrt.XrtUnavailable when "xrt" was
    asked for and cannot run. The host backend is returned after its invariance self-check;
    the NPU backend checks each design against the host when a model first uses its shape
    (npud/kernels/xrt_check.py), and "auto" moves a shape that fails to the host.
    """
    from npud.kernels import xrt

    if kind not in ("auto", "host", "xrt"):
        raise ValueError(f"unknown backend {kind!r}; expected auto, host or xrt")
    host = default_backend()
    if kind == "host":
        return host, "host backend requested"
    ok, why = xrt.probe()
    if ok and xrt_design is None:
        ok, why = False, f"{why}, but no NPU GEMM design table (xrt_design) is configured"
    backend = None
    if ok:
        timeout = xrt.DEFAULT_TIMEOUT_MS if xrt_timeout_ms is None else xrt_timeout_ms
        try:
            backend = xrt.load_backend(xrt_design, host, timeout_ms=timeout, strict=kind == "xrt")
        except xrt.XrtUnavailable as exc:
            ok, why = False, str(exc)
    if not ok:
        if kind == "xrt":
            raise xrt.XrtUnavailable(why)
        return host, f"host backend: {why}"
    return backend, f"{why}, designs from {xrt_design}"
