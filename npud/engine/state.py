"""Model state as per-layer planes, each knowing its own geometry.

One place knows widths. A model whose layers differ (two KV widths, KV-shared layers,
recurrent layers) is cut, snapshotted and restored plane by plane, each plane at its own
width; nothing counts positions from one global row width. (The defect this prevents:
counting every layer at one width read twice the positions on the narrow layers, and each
cut kept half the rows on the wide ones.)

- `KVPlane`: K and V rows [positions, kv_heads, head_dim] of this layer. A sliding-window
  layer keeps every row too (the window is applied when attending), so it cuts like any other.
- `SharedPlane`: a KV-shared layer reads its owner's plane and owns nothing. It stays empty
  through snapshot, restore and cuts, and positions_held ignores it.
- `RecurrentPlane`: a linear-attention layer's state (conv and recurrent tensors) at exactly
  its position. It cannot be cut by slicing; during a pass it keeps the state after every
  row, so a verify can commit any accepted prefix of the pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class StateError(ValueError):
    """A cut, snapshot or restore that the planes cannot honour."""


class PlaneKind(enum.Enum):
    KV = "kv"
    SHARED = "shared"
    RECURRENT = "recurrent"


@dataclass(slots=True, frozen=True)
class PlaneSnapshot:
    """One plane's content at `positions`; arrays are private copies."""

    kind: PlaneKind
    layer: int
    positions: int
    geometry: tuple[tuple[str, int | tuple[int, ...]], ...]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass(slots=True, frozen=True)
class StateSnapshot:
    """A whole model state at `positions`: one `PlaneSnapshot` per layer, in layer order."""

    positions: int
    planes: tuple[PlaneSnapshot, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)

    def prefix(self, n: int) -> "StateSnapshot":
        """The snapshot of the first n positions.

        KV planes are sliced at their own widths (views of this snapshot's arrays, not
        copies: restoring copies them); a recurrent plane holds one position only, so any
        n other than `positions` raises StateError.
        """
        if not 0 <= n <= self.positions:
            raise StateError(f"prefix({n}) of a snapshot holding {self.positions} positions")
        if n == self.positions:
            return self
        planes = []
        for p in self.planes:
            if p.kind is PlaneKind.RECURRENT:
                raise StateError(
                    f"layer {p.layer} is recurrent: its snapshot holds position {p.positions} only, not {n}"
                )
            if p.kind is PlaneKind.SHARED:
                planes.append(p)
                continue
            planes.append(
                PlaneSnapshot(p.kind, p.layer, n, p.geometry, {k: a[:n] for k, a in p.arrays.items()})
            )
        return StateSnapshot(n, tuple(planes))


class KVPlane:
    """K and V rows of one attention layer, grown by doubling."""

    kind = PlaneKind.KV

    def __init__(self, layer: int, num_kv_heads: int, head_dim: int, window: int = 0, capacity: int = 64):
        self.layer = layer
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.length = 0
        self.k = np.empty((capacity, num_kv_heads, head_dim), np.float32)
        self.v = np.empty((capacity, num_kv_heads, head_dim), np.float32)

    @property
    def width(self) -> int:
        """Floats per position in each of K and V."""
        return self.num_kv_heads * self.head_dim

    @property
    def positions_held(self) -> int:
        return self.length

    @property
    def geometry(self) -> tuple:
        return (("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim), ("window", self.window))

    @property
    def nbytes(self) -> int:
        return 2 * self.length * self.width * 4

    def append(self, k_rows: np.ndarray, v_rows: np.ndarray) -> None:
        # k_rows, v_rows: [M, kv_heads, head_dim]
        m = k_rows.shape[0]
        self.reserve(m)
        self.k[self.length : self.length + m] = k_rows
        self.v[self.length : self.length + m] = v_rows
        self.length += m

    def reserve(self, rows: int) -> None:
        """Room for `rows` more positions in k and v (grown by doubling; the rows held are kept),
        so that a layer call can write them in place (npud.kernels.base.PlaneRows)."""
        need = self.length + rows
        if need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = np.empty((cap, self.num_kv_heads, self.head_dim), np.float32)
                grown[: self.length] = old[: self.length]
                setattr(self, name, grown)

    def extend(self, rows: int) -> None:
        """Count as held the next `rows` positions, which a layer call wrote in place after `reserve`."""
        if not 0 <= rows <= self.k.shape[0] - self.length:
            room = self.k.shape[0] - self.length
            raise StateError(f"layer {self.layer}: cannot extend by {rows} rows: room for {room}")
        self.length += rows

    def keys(self) -> np.ndarray:
        return self.k[: self.length]

    def values(self) -> np.ndarray:
        return self.v[: self.length]

    def keep_positions(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise StateError(f"layer {self.layer}: cannot keep {n} positions, {self.length} held")
        self.length = n

    def snapshot(self) -> PlaneSnapshot:
        n = self.length
        return PlaneSnapshot(
            PlaneKind.KV, self.layer, n, self.geometry, {"k": self.k[:n].copy(), "v": self.v[:n].copy()}
        )

    def array_shapes(self, positions: int) -> dict[str, tuple[int, ...]]:
        """The float32 arrays a snapshot of this plane at `positions` holds, by name."""
        shape = (positions, self.num_kv_heads, self.head_dim)
        return {"k": shape, "v": shape}

    def check_restore(self, snap: PlaneSnapshot) -> None:
        _check_same(self, snap)
        _check_arrays(self.layer, snap, self.array_shapes(snap.positions))

    def restore(self, snap: PlaneSnapshot) -> None:
        n = snap.positions
        # headroom, so that the pass right after a restore does not copy every row again to
        # grow; np.empty maps pages lazily, so the unused half costs address space only
        if self.k.shape[0] < n + 1:
            cap = max(64, 2 * n)
            self.k = np.empty((cap, self.num_kv_heads, self.head_dim), np.float32)
            self.v = np.empty((cap, self.num_kv_heads, self.head_dim), np.float32)
        self.k[:n] = snap.arrays["k"]
        self.v[:n] = snap.arrays["v"]
        self.length = n


class SharedPlane:
    """A KV-shared layer: it reads `owner`'s plane and holds nothing of its own."""

    kind = PlaneKind.SHARED

    def __init__(self, layer: int, owner: int):
        self.layer = layer
        self.owner = owner

    positions_held = None  # ignored when counting positions
    width = 0
    nbytes = 0

    @property
    def geometry(self) -> tuple:
        return (("owner", self.owner),)

    def keep_positions(self, n: int) -> None:
        pass  # nothing held; the owner's plane is cut on its own

    def snapshot(self) -> PlaneSnapshot:
        return PlaneSnapshot(PlaneKind.SHARED, self.layer, 0, self.geometry, {})

    def array_shapes(self, positions: int) -> dict[str, tuple[int, ...]]:
        return {}

    def check_restore(self, snap: PlaneSnapshot) -> None:
        _check_same(self, snap)
        if snap.arrays or snap.positions:
            raise StateError(
                f"layer {self.layer} is KV-shared but its snapshot holds {snap.positions} positions "
                f"in {sorted(snap.arrays)}"
            )

    def restore(self, snap: PlaneSnapshot) -> None:
        pass


class RecurrentPlane:
    """State of a linear-attention (GDN) layer at exactly `length` positions.

    `begin_pass()` marks the start of a batched pass; `advance(arrays)` records the state
    after each row. `keep_positions(n)` may then go back to any position the pass went
    through, or up to `retain` positions behind the current one from earlier passes (a
    draft model that stepped k tokens one pass each and is cut back to its accepted ones);
    any other cut raises StateError, since a recurrent state cannot be sliced.
    """

    kind = PlaneKind.RECURRENT

    def __init__(self, layer: int, shapes: dict[str, tuple[int, ...]], retain: int = 0):
        self.layer = layer
        self.shapes = dict(shapes)
        self.retain = retain
        self.arrays = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        self.length = 0
        self._history: dict[int, dict[str, np.ndarray]] = {0: self._copy()}

    def _copy(self) -> dict[str, np.ndarray]:
        return {k: a.copy() for k, a in self.arrays.items()}

    @property
    def positions_held(self) -> int:
        return self.length

    @property
    def geometry(self) -> tuple:
        return tuple((name, tuple(shape)) for name, shape in sorted(self.shapes.items()))

    @property
    def width(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def begin_pass(self) -> None:
        keep = self.length - self.retain
        self._history = {n: saved for n, saved in self._history.items() if keep <= n < self.length}
        self._history[self.length] = self._copy()

    def advance(self, arrays: dict[str, np.ndarray], record: bool = True) -> None:
        """Move one position on to `arrays`; record=False keeps no copy to return to (a
        prefill, which is never cut inside, need not hold a state per row)."""
        for name, a in arrays.items():
            self.arrays[name][...] = a
        self.length += 1
        if record:
            self._history[self.length] = self._copy()

    def keep_positions(self, n: int) -> None:
        if n == self.length:
            return
        saved = self._history.get(n)
        if saved is None:
            raise StateError(
                f"layer {self.layer} is recurrent: it can return to positions {sorted(self._history)}, not {n}"
            )
        for name, a in saved.items():
            self.arrays[name][...] = a
        self.length = n
        self._history = {k: v for k, v in self._history.items() if k <= n}

    def snapshot(self) -> PlaneSnapshot:
        return PlaneSnapshot(PlaneKind.RECURRENT, self.layer, self.length, self.geometry, self._copy())

    def array_shapes(self, positions: int) -> dict[str, tuple[int, ...]]:
        return {name: tuple(shape) for name, shape in self.shapes.items()}

    def check_restore(self, snap: PlaneSnapshot) -> None:
        _check_same(self, snap)
        _check_arrays(self.layer, snap, self.array_shapes(snap.positions))

    def restore(self, snap: PlaneSnapshot) -> None:
        for name in self.shapes:
            self.arrays[name][...] = snap.arrays[name]
        self.length = snap.positions
        self._history = {self.length: self._copy()}


def _check_same(plane, snap: PlaneSnapshot) -> None:
    if snap.kind is not plane.kind or snap.layer != plane.layer:
        raise StateError(
            f"snapshot plane is {snap.kind.value} layer {snap.layer}, state has {plane.kind.value} layer {plane.layer}"
        )
    if tuple(snap.geometry) != tuple(plane.geometry):
        raise StateError(f"layer {plane.layer}: snapshot geometry {snap.geometry} != state geometry {plane.geometry}")


def _check_arrays(layer: int, snap: PlaneSnapshot, want: dict[str, tuple[int, ...]]) -> None:
    # exactly the named float32 arrays: a float64 or float16 array (say, read back from a
    # file) would be converted silently on restore and change the bits
    if set(snap.arrays) != set(want):
        raise StateError(f"layer {layer}: snapshot holds arrays {sorted(snap.arrays)}, expected {sorted(want)}")
    for name, shape in want.items():
        a = snap.arrays[name]
        if a.shape != shape or a.dtype != np.float32:
            raise StateError(
                f"layer {layer}: snapshot {name} is {a.dtype} {a.shape}, expected float32 {shape}"
            )


Plane = KVPlane | SharedPlane | RecurrentPlane


class ModelState:
    """The planes of one sequence's state, in layer order."""

    def __init__(self, planes: list[Plane]):
        self.planes = planes

    @classmethod
    def for_config(cls, cfg, recurrent_retain: int = 0) -> "ModelState":
        """Fresh, empty planes for a `ModelConfig` (npud/engine/config/); recurrent planes keep
        `recurrent_retain` positions from earlier passes (RecurrentPlane)."""
        from npud.engine.config import AttentionKind

        planes: list[Plane] = []
        for spec in cfg.layers:
            if spec.kind is AttentionKind.LINEAR:
                planes.append(RecurrentPlane(spec.index, cfg.recurrent_state_shapes(spec), recurrent_retain))
            elif not spec.owns_kv:
                planes.append(SharedPlane(spec.index, spec.kv_owner))
            else:
                planes.append(KVPlane(spec.index, spec.num_kv_heads, spec.head_dim, spec.window))
        return cls(planes)

    def kv_widths(self) -> list[int]:
        """Floats per position in K (and in V) for every layer; 0 where a layer owns no KV rows."""
        return [p.width for p in self.planes]

    def positions_held(self) -> int:
        counts = {p.positions_held for p in self.planes if p.positions_held is not None}
        if len(counts) > 1:
            raise StateError(f"planes disagree on positions held: {sorted(counts)}")
        return counts.pop() if counts else 0

    def keep_positions(self, n: int) -> None:
        """Cut every plane to n positions, each at its own width; StateError changes nothing."""
        held = self.positions_held()
        if not 0 <= n <= held:
            raise StateError(f"cannot keep {n} positions: {held} held")
        for p in self.planes:
            if p.kind is PlaneKind.RECURRENT and n != p.length and n not in p._history:
                p.keep_positions(n)  # raises with the reason, before any plane is cut
        for p in self.planes:
            p.keep_positions(n)

    def begin_pass(self) -> None:
        for p in self.planes:
            if p.kind is PlaneKind.RECURRENT:
                p.begin_pass()

    def snapshot(self) -> StateSnapshot:
        return StateSnapshot(self.positions_held(), tuple(p.snapshot() for p in self.planes))

    def check_snapshot(self, snap: StateSnapshot) -> None:
        """Raises StateError unless `snap` fits these planes (kinds, layers, geometry, arrays)."""
        if len(snap.planes) != len(self.planes):
            raise StateError(f"snapshot has {len(snap.planes)} planes, state has {len(self.planes)}")
        for plane, ps in zip(self.planes, snap.planes):
            plane.check_restore(ps)
            if ps.kind is not PlaneKind.SHARED and ps.positions != snap.positions:
                raise StateError(f"layer {ps.layer}: plane holds {ps.positions} positions, snapshot says {snap.positions}")

    def restore(self, snap: StateSnapshot) -> None:
        """Replace the state by `snap`; every plane is checked before any is written."""
        self.check_snapshot(snap)
        for plane, ps in zip(self.planes, snap.planes):
            plane.restore(ps)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)
