"""A prepared weights tree as data: JSON nodes over a closed list of kinds, arrays by index.

The packed-weights cache (npud/engine/gguf/packed_cache.py) keeps a model's prepared weights
between starts. What it reads back is data that this module turns into objects itself: the
weights dataclasses and the two weight-format enums named in KINDS and ENUMS, lists, tuples,
None, bools, ints, floats, strings and array references. Nothing in a file names code, so a
file cannot make the reader run any (what a pickle could: issue 39), and every field of every
object is checked against its dataclass's declared type, so a tree of the wrong shape is
refused here (TreeError) instead of failing later inside the forward.

Nodes:
  null, true/false, numbers, strings          themselves
  [node, ...]                                 a list
  {"tuple": [node, ...]}                      a tuple
  {"array": i}                                the i-th array of the caller's table
  {"enum": "BlockFormat", "value": "q4_k"}    a member of one of ENUMS
  {"kind": "LinearWeight", "id": n,           a dataclass of KINDS, built from its init fields
   "fields": {"name": node, ...}}             (a derived field, such as FusedLinear._columns, is
                                              not written: __post_init__ makes it again)
  {"ref": n}                                  the object of "id" n again (a tied head, a fused
                                              projection's parts): one object, as built
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing

import numpy as np

from npud.engine.weights.layout import (AttentionWeights, LayerWeights, LinearAttentionWeights, MlpWeights,
                                        ModelWeights)
from npud.kernels.base import FusedLinear, LinearWeight, WeightFormat
from npud.kernels.ggml.blocks import BlockFormat

KINDS: dict[str, type] = {cls.__name__: cls for cls in (
    ModelWeights, LayerWeights, AttentionWeights, MlpWeights, LinearAttentionWeights, LinearWeight, FusedLinear)}
ENUMS: dict[str, type[enum.Enum]] = {cls.__name__: cls for cls in (WeightFormat, BlockFormat)}
# LinearWeight.fmt is declared a WeightFormat and holds a GGUF BlockFormat on the block paths
_FORMATS = (WeightFormat, BlockFormat)
# what an array of a weights tree can hold: floats, integers, bytes (never objects)
DTYPE_KINDS = frozenset("fiub")


class TreeError(ValueError):
    """A tree that is not a weights tree of KINDS (the message says where and why)."""


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_"))


_FIELDS = {name: _fields(cls) for name, cls in KINDS.items()}
_HINTS = {name: typing.get_type_hints(cls) for name, cls in KINDS.items()}


def encode(tree) -> tuple[object, list[np.ndarray]]:
    """(JSON-able node, arrays) of `tree`; an array held twice is one index. Raises TypeError
    for anything outside the kinds above."""
    arrays: list[np.ndarray] = []
    array_index: dict[int, int] = {}
    object_index: dict[int, int] = {}
    keep = []  # the objects indexed by id(), alive until the end

    def node(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, np.ndarray):
            if id(x) not in array_index:
                array_index[id(x)] = len(arrays)
                arrays.append(x)
            return {"array": array_index[id(x)]}
        if isinstance(x, enum.Enum) and type(x).__name__ in ENUMS and ENUMS[type(x).__name__] is type(x):
            return {"enum": type(x).__name__, "value": x.value}
        if isinstance(x, list):
            return [node(v) for v in x]
        if isinstance(x, tuple):
            return {"tuple": [node(v) for v in x]}
        kind = type(x).__name__
        if KINDS.get(kind) is type(x):
            if id(x) in object_index:
                return {"ref": object_index[id(x)]}
            object_index[id(x)] = n = len(object_index)
            keep.append(x)
            return {"kind": kind, "id": n, "fields": {f: node(getattr(x, f)) for f in _FIELDS[kind]}}
        raise TypeError(f"a {type(x).__module__}.{type(x).__qualname__} in a weights tree")

    return node(tree), arrays


def decode(doc, arrays: list[np.ndarray]) -> ModelWeights:
    """The ModelWeights that `doc` describes over `arrays` (encode's output). Raises TreeError
    for a node of no kind above, a field missing, unknown or of the wrong type, an array index
    or object reference that does not exist, or a root that is not a ModelWeights."""
    objects: dict[int, object] = {}

    def node(x, where: str):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [node(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if not isinstance(x, dict):
            raise TreeError(f"{where}: a {type(x).__name__} node")
        keys = set(x)
        if keys == {"array"}:
            i = x["array"]
            if type(i) is not int or not 0 <= i < len(arrays):
                raise TreeError(f"{where}: array {i!r} is not in the table")
            return arrays[i]
        if keys == {"tuple"} and isinstance(x["tuple"], list):
            return tuple(node(v, f"{where}[{i}]") for i, v in enumerate(x["tuple"]))
        if keys == {"enum", "value"} and x["enum"] in ENUMS:
            try:
                return ENUMS[x["enum"]](x["value"])
            except ValueError:
                raise TreeError(f"{where}: {x['value']!r} is no {x['enum']}") from None
        if keys == {"ref"}:
            if type(x["ref"]) is not int or x["ref"] not in objects:
                raise TreeError(f"{where}: reference {x['ref']!r} to no object before it")
            return objects[x["ref"]]
        if keys == {"kind", "id", "fields"} and x["kind"] in KINDS and isinstance(x["fields"], dict):
            kind, n = x["kind"], x["id"]
            if type(n) is not int or n in objects:
                raise TreeError(f"{where}: object id {n!r} is not new")
            if set(x["fields"]) != set(_FIELDS[kind]):
                raise TreeError(f"{where}: a {kind} with fields {sorted(x['fields'])}, not {sorted(_FIELDS[kind])}")
            values = {}
            for f in _FIELDS[kind]:
                v = node(x["fields"][f], f"{where}.{f}")
                if not _conforms(v, _HINTS[kind][f]):
                    raise TreeError(f"{where}.{f}: a {type(v).__name__} where a {kind} holds {_HINTS[kind][f]}")
                values[f] = v
            try:
                obj = KINDS[kind](**values)
            except (TypeError, ValueError, IndexError) as exc:  # __post_init__'s own checks
                raise TreeError(f"{where}: {kind}: {exc}") from None
            objects[n] = obj
            return obj
        raise TreeError(f"{where}: a node of no known kind (keys {sorted(keys)})")

    tree = node(doc, "weights")
    if not isinstance(tree, ModelWeights):
        raise TreeError(f"the root is a {type(tree).__name__}, not a ModelWeights")
    return tree


def _conforms(value, hint) -> bool:
    """Whether `value` is of the declared type `hint` (the forms the weights dataclasses use)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(args) == len(value) and all(_conforms(v, a) for v, a in zip(value, args))
    if hint is np.ndarray:
        return isinstance(value, np.ndarray) and value.dtype.kind in DTYPE_KINDS
    if hint is WeightFormat:
        return isinstance(value, _FORMATS)
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if isinstance(hint, type):
        return type(value) is hint
    raise TypeError(f"a weights field declared {hint!r}: teach _conforms its form")
