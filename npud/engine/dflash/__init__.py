"""DFlash and DFlash 2 block drafters over the base's layer taps.

A DFlash draft (Z Lab's `dflash` package is the reference this follows) is a few Qwen3-style
decoder layers that draft a whole block in one pass. Its context is not tokens but the base's
hidden rows: for every committed position the outputs of a few base layers (the taps),
concatenated, projected by `fc` and normed into one context row. Every draft layer reads keys
and values of those context rows (projected from the same fused row in each layer, so they are
computed once per position and kept in the draft's own KV cache) and of the block itself, with
no causal mask. The block is [last token, mask, ..., mask] embedded by the base, and the base's
LM head turns each drafted row into a token. DFlash 2 wraps attention and MLP of every layer in
a grouped dynamic causal convolution over the block, and picks the drafted path through the top
tokens of each row with a low-rank bigram score (the candidate selector).

`DFlashHead` serves a draft to the speculative loop: it is the base's tap sink, keeps the sink
holding exactly the committed positions' rows, folds new rows into its cache at draft time, and
takes the one-pass round (`needs_last_hidden() == False`).

The package: config.py (the draft's config.json, checked against the base), weights.py (its
tensors), cache.py (its KV cache of context rows), draft.py (the draft forward and proposer),
head.py (`DFlashHead` and the tap sink `TapRows`). The names below are its public surface.
"""

from npud.engine.dflash.cache import DraftCache
from npud.engine.dflash.config import (
    DFlashConfig,
    Variant,
    build_target_layer_ids,
    check_against_base,
    load_dflash_config,
    parse_dflash_config,
)
from npud.engine.dflash.draft import DFlashDraft, Pick
from npud.engine.dflash.head import DFlashHead, TapRows
from npud.engine.dflash.weights import DFlashWeights, load_dflash_weights

__all__ = [
    "DFlashConfig",
    "DFlashDraft",
    "DFlashHead",
    "DFlashWeights",
    "DraftCache",
    "Pick",
    "TapRows",
    "Variant",
    "build_target_layer_ids",
    "check_against_base",
    "load_dflash_config",
    "load_dflash_weights",
    "parse_dflash_config",
]
