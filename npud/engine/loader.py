"""The engine's factory: how the daemon gets a real model, beside the implementation it builds.

Standard library only at import time, like npud/engine/api.py: the daemon imports this module and
npud.engine.api, nothing else of the engine. Each function imports the engine proper (numpy, numba,
the kernels) when it is called, so a daemon that has not loaded a model yet (or
`npud --check-config`) never pays for it; and npud/engine/api.py, which holds types and protocols
only, imports nothing of the engine back.
"""

from __future__ import annotations

from pathlib import Path

from npud.engine.api import DEFAULT_CACHE_USERS, Grammar, LoadProgressCallback, ServedModel


def load_model(name: str, checkpoint_dir: str | Path, *, draft_dir: str | Path | None = None,
               dflash_dir: str | Path | None = None, weight_format: str = "bf16",
               cache_dir: str | Path | None = None, backend: str = "auto",
               xrt_design: str | Path | None = None, assistant_dir: str | Path | None = None,
               xrt_timeout_ms: int | None = None, cache_users: int = DEFAULT_CACHE_USERS,
               context_length: int | None = None, threads: int | None = None,
               chat_template: str | None = None, progress: LoadProgressCallback | None = None) -> ServedModel:
    """Load a model from a checkpoint directory (with an optional draft model, DFlash drafter
    and Gemma 4 assistant), its prefix cache persistent under `cache_dir` when given, on `backend` ("auto",
    "host" or "xrt"; `xrt_timeout_ms` bounds each NPU run, None for the backend's default).
    The prefix cache's budgets are split into a share for the shared scope and one for each
    of `cache_users` users, so no user's entries are evicted by another's (0: one budget for
    all, for a daemon only one user talks to). `context_length` caps the positions a request
    may use (prompt plus generated; clamped to the checkpoint's, None for the checkpoint's);
    `threads` is the host threads of the model's rounds (None: NPUD_HOST_THREADS, else the
    CPUs; the bits do not depend on it). `chat_template` is a Jinja file or the name of one of
    BUILTIN_CHAT_TEMPLATES, used in place of the checkpoint's (None: the checkpoint's, else the
    built-in its vocabulary's turn markers name). `progress` hears each stage of the load
    (npud.engine.api.LoadProgress), called in this thread.
    Blocking. Raises ModelError (or another EngineError) for files that are
    not what they claim, OSError for files that cannot be read."""
    # Imported here, not at the top: the engine proper pulls in numpy and numba, which a
    # daemon that has not loaded a model yet (or `npud --check-config`) does not need.
    from npud.engine.session import LoadedModel, reporting

    with reporting(progress):
        return LoadedModel.load(name, checkpoint_dir, draft_dir=draft_dir, dflash_dir=dflash_dir,
                                weight_format=weight_format, cache_dir=cache_dir, backend=backend,
                                xrt_design=xrt_design, assistant_dir=assistant_dir,
                                xrt_timeout_ms=xrt_timeout_ms, cache_scopes=cache_users,
                                context_length=context_length, threads=threads, chat_template=chat_template)


def describe_checkpoint(path: str | Path) -> dict:
    """What a checkpoint is without loading its weights: a .gguf file from its header
    (architecture, model_type, quant_mix, parameters, file_bytes, context_length), a checkpoint
    directory from its config.json, tokenizer and safetensors headers (format, model_type,
    tensors, parameters, file_bytes, context_length); standard types only. Blocking. Raises
    ValueError (the engine's ConfigError / WeightsError / TokenizerError) naming an unsupported
    architecture, a bad file or a tensor of a type npud cannot run, so `npud --check-config`
    fails there."""
    from npud.engine.session import describe_checkpoint as describe  # the engine proper, only when asked

    return describe(path)


def cache_dir() -> Path:
    """npud's cache directory in use (compiled kernels, tokenizers and packed weights built from
    GGUF files, packaged models): npud/kernels/cachedir.py's rule, the one place it is written."""
    return cache_status().path


def cache_status():
    """npud's cache directory and whether it passed its trust check (npud.kernels.cachedir's
    CacheState: `configured`, `path` in use, `trusted`, `refused` (why not), `to_wire()`)."""
    import npud.kernels.cachedir as cachedir  # standard library only

    return cachedir.cache_state()


def directory_unsafe_reason(directory: Path, *, closed_to_others: bool = False) -> str | None:
    """Why `directory` is not this user's own (None when it is): npud/kernels/cachedir.py's rule
    (owned by this user, writable by nobody else; with `closed_to_others`, not even readable),
    which the cache and the socket's fallback directory share."""
    import npud.kernels.cachedir as cachedir  # standard library only

    forbidden = cachedir.NOT_OTHERS_AT_ALL if closed_to_others else cachedir.NOT_OTHERS_WRITABLE
    return cachedir.unsafe_reason(directory, forbidden)


def check_grammar(grammar: Grammar) -> None:
    """Raise ConfigError saying what is wrong when `grammar` does not compile (an invalid JSON
    schema, regex or Lark grammar); needs no model."""
    from npud.engine.session import check_grammar as check  # the engine proper (llguidance), only when asked

    check(grammar)
