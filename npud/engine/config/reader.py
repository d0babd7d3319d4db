"""Typed field access on a raw config.json dict, and the field readers every model type shares."""

from __future__ import annotations

from typing import Any

from npud.engine.api import ConfigError, is_int, is_number


class _Reader:
    """Typed field access on a raw config dict; every error names the source and field."""

    def __init__(self, raw: dict, source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, field: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: {field} = {value!r}: {why}")

    def has(self, field: str) -> bool:
        return self.raw.get(field) is not None

    def int_(self, field: str, default: Any = ..., minimum: int = 1) -> int:
        value = self.raw.get(field)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {field!r} is missing")
            return default
        if not is_int(value):
            raise self.error(field, value, "must be an int")
        if value < minimum:
            raise self.error(field, value, f"must be >= {minimum}")
        return value

    def float_(self, field: str, default: Any = ..., positive: bool = True) -> float:
        value = self.raw.get(field)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {field!r} is missing")
            return default
        if not is_number(value):
            raise self.error(field, value, "must be a finite number")
        if positive and value <= 0:
            raise self.error(field, value, "must be > 0")
        return float(value)

    def bool_(self, field: str, default: bool) -> bool:
        value = self.raw.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, value, "must be true or false")
        return value

    def str_(self, field: str, default: Any = ...) -> str:
        value = self.raw.get(field)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {field!r} is missing")
            return default
        if not isinstance(value, str):
            raise self.error(field, value, "must be a string")
        return value

    def token_ids(self, field: str) -> list[int]:
        value = self.raw.get(field)
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not is_int(item) or item < 0:
                raise self.error(field, value, "must be a token id >= 0 or a list of them")
        return list(items)

    def optional_token_id(self, field: str) -> int | None:
        value = self.raw.get(field)
        if value is None:
            return None
        if not is_int(value) or value < 0:
            raise self.error(field, value, "must be a token id >= 0 or null")
        return value


def _rope_params(r: _Reader) -> tuple[dict, str]:
    """The RoPE parameter object and the field it came from; `{}` when the config has none.

    transformers gives a legacy `rope_scaling` priority over `rope_parameters`.
    """
    for name in ("rope_scaling", "rope_parameters"):
        if r.raw.get(name) is not None:
            params = r.raw[name]
            if not isinstance(params, dict):
                raise r.error(name, params, "must be an object")
            return params, name
    return {}, "rope_parameters"




def _special_tokens(r: _Reader, generation_config: Any) -> tuple[list[int], int | None, int | None]:
    """(eos ids, bos, pad) from config.json, then generation_config.json's dict."""
    if generation_config is not None and not isinstance(generation_config, dict):
        raise ConfigError(f"generation_config.json: must be a JSON object, got {type(generation_config).__name__}")
    g = _Reader(generation_config or {}, "generation_config.json")
    eos: list[int] = []
    for token in r.token_ids("eos_token_id") + g.token_ids("eos_token_id"):
        if token not in eos:
            eos.append(token)
    bos = r.optional_token_id("bos_token_id")
    if bos is None:
        bos = g.optional_token_id("bos_token_id")
    pad = r.optional_token_id("pad_token_id")
    if pad is None:
        pad = g.optional_token_id("pad_token_id")
    return eos, bos, pad


def _dtype(r: _Reader) -> str | None:
    # transformers 5 writes "dtype", older versions "torch_dtype"
    dtype = r.raw.get("dtype", r.raw.get("torch_dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise r.error("dtype", dtype, "must be a string")
    return dtype

