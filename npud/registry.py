"""The configured models and which of them are loaded: a model loads on first use inside a
ticket (or on `models.load`) and stays resident while memory allows, the least recently used
going first, or until it has been idle for its keep-alive (npud/lifecycle.py unloads it).
Each model is in one ModelState: unloaded, loading, loaded, or failed (its last load failed).

`get` loads a model and is blocking: only the device owner calls it, in a worker thread.
Models come from a `ModelLoader` (npud.engine.loader.load_model; tests pass a fake engine's).
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
import structlog

from npud.engine.api import DEFAULT_CACHE_USERS, EngineError, LoadProgress, ModelLoader, ServedModel
from npud.engine.loader import load_model
from npud.config import ModelEntry
from npud.protocol import ApiError, ErrorCode

log = structlog.get_logger(__name__)


def estimate_bytes(entry: ModelEntry) -> int:
    """What a model will take once loaded, before loading it: the size of its weight files."""
    total = 0
    for d in (entry.checkpoint_dir, entry.draft_dir, entry.dflash_dir, entry.assistant_dir):
        if d is not None and Path(d).is_file():  # a single-file checkpoint (.gguf)
            total += Path(d).stat().st_size
        elif d is not None:
            total += sum(p.stat().st_size for p in Path(d).glob("*.safetensors") if p.is_file())
    return total


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"  # its last load failed (the log has why); the next use tries again


class ModelRegistry:
    def __init__(self, models: tuple[ModelEntry, ...], *, max_resident_bytes: int, cache_root: Path | None = None,
                 loader: ModelLoader = load_model, backend: str = "auto", xrt_design: str | None = None,
                 xrt_timeout_ms: int | None = None, cache_users: int = DEFAULT_CACHE_USERS) -> None:
        self._entries = {m.name: m for m in models}
        # name -> why its last load failed: in words clients may see (`models`, /v1/models; no
        # path, no exception text), and in full (the log, npud's own stderr)
        self.load_errors: dict[str, str] = {}
        self.load_details: dict[str, str] = {}
        self.cache_users = cache_users  # the prefix cache's per-user budget shares (npud.engine.loader.load_model)
        self.cache_root = cache_root  # prefix caches persist under cache_root/<model>; None: memory only
        self.backend = backend
        self.xrt_design = xrt_design
        self.xrt_timeout_ms = xrt_timeout_ms
        self._loader = loader
        self.max_resident_bytes = max_resident_bytes
        self._resident: collections.OrderedDict[str, ServedModel] = collections.OrderedDict()
        self._loading: str | None = None  # the model a worker thread is loading
        self._progress: ProgressRelay | None = None  # how far that load is
        self._failed: set[str] = set()
        self.clock = time.monotonic
        self._last_used: dict[str, float] = {}  # when a job or a load last used the model
        self._keep_alive: dict[str, float] = {}  # a request's keep_alive_s, over the entry's
        # told of each model that loads (in the loading thread): the daemon claims its NPU worker
        self.on_loaded: Callable[[ServedModel], None] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entry(self, name: str) -> ModelEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise ApiError(ErrorCode.NOT_FOUND, f"no model {name!r}; models: {list(self._entries)}") from None

    def resident(self, name: str) -> ServedModel | None:
        return self._resident.get(name)

    def budget(self) -> int:
        return self.max_resident_bytes or psutil.virtual_memory().total // 2

    def get(self, name: str, *, keep: Iterable[str] = (),
            progress: Callable[[dict], None] | None = None) -> ServedModel:
        """The loaded model `name`, loading it (and unloading others) if needed. Blocking.
        A load's progress is logged (model_load_progress), shown by `describe` and, when
        `progress` is given, told to it (in this thread) as {"model", "stage", "done", "total"}.

        Raises not_found for an unknown name and model_error when its files do not load.
        """
        served = self._resident.get(name)
        if served is not None:
            self._resident.move_to_end(name)
            return served
        entry = self.entry(name)
        keep = set(keep)
        self._evict(estimate_bytes(entry), keep)
        started = time.perf_counter()
        # only what the entry sets is passed: a loader older than the setting still loads the rest
        tuning = {k: v for k, v in (("context_length", entry.context_length), ("threads", entry.threads)) if v}
        self._loading = name
        # a large file can take a while: the log says the load began (model_loaded says when it ends)
        log.info("model_load_started", model=name, checkpoint_dir=entry.checkpoint_dir)
        relay = ProgressRelay(name, progress)
        self._progress = relay
        try:
            served = self._loader(
                entry.name, entry.checkpoint_dir, draft_dir=entry.draft_dir, dflash_dir=entry.dflash_dir,
                weight_format=entry.weight_format,
                cache_dir=None if self.cache_root is None else self.cache_root / entry.name,
                backend=self.backend, xrt_design=self.xrt_design, assistant_dir=entry.assistant_dir,
                xrt_timeout_ms=self.xrt_timeout_ms, cache_users=self.cache_users, chat_template=entry.chat_template,
                progress=relay, **tuning)
        except (EngineError, OSError) as exc:  # ConfigError, WeightsError, TokenizerError, missing files
            self._failed.add(name)
            log.error("model_load_failed", model=name, checkpoint_dir=entry.checkpoint_dir,
                      error=f"{type(exc).__name__}: {exc}")
            self.load_errors[name] = load_error(exc)
            self.load_details[name] = f"{type(exc).__name__}: {exc}"  # for npud's own output, never a reply
            raise ApiError(ErrorCode.MODEL_ERROR, f"model {name!r} does not load: {self.load_errors[name]}; "
                                                  "the daemon log says why (model_load_failed)") from None
        finally:
            self._loading, self._progress = None, None
        self._failed.discard(name)
        self._last_used[name] = self.clock()
        self.load_errors.pop(name, None)
        self.load_details.pop(name, None)
        self._resident[name] = served
        if self.on_loaded is not None:
            self.on_loaded(served)
        log.info("model_loaded", model=name, nbytes=served.nbytes,
                 load_ms=round((time.perf_counter() - started) * 1000, 1))
        self._evict(0, keep | {name})
        return served

    def _evict(self, incoming: int, keep: set[str]) -> None:
        budget = self.budget()
        while sum(m.nbytes for m in self._resident.values()) + incoming > budget:
            victim = next((n for n in self._resident if n not in keep), None)
            if victim is None:
                log.warning("model_memory_over_budget", budget=budget, resident=list(self._resident))
                return
            self.unload(victim)

    def unload_all(self) -> None:
        """Unload every resident model (the backend they were loaded for is gone or changed)."""
        for name in list(self._resident):
            self.unload(name, "backend")

    def unload(self, name: str, reason: str = "memory") -> bool:
        """Forget the loaded model `name` (its memory goes with the last reference); returns
        whether it was loaded. `reason` is logged: memory, idle, request, reload."""
        if self._resident.pop(name, None) is None:
            return False
        log.info("model_unloaded", model=name, reason=reason)
        return True

    def state(self, name: str) -> ModelState:
        if name in self._resident:
            return ModelState.LOADED
        if self._loading == name:
            return ModelState.LOADING
        return ModelState.FAILED if name in self._failed else ModelState.UNLOADED

    def loading_progress(self, name: str) -> dict | None:
        """How far the load of `name` is ({"stage", "done", "total"}), None when it is not loading."""
        relay = self._progress
        return relay.last if relay is not None and relay.model == name and self._loading == name else None

    def keep_alive_s(self, name: str) -> float:
        """Seconds `name` stays loaded once idle (negative: until evicted or unloaded)."""
        if name in self._keep_alive:
            return self._keep_alive[name]
        entry = self._entries.get(name)
        return -1.0 if entry is None else entry.keep_alive_s

    def touch(self, name: str, keep_alive_s: float | None = None) -> None:
        """`name` was used now; a request's `keep_alive_s` replaces the model's from now on."""
        self._last_used[name] = self.clock()
        if keep_alive_s is not None:
            self._keep_alive[name] = keep_alive_s

    def idle_unload_at(self, name: str) -> float | None:
        """When (on `clock`) the loaded model `name` is unloaded if nothing uses it before; None: never."""
        keep = self.keep_alive_s(name)
        if name not in self._resident or keep < 0:
            return None
        return self._last_used.get(name, self.clock()) + keep

    def idle_expired(self, in_use: set[str]) -> list[str]:
        """Loaded models past their keep-alive; those `in_use` are touched instead (a model's
        idle time starts when its last job ends)."""
        now = self.clock()
        for name in in_use:
            if name in self._resident:
                self._last_used[name] = now
        return [n for n in self._resident if n not in in_use and (at := self.idle_unload_at(n)) is not None
                and now >= at]

    def flush_caches(self) -> int:
        """Write the resident models' in-memory prefix-cache entries to disk (blocking); returns how many."""
        return sum(served.cache_flush() for served in self._resident.values())

    def reconfigure(self, models: tuple[ModelEntry, ...], max_resident_bytes: int, *, keep: Iterable[str]) -> None:
        """New model list (SIGHUP): a model whose entry changed or vanished is unloaded unless in use."""
        keep = set(keep)
        new = {m.name: m for m in models}
        for name in list(self._resident):
            if new.get(name) != self._entries.get(name) and name not in keep:
                self.unload(name, "reload")
        self.load_errors = {n: e for n, e in self.load_errors.items() if new.get(n) == self._entries.get(n)}
        self.load_details = {n: e for n, e in self.load_details.items() if n in self.load_errors}
        self._entries = new
        self.max_resident_bytes = max_resident_bytes

    def describe(self) -> list[dict]:
        out = []
        now = self.clock()
        for name, entry in self._entries.items():
            served = self._resident.get(name)
            unload_at = self.idle_unload_at(name)
            keep = self.keep_alive_s(name)
            described = None if served is None else served.describe()
            out.append({
                "state": self.state(name).value,
                # bytes resident once loaded (weights of base and drafters); the files' size before
                "memory_bytes": served.nbytes if served is not None else None,
                "estimated_bytes": estimate_bytes(entry) if served is None else None,
                "keep_alive_s": None if keep < 0 else keep,
                "idle_unload_in_s": None if unload_at is None else round(max(0.0, unload_at - now), 1),
                "name": name, "checkpoint_dir": entry.checkpoint_dir, "draft_dir": entry.draft_dir,
                "dflash_dir": entry.dflash_dir, "assistant_dir": entry.assistant_dir,
                "weight_format": weight_format(entry, described), "resident": served is not None,
                "nbytes": None if served is None else served.nbytes,
                "max_context": None if served is None else served.max_context,
                # null until the model is loaded (a job or `npuctl models load` loads it)
                "context_length": None if served is None else served.max_context,
                "fim": None if served is None else served.fim,
                # while loading: {"stage", "done", "total"} of the load (npud.engine.api.LOAD_STAGES)
                "loading": self.loading_progress(name),
                "describe": described,
                "load_error": self.load_errors.get(name),
            })
        return out


class ProgressRelay:
    """The engine's LoadProgress callback for one load (called in the loading thread): keeps the
    last report for `describe`, logs `model_load_progress` at each new stage and at most every
    LOG_EVERY_S within one, and tells `forward` at each new stage, at a stage's end and at most
    every FORWARD_EVERY_S within one."""

    LOG_EVERY_S = 1.0
    FORWARD_EVERY_S = 0.2

    def __init__(self, model: str, forward: Callable[[dict], None] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.forward = forward
        self.clock = clock
        self.last: dict | None = None
        self._logged = self._forwarded = float("-inf")

    def __call__(self, progress: LoadProgress) -> None:
        now = self.clock()
        new_stage = self.last is None or self.last["stage"] != progress.stage
        report = {"stage": progress.stage, "done": progress.done, "total": progress.total}
        self.last = report
        if new_stage or now - self._logged >= self.LOG_EVERY_S:
            self._logged = now
            log.info("model_load_progress", model=self.model, **report)
        if self.forward is not None and (new_stage or progress.done == progress.total
                                         or now - self._forwarded >= self.FORWARD_EVERY_S):
            self._forwarded = now
            try:
                self.forward({"model": self.model, **report})
            except Exception:  # a listener's bug must not fail the load
                log.exception("model_load_progress_listener_failed", model=self.model)


# what a failed load's exception says about the model, in words with no path and no exception text
_LOAD_ERRORS = {
    "ConfigError": "its config.json is not one npud can run",
    "TokenizerError": "its tokenizer does not load",
    "WeightsError": "its weights do not load",
    "DraftMismatchError": "its draft model does not fit it",
    "AssistantMismatchError": "its assistant does not fit it",
    "FileNotFoundError": "a file of it is missing",
    "PermissionError": "a file of it cannot be read (permission denied)",
}


def load_error(exc: BaseException) -> str:
    """Why a load failed, as clients may read it (the operator's log has the exception)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _LOAD_ERRORS:
            return _LOAD_ERRORS[cls.__name__]
    return "its files do not load" if isinstance(exc, (EngineError, OSError)) else "it does not load"


def weight_format(entry: ModelEntry, described: dict | None) -> str:
    """How a model's weights are stored: a GGUF file's own block types ("gguf: Q4_K 27, Q6_K 9, ..."
    once loaded, "gguf" before; "gguf-q8" when that format multiplies them), else the configured
    weight_format (a GGUF's blocks are kept as they are under any other setting)."""
    if not entry.checkpoint_dir.lower().endswith(".gguf"):
        return entry.weight_format
    label = "gguf-q8" if entry.weight_format == "gguf-q8" else "gguf"  # gguf-q8: against q8 activation rows
    mix = ((described or {}).get("checkpoint") or {}).get("quant_mix")
    return f"{label}: " + ", ".join(f"{kind} {count}" for kind, count in mix.items()) if mix else label
