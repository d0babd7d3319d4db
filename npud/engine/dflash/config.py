"""A DFlash draft's configuration: its config.json read, validated and checked against the base."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from npud.engine.api import ConfigError, is_int, is_number
from npud.engine.config import ModelConfig, parse_config
from npud.engine.drafters import DraftMismatchError


class Variant(enum.Enum):
    DFLASH = "DFlashDraftModel"
    DFLASH2 = "DFlash2DraftModel"


_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The base layers a draft taps when its config does not say: the reference's spread from
    layer 1 to layer num_target_layers - 3 (the middle layer for a one-layer draft)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    # Python's round (half to even), as the reference computes it
    return tuple(round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(slots=True, frozen=True)
class DFlashConfig:
    """A DFlash draft: its decoder layers (`model`, a Qwen3 config) and what dflash_config adds."""

    model: ModelConfig
    variant: Variant
    target_layer_ids: tuple[int, ...]
    block_size: int  # rows per drafted block: the last token and block_size - 1 masks
    mask_token_id: int
    causal: tuple[bool, ...]  # per draft layer; DFlash attention is bidirectional by default
    num_target_layers: int | None = None  # the base's depth the draft was built for, when given
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, value, why: str) -> ConfigError:
            return ConfigError(f"DFlashConfig.{field} = {value!r}: {why}")

        if not self.target_layer_ids or not all(is_int(i) and i >= 0 for i in self.target_layer_ids):
            raise bad("target_layer_ids", self.target_layer_ids, "must be a non-empty list of layer ids >= 0")
        if not (is_int(self.block_size) and self.block_size >= 2):
            raise bad("block_size", self.block_size, "must be an int >= 2 (one row for the last token, one to draft)")
        if not (is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.model.vocab_size):
            raise bad("mask_token_id", self.mask_token_id, f"must be a token id below vocab_size {self.model.vocab_size}")
        if len(self.causal) != self.model.num_layers:
            raise bad("causal", self.causal, f"needs one entry per draft layer ({self.model.num_layers})")
        for spec, causal in zip(self.model.layers, self.causal):
            if spec.window and not causal:
                # the reference's mask is then two-sided, which the attention kernel does not take
                raise bad("causal", self.causal, f"layer {spec.index}: a bidirectional sliding window is not supported")
        if self.num_target_layers is not None and not (is_int(self.num_target_layers) and self.num_target_layers >= 1):
            raise bad("num_target_layers", self.num_target_layers, "must be an int >= 1")
        for field in ("input_embedding_scale", "output_multiplier"):
            if not is_number(getattr(self, field)):
                raise bad(field, getattr(self, field), "must be a finite number")
        if self.final_logit_softcapping is not None and not is_number(self.final_logit_softcapping):
            raise bad("final_logit_softcapping", self.final_logit_softcapping, "must be a finite number or null")
        if self.variant is Variant.DFLASH2:
            for field in _DFLASH2_FIELDS:
                if not (is_int(getattr(self, field)) and getattr(self, field) >= 1):
                    raise bad(field, getattr(self, field), "must be an int >= 1 for a DFlash 2 draft")
            if self.model.hidden_size % self.conv_group_size:
                raise bad("conv_group_size", self.conv_group_size, f"must divide hidden_size {self.model.hidden_size}")
            if self.selector_top_k > self.model.vocab_size:
                raise bad("selector_top_k", self.selector_top_k, f"exceeds vocab_size {self.model.vocab_size}")

    @property
    def conv_groups(self) -> int:
        return self.model.hidden_size // self.conv_group_size

    def describe(self) -> dict:
        return {
            "variant": self.variant.value,
            "layers": self.model.num_layers,
            "hidden_size": self.model.hidden_size,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
        }


def parse_dflash_config(raw: dict, source: str = "config.json") -> DFlashConfig:
    """Returns the DFlashConfig of a draft's config.json dict; raises ConfigError.

    A field is read from `dflash_config` first and from the top level second, as the reference
    does; missing ones get its defaults (block_size 16, scales 1, target layers spread over
    `num_target_layers`). DFlash 2 is named by `architectures`, or else by its fields.
    """
    model = parse_config(raw, source=source)
    extra = raw.get("dflash_config", {})
    if not isinstance(extra, dict):
        raise ConfigError(f"{source}: dflash_config = {extra!r}: must be an object")

    def value(name: str, default=None):
        return extra[name] if name in extra else raw.get(name, default)

    architectures = raw.get("architectures") or []
    if Variant.DFLASH2.value in architectures:
        variant = Variant.DFLASH2
    elif Variant.DFLASH.value in architectures:
        variant = Variant.DFLASH
    else:
        variant = Variant.DFLASH2 if any(value(f) is not None for f in _DFLASH2_FIELDS) else Variant.DFLASH
    num_target_layers = raw.get("num_target_layers")
    ids = value("target_layer_ids")
    if ids is None:
        if not (is_int(num_target_layers) and num_target_layers >= 1):
            raise ConfigError(
                f"{source}: dflash_config.target_layer_ids is missing, and num_target_layers "
                f"({num_target_layers!r}) cannot stand in for it"
            )
        ids = build_target_layer_ids(num_target_layers, model.num_layers)
    if not isinstance(ids, list | tuple):
        raise ConfigError(f"{source}: dflash_config.target_layer_ids = {ids!r}: must be a list")
    mask = value("mask_token_id")
    if mask is None:
        raise ConfigError(f"{source}: dflash_config.mask_token_id is missing")

    # the reference makes a layer causal when is_causal says so, else when it is a sliding one
    is_causal = raw.get("is_causal")
    types = raw.get("layer_types")
    if is_causal is not None:
        causal = (bool(is_causal),) * model.num_layers
    elif isinstance(types, list) and len(types) == model.num_layers:
        causal = tuple(t == "sliding_attention" for t in types)
    else:
        causal = tuple(bool(spec.window) for spec in model.layers)
    fields = {f: value(f) for f in _DFLASH2_FIELDS} if variant is Variant.DFLASH2 else {}
    return DFlashConfig(
        model=model,
        variant=variant,
        target_layer_ids=tuple(ids),
        block_size=value("block_size", 16),
        mask_token_id=mask,
        causal=causal,
        num_target_layers=num_target_layers,
        input_embedding_scale=value("input_embedding_scale", 1.0),
        output_multiplier=value("output_multiplier", 1.0),
        final_logit_softcapping=value("final_logit_softcapping"),
        **fields,
    )


def load_dflash_config(draft_dir) -> DFlashConfig:
    """Returns the DFlashConfig of a draft checkpoint directory; raises ConfigError."""
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    return parse_dflash_config(raw, source=str(path))


def check_against_base(cfg: DFlashConfig, base: ModelConfig) -> None:
    """Raises DraftMismatchError unless the draft can read this base's taps and share its
    embedding and LM head."""
    d = cfg.model
    why = "the draft fuses the base's layer outputs and drafts through the base's embedding and LM head"
    if d.hidden_size != base.hidden_size:
        raise DraftMismatchError(f"the DFlash draft's hidden_size is {d.hidden_size}, the base's {base.hidden_size}: {why}")
    if d.vocab_size != base.vocab_size:
        raise DraftMismatchError(f"the DFlash draft's vocab_size is {d.vocab_size}, the base's {base.vocab_size}: {why}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != base.num_layers:
        raise DraftMismatchError(
            f"the DFlash draft was built for a base of {cfg.num_target_layers} layers, this base has {base.num_layers}"
        )
    for i in cfg.target_layer_ids:
        if i >= base.num_layers:
            raise DraftMismatchError(
                f"the DFlash draft taps base layer {i}, but the base has {base.num_layers} layers (0..{base.num_layers - 1})"
            )
