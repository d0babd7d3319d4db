"""Loading and unloading models on request, and unloading them when idle (keep-alive).

`models.load` loads a model ahead of its first job, as a job would (outside a ticket, between
two engine calls, as `cache.pin` loads one); `models.unload` drops one that no job is using.
Every model has a keep-alive: how long it stays loaded once no job uses it (the entry's
`keep_alive_s`, negative for "until memory is needed"; a request's `keep_alive`, Ollama's
field, replaces it for that model from then on). A task here checks every second and unloads
the models whose keep-alive ran out, then hands the freed heap back to the kernel.
"""

from __future__ import annotations

import gc
import re
from typing import TYPE_CHECKING

import structlog
import trio

from npud.engine.api import ServedModel
from npud.memtrim import _malloc_trim
from npud.protocol import ApiError, ErrorCode, Params

if TYPE_CHECKING:
    from npud.device_owner import DeviceOwner
    from npud.jobs import JobManager
    from npud.registry import ModelRegistry
    from npud.tickets import TicketQueue

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 1.0
MAX_KEEP_ALIVE_S = 10 * 365 * 86400.0
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?")


def parse_keep_alive(p: Params, name: str = "keep_alive") -> float | None:
    """A request's keep_alive in seconds (None when absent): a number of seconds, or Ollama's
    duration string ("5m", "1h30m", "90s", "0"); negative means "until memory is needed"."""
    value = p.raw(name)
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            m = _DURATION.fullmatch(text[1:] if text.startswith("-") else text)
            if not text or m is None or not any(m.groups()):
                raise p.bad(name, f"expected seconds or a duration such as \"5m\" or \"1h30m\", got {value!r}"[:160])
            h, mi, se = (float(g or 0) for g in m.groups())
            seconds = (-1 if text.startswith("-") else 1) * (3600 * h + 60 * mi + se)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise p.bad(name, f"expected seconds or a duration string, got {type(value).__name__}")
    if seconds != seconds or seconds > MAX_KEEP_ALIVE_S:  # NaN, or beyond any use
        raise p.bad(name, f"at most {MAX_KEEP_ALIVE_S:.0f} seconds (negative: until memory is needed)")
    return -1.0 if seconds < 0 else seconds


class Lifecycle:
    def __init__(self, registry: "ModelRegistry", owner: "DeviceOwner", jobs: "JobManager",
                 queue: "TicketQueue") -> None:
        self.registry = registry
        self.owner = owner
        self.jobs = jobs
        self.queue = queue
        self._trim = _malloc_trim()

    def in_use(self) -> set[str]:
        """Models of unfinished jobs (queued or running): never unloaded for idleness or on request."""
        return {job.spec.model for job in self.jobs.active.values()} | self.owner.models_in_use()

    async def load(self, name: str | None, keep_alive_s: float | None = None) -> ServedModel:
        """The loaded model `name`, loaded now if it is not; raises not_found, model_error,
        device_quarantined (a load while the device is quarantined)."""
        if name is None:
            raise ApiError(ErrorCode.NOT_FOUND, "no model is configured")
        registry = self.registry
        registry.entry(name)
        served = registry.resident(name)
        if served is None:
            if self.queue.quarantine is not None:
                raise ApiError(ErrorCode.DEVICE_QUARANTINED, f"model {name!r} is not loaded and the device is "
                                                             "quarantined; an operator clears it first")
            served = await self.owner.engine_call(registry.get, name, keep=self.in_use())
        registry.touch(name, keep_alive_s)
        return served

    async def unload(self, name: str) -> bool:
        """Unload `name`; False when it was not loaded. Raises model_in_use while a job uses it."""
        self.registry.entry(name)
        if name in self.in_use():
            raise ApiError(ErrorCode.MODEL_IN_USE, f"model {name!r} is in use by a queued or running job; "
                                         "unload it when that job has ended")
        async with self.owner.device_lock:  # between two engine calls; a job that comes now loads it again
            if name in self.in_use():
                raise ApiError(ErrorCode.MODEL_IN_USE, f"model {name!r} is in use by a queued or running job")
            unloaded = self.registry.unload(name, "request")
        if unloaded:
            self._give_back()
        return unloaded

    def _give_back(self) -> None:
        """Free the unloaded model now and return the heap to the kernel, so the daemon's RSS
        shows the unload: a loaded model holds reference cycles, which only the cycle collector
        frees (whenever it next runs, without this)."""
        gc.collect()
        if self._trim is not None:
            self._trim(0)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Unload idle models whose keep-alive ran out, checking every CHECK_INTERVAL_S."""
        task_status.started()
        while True:
            await trio.sleep(CHECK_INTERVAL_S)
            if not self.registry.idle_expired(self.in_use()):
                continue
            async with self.owner.device_lock:  # decided again under the lock: a job may have come meanwhile
                unloaded = [n for n in self.registry.idle_expired(self.in_use()) if self.registry.unload(n, "idle")]
            if unloaded:
                self._give_back()
