"""The daemon's parts wired together, and its lifetime: start, serve, reload, drain, stop.

Nurseries by lifetime: the daemon's nursery holds the guards, the retention task, the device
owner and the server (which holds one nursery for connections, which hold their requests).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import structlog
import trio

from npud import __version__
from npud.api import Api
from npud.config import ConfigError, DaemonConfig, diff_for_reload, load_config
from npud.device import discover
from npud.guards import ErrorCountGuard, ThermalGuard
from npud.jobs import JobManager
from npud.logsetup import setup_logging
from npud.registry import ModelRegistry
from npud.server import Server
from npud.store import Store
from npud.tickets import TicketQueue
from npud.worker import DeviceOwner

log = structlog.get_logger(__name__)


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about a state change; nothing without $NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify_failed", state=state, error=exc.strerror)


class Daemon:
    """One running npud. `engine` replaces the configured session module (tests inject fakes)."""

    def __init__(self, cfg: DaemonConfig, *, config_path: Path | None = None,
                 overrides: Callable[[DaemonConfig], DaemonConfig] = lambda c: c,
                 engine: ModuleType | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.started_mono = time.monotonic()
        self.device = discover(cfg.device)
        self.store = Store.open(cfg.store.state_dir)
        self.queue = TicketQueue(cfg.scheduler.quantum_tokens, cfg.scheduler.quantum_ms,
                                 first_id=self.store.max_ticket_id() + 1)
        self.thermal = ThermalGuard(cfg.thermal, self.queue)
        self.errors = ErrorCountGuard(cfg.errors)
        self.registry = ModelRegistry(
            cfg.models, engine_module=cfg.engine.module, max_resident_bytes=cfg.device.max_resident_bytes,
            cache_root=Path(cfg.store.state_dir) / "prefix-cache" if cfg.store.persist_prefix_cache else None,
            engine=engine)
        self.jobs = JobManager(cfg, self.store, self.queue)
        self.owner = DeviceOwner(cfg, self.queue, self.jobs, self.registry, self.thermal, self.errors)
        self.api = Api(self)
        self.server = Server(cfg, self.api)
        self._stop = trio.Event()

    async def run(self, *, handle_signals: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until request_stop() (or SIGTERM/SIGINT with handle_signals); then drain and return."""
        log.info("daemon_starting", version=__version__, device=self.device.kind, device_reason=self.device.reason,
                 models=list(self.registry.names), store=str(self.store.path))
        try:
            await self.owner.restore_quarantine()
            await self.jobs.recover()
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    await nursery.start(self._signals)
                await nursery.start(self.thermal.run)
                await nursery.start(self.errors.run)
                await nursery.start(self.jobs.run_retention)
                await nursery.start(self.owner.run)
                await nursery.start(self.server.serve)
                sd_notify("READY=1")
                log.info("daemon_ready", socket=self.cfg.server.socket_path)
                task_status.started(self)
                await self._stop.wait()
                await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            self.errors.close()
            self.store.close()
            log.info("daemon_stopped")

    def request_stop(self) -> None:
        self._stop.set()

    async def _drain(self) -> None:
        """SIGTERM: stop accepting, let the running round end, release the device; what was
        running stays queued in the store and resumes on the next start."""
        sd_notify("STOPPING=1")
        deadline = self.cfg.server.drain_timeout_s
        log.info("shutdown_started", drain_timeout_s=deadline, holding=None if self.owner.holding is None
                 else self.owner.holding.id)
        self.jobs.accepting = False
        self.server.stop_accepting()
        self.queue.stop()
        with trio.move_on_after(deadline) as scope:
            await self.owner.wait_idle()
        if scope.cancelled_caught:
            # the round is abandoned in its thread; the ticket is released as preempted (shutdown)
            log.warning("shutdown_deadline_passed", drain_timeout_s=deadline)
            return
        with trio.move_on_after(deadline):
            try:
                written = await self.owner.engine_call(self.registry.flush_caches)
                log.info("prefix_caches_flushed", entries=written)
            except Exception:  # a cache that cannot be written is lost, the jobs are not
                log.exception("prefix_cache_flush_failed")

    async def _signals(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    await self.reload()
                else:
                    log.info("signal_received", signal=signal.Signals(signum).name)
                    self.request_stop()

    async def reload(self) -> None:
        """SIGHUP: read the config file again and apply what can change in a running daemon."""
        if self.config_path is None:
            log.warning("config_reload_skipped", reason="no config file")
            return
        try:
            new = self.overrides(load_config(self.config_path))
        except ConfigError as exc:
            log.error("config_reload_failed", error=str(exc))
            return
        cfg, ignored = diff_for_reload(self.cfg, new)
        await self.apply(cfg)
        log.info("config_reloaded", path=str(self.config_path), ignored=ignored)

    async def apply(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        setup_logging(cfg.logging)
        self.queue.set_quantum(cfg.scheduler.quantum_tokens, cfg.scheduler.quantum_ms)
        self.thermal.cfg = cfg.thermal
        self.errors.reconfigure(cfg.errors)
        self.jobs.cfg = self.owner.cfg = self.server.cfg = cfg
        async with self.owner.device_lock:  # a load may be under way in the engine thread
            self.registry.reconfigure(cfg.models, cfg.device.max_resident_bytes, keep=self.owner.models_in_use())
