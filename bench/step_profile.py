"""A decode step's profile, shared by the benches: native calls into the host library per step, and
the microseconds a step spends outside the GEMMs.

- Native calls: every `npud_*` function of the host library (npud/kernels/host/native.py's ctypes
  library) is wrapped to count its calls for the length of one call of `run` (the wrapping costs
  time, so a counted step is never a timed one).
- Outside GEMMs: a step's wall time less its GEMM time from the library's GEMM clock (pool.c's
  npud_gemm_clock: every GEMM entry from its start to its return, whether Python or layer.c called
  it): per-row kernels, attention, copies, ctypes, Python, and whatever time the scheduler gave
  another process then.

A "step" is whatever `run` does: one sequence's decode step (bench/step_calls.py,
bench/gguf_anchors.py) or one batched round of N sequences, one token each (bench/batch.py,
bench/batch_daemon.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class _Counted:
    """A library function that counts its calls (attributes read through to the function)."""

    def __init__(self, fn, counts: dict, name: str):
        self._fn, self._counts, self._name = fn, counts, name

    def __call__(self, *args):
        self._counts[self._name] = self._counts.get(self._name, 0) + 1
        return self._fn(*args)

    def __getattr__(self, attr):
        return getattr(self._fn, attr)


def count_native_calls(run: Callable[[], object]) -> tuple[dict[str, int], object]:
    """run() with every npud_* function of the host library counting its calls; ({name: calls},
    what run returned)."""
    from npud.kernels.host import native

    lib = native.library()
    names = [n for n in dir(lib) if n.startswith("npud_")]  # those bound so far: every one a step uses
    counts: dict[str, int] = {}
    saved = {n: getattr(lib, n) for n in names}
    try:
        for n in names:
            setattr(lib, n, _Counted(saved[n], counts, n))
        out = run()
    finally:
        for n in names:
            setattr(lib, n, saved[n])
    return counts, out


def timed(run: Callable[[], object]) -> tuple[int, int, object]:
    """run() once: (its wall nanoseconds, the nanoseconds of it outside GEMMs, what it returned)."""
    from npud.kernels.host import native

    c0 = native.gemm_clock()[1]
    t0 = time.perf_counter_ns()
    out = run()
    wall = time.perf_counter_ns() - t0
    return wall, wall - (native.gemm_clock()[1] - c0), out


def counted(run: Callable[[], object]) -> tuple[dict, object]:
    """run() once, untimed, counting: ({"calls": native calls, "gemm_calls": GEMMs, "by_name": {...}},
    what run returned)."""
    from npud.kernels.host import native

    g0 = native.gemm_clock()[0]
    by_name, out = count_native_calls(run)
    return {"calls": sum(by_name.values()), "gemm_calls": native.gemm_clock()[0] - g0, "by_name": by_name}, out


def profile_steps(step: Callable[[], object], steps: int) -> dict:
    """`steps` timed calls of step(), then one counted: {"step_ms": median wall, "outside_us": median
    time outside GEMMs, "calls", "gemm_calls", "by_name"} (the counts of the last call)."""
    walls, outside = [], []
    for _ in range(steps):
        wall, out_ns, _ = timed(step)
        walls.append(wall)
        outside.append(out_ns)
    counts, _ = counted(step)
    return {"step_ms": statistics.median(walls) / 1e6, "outside_us": statistics.median(outside) / 1e3, **counts}


def decode_profile(model, prompt: list[int], steps: int, warmup: int = 2) -> dict:
    """profile_steps of `steps` greedy decode steps of `model` (npud.engine.model.Model) on a fresh
    sequence after a prefill of `prompt` and `warmup` untimed steps."""
    from npud.engine.forward import Forward

    f = Forward(model)
    tok = int(f.prefill(prompt).argmax())
    for _ in range(warmup):
        tok = int(f.step(tok, f.positions_held).argmax())
    state = {"tok": tok}

    def step() -> None:
        state["tok"] = int(f.step(state["tok"], f.positions_held).argmax())

    return profile_steps(step, steps)


def columns(profile: dict) -> str:
    """The profile as the benches print it: 'N calls (G GEMMs), U us outside GEMMs'."""
    return f"{profile['calls']} calls ({profile['gemm_calls']} GEMMs), {profile['outside_us']:.0f} us outside GEMMs"
