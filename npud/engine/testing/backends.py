"""A backend seen through the primitive interface alone, for tests and benchmarks that compare a
backend's fused operations (npud.kernels.base: fuse_linears, add_rms_norm, norm_rope, decoder_layer) with the
composition of primitives the engine falls back to."""

from __future__ import annotations

FUSED_OPERATIONS = frozenset({"fuse_linears", "add_rms_norm", "norm_rope", "decoder_layer", "decoder_stack"})
# hide these for the per-op path (a call per kernel, the fused projections and per-row kernels kept)
ONE_CALL_LAYERS = frozenset({"decoder_layer", "decoder_stack"})


class PrimitivesOnly:
    """Delegates to `inner`, hiding its fused operations (or only those named in `hide`): the engine
    then keeps each linear apart and composes the per-row ones from primitives. With
    hide=ONE_CALL_LAYERS it is the per-op path a layer took before one native call ran it."""

    def __init__(self, inner, hide=FUSED_OPERATIONS):
        self.inner = inner
        self.name = inner.name
        self.hidden = frozenset(hide)

    def __getattr__(self, attr):
        if attr in self.__dict__.get("hidden", FUSED_OPERATIONS) or attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)
