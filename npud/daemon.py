"""The daemon's parts wired together, and its lifetime: start, serve, reload, drain, stop.

Nurseries by lifetime: the daemon's nursery holds the guards, the retention task, the device
owner and the server (which holds one nursery for connections, which hold their requests).
"""

from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import trio

from npud.engine.api import ModelLoader
from npud.engine.loader import cache_status, load_model
from npud import __version__
from npud.api import Api
from npud.config import DaemonConfigError, DaemonConfig, diff_for_reload, load_config
from npud.device import apply_power_mode, discover, gemm_site, other_holders
from npud.guards import ErrorCountGuard, ThermalGuard
from npud.http.server import HttpServer
from npud.jobs import JobManager
from npud.logsetup import setup_logging
from npud.metrics import Metrics, snapshot
from npud.protocol import ApiError, ErrorCode
from npud.registry import ModelRegistry
from npud import signals
from npud.server import Server
from npud.store import Store
from npud.systemd import report_status, run_watchdog, sd_notify, watchdog_interval
from npud.tickets import TicketQueue
from npud.device_owner import DeviceOwner

log = structlog.get_logger(__name__)


class Daemon:
    """One running npud; its models come from `loader` (the engine's; tests pass a fake engine's)."""

    def __init__(self, cfg: DaemonConfig, *, config_path: Path | None = None,
                 overrides: Callable[[DaemonConfig], DaemonConfig] = lambda c: c,
                 loader: ModelLoader = load_model) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.started_mono = time.monotonic()
        self.device = discover(cfg.device)
        # checked (and a refusal logged) now, not when the first model needs a kernel
        self.cache = cache_status()
        self.store = Store.open(cfg.store.state_dir)
        self.queue = TicketQueue(cfg.scheduler.quantum_tokens, cfg.scheduler.quantum_ms,
                                 first_id=self.store.max_ticket_id() + 1)
        self.thermal = ThermalGuard(cfg.thermal, self.queue)
        self.errors = ErrorCountGuard(cfg.errors)
        self.registry = ModelRegistry(
            cfg.models, max_resident_bytes=cfg.device.max_resident_bytes,
            cache_root=Path(cfg.store.state_dir) / "prefix-cache" if cfg.store.persist_prefix_cache else None,
            loader=loader, backend=cfg.device.backend, xrt_design=cfg.device.xrt_design or None,
            xrt_timeout_ms=cfg.device.xrt_timeout_ms, cache_users=cfg.store.prefix_cache_users)
        # an NPU worker the load started is npud's own: the driver lines that name it are npud's errors
        self.registry.on_loaded = lambda served: self.errors.claim(served.describe().get("npu_worker_pid"))
        self.jobs = JobManager(cfg, self.store, self.queue)
        self.metrics = Metrics(cfg.metrics, self.queue, lambda: self.jobs.tokens_generated,
                               owner_tokens=lambda: self.jobs.tokens_by_owner)
        self.owner = DeviceOwner(cfg, self.queue, self.jobs, self.registry, self.thermal, self.errors,
                                 self.metrics)
        self.owner.fw_version = self.device.fw_version
        self.other_holders: list[dict] = []
        self.power_mode = apply_power_mode(self.device, cfg.device.power_mode)
        self.api = Api(cfg, jobs=self.jobs, queue=self.queue, registry=self.registry, owner=self.owner,
                       device=self.device, thermal=self.thermal, errors=self.errors,
                       snapshot=self.metrics_snapshot, connections=lambda: self.server.connections,
                       started_mono=self.started_mono,
                       gemm_site=self.gemm_site, other_holders=lambda: self.other_holders,
                       cache=self.cache.to_wire(), power_mode=lambda: self.power_mode)
        self.server = Server(cfg, self.api)
        self.http = HttpServer(cfg, self.api, self.server)
        self._stop = trio.Event()
        self.announce: Callable[[str], None] | None = None  # npud's own output (main prints it to stderr)
        self.start_failed = False  # no model left to serve after the preload: main exits non-zero
        self._hurried = False
        self._drain_scope: trio.CancelScope | None = None

    async def run(self, *, handle_signals: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until request_stop() (or a stop signal with handle_signals, npud/signals.py); then drain and return."""
        site, site_why = self.gemm_site()
        log.info("daemon_starting", version=__version__, device=self.device.kind, device_reason=self.device.reason,
                 fw_version=self.device.fw_version, gemms=site, gemms_reason=site_why,
                 models=list(self.registry.names), store=str(self.store.path), cache=str(self.cache.configured),
                 cache_trusted=self.cache.trusted)
        self.check_other_holders()
        watchdog_s = watchdog_interval()
        try:
            sd_notify("STATUS=recovering queued jobs from the store")
            await self.owner.restore_quarantine()
            await self.jobs.recover()
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    await nursery.start(self._signals)
                if watchdog_s is not None:
                    await nursery.start(run_watchdog, watchdog_s)
                await nursery.start(self.thermal.run)
                await nursery.start(self.errors.run)
                await nursery.start(self.jobs.run_retention)
                await nursery.start(self.metrics.run, self.metrics_snapshot)
                await nursery.start(self.owner.run)
                await nursery.start(self.api.lifecycle.run)  # idle models unloaded after their keep-alive
                await nursery.start(self.server.serve)
                if self.cfg.http.enabled:
                    await nursery.start(self.http.serve)
                nursery.start_soon(self._preload)
                # READY=1 once clients can connect and the store is open (Type=notify)
                status = self.status_line()
                if sd_notify("READY=1", f"STATUS={status}"):  # a service manager listens: keep it told
                    await nursery.start(functools.partial(report_status, self.status_line, self.queue.wait_changed,
                                                          sent=status))
                log.info("daemon_ready", socket=self.cfg.server.socket_path, state_dir=self.cfg.store.state_dir,
                         config=None if self.config_path is None else str(self.config_path),
                         socket_activated=self.server.socket_activated, watchdog_s=watchdog_s)
                task_status.started(self)
                await self._stop.wait()
                await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            self.errors.close()
            self.thermal.close()
            self.store.close()
            self.metrics.remove_textfile()  # a stopped npud exports nothing rather than stale numbers
            log.info("daemon_stopped")

    async def _preload(self) -> None:
        """Load the models marked `preload = true` once the socket is up, so that their first
        request does not wait for the load (one that comes during it waits, told `model_loading`).
        A model that does not load is logged (model_load_failed), told to `announce` (npud's own
        output), listed with its error by `models`, and fails its requests; when no model is left
        to serve, the daemon stops and `start_failed` says so."""
        failed = 0
        for entry in self.cfg.models:
            if entry.preload and self.registry.resident(entry.name) is None:
                try:
                    await self.owner.engine_call(self.registry.get, entry.name, keep=self.owner.models_in_use())
                except ApiError as exc:
                    failed += 1
                    if self.announce is not None:
                        why = self.registry.load_details.get(entry.name, str(exc))
                        self.announce(f"model {entry.name!r} ({entry.checkpoint_dir}) does not load: {why}")
        if failed and failed == len(self.cfg.models):
            self.start_failed = True
            self.request_stop()

    def request_stop(self) -> None:
        self._stop.set()

    def metrics_snapshot(self, owner_uid: int | None = None) -> dict:
        """The metrics as everyone's (the text file, admins) or as `owner_uid` may see them."""
        connections = self.server.connections if owner_uid is None else self.server.by_uid.get(owner_uid, 0)
        return snapshot(self.metrics, self.queue, device_kind=self.device.kind, jobs=self.jobs.live_states(owner_uid),
                        connections=connections, thermal=self.thermal, errors=self.errors,
                        gemms=self.gemm_site()[0], owner_uid=owner_uid)

    def gemm_site(self) -> tuple[str, str]:
        """Where the GEMMs run ("npu" or "host") and why, for the loaded models."""
        loaded = [m["describe"] for m in self.registry.describe() if m.get("describe")]
        return gemm_site(self.device, self.cfg.device, loaded)

    def check_other_holders(self) -> None:
        """Warn when another process has the NPU open (npud's queue orders only its own work), and
        when the locked-memory limit is not unlimited (NPU buffers are pinned)."""
        if self.device.kind != "npu":
            return
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY:
            log.warning("npu_memlock_limited", limit_bytes=soft,
                        note="NPU buffers are pinned memory; set LimitMEMLOCK=infinity (docs/npu.md)")
        self.other_holders = other_holders(self.device.node)
        if self.other_holders:
            log.warning("npu_shared_with_other_process", node=self.device.node, holders=self.other_holders,
                        note="their hardware contexts run beside npud's; its queue cannot order them")

    def status_line(self) -> str:
        """One line for systemd's STATUS=: where GEMMs run, quarantine, holder, queue, heat, driver errors."""
        q = self.queue
        site, why = self.gemm_site()
        parts = [f"{'stopping' if self._stop.is_set() else 'serving'}, GEMMs on {site} ({why})"]
        if q.quarantine is not None:
            parts.append(f"QUARANTINED ({q.quarantine.reason})")
        holder = q.granted
        parts.append("idle" if holder is None else f"ticket {holder.id} of job {holder.job_id} holds the device")
        counts = q.counts()
        parts.append(f"queue {counts['interactive']} interactive, {counts['batch']} batch")
        reading = self.thermal.reading_c
        parts.append(f"thermal {self.thermal.state}" + ("" if reading is None else f" {reading:.0f}C"))
        parts.append(f"{self.errors.count} amdxdna error(s)" + (
            f", {self.errors.pre_hang_count} pre-hang warning(s)" if self.errors.pre_hang_count else "") + (
            f", {self.errors.foreign_count} of other processes" if self.errors.foreign_count else ""))
        if self.other_holders:
            parts.append(f"NPU also open in pid {', '.join(str(h['pid']) for h in self.other_holders)}")
        return "; ".join(parts)

    async def _drain(self) -> None:
        """SIGTERM: stop accepting, let the running round end, release the device; what was
        running stays queued in the store and resumes on the next start. hurry() (a second stop
        signal) cuts the waiting short: the round is abandoned and the prefix caches not flushed."""
        sd_notify("STOPPING=1", "STATUS=stopping: finishing the running round, then releasing the device")
        deadline = self.cfg.server.drain_timeout_s
        log.info("shutdown_started", drain_timeout_s=deadline, holding=None if self.owner.holding is None
                 else self.owner.holding.id)
        self.jobs.accepting = False
        self.server.stop_accepting()
        self.http.stop_accepting()
        grace = self.cfg.server.shutdown_grace_s
        with self._drain_step(grace):  # in-flight requests may finish; the queue still grants
            while self.jobs.interactive_jobs():
                await trio.sleep(0.05)
        ended = await self.jobs.end_interactive(ApiError(
            ErrorCode.SHUTTING_DOWN, f"npud is shutting down; the request did not finish within "
                                     f"server.shutdown_grace_s = {grace} s"))
        if ended:
            log.info("shutdown_requests_ended", jobs=ended, shutdown_grace_s=grace)
        self.queue.stop()
        with self._drain_step(deadline) as scope:
            await self.owner.wait_idle()
        self.jobs.close_subscribers()
        if self.jobs.unsaved:  # a final state the store refused (a full disk) gets a last chance
            await self.jobs.save_unsaved()
        with self._drain_step(min(2.0, deadline)):  # the final replies go out before the connections close
            while self.server.requests_inflight:
                await trio.sleep(0.02)
        if scope.cancelled_caught:
            # the round is abandoned in its thread; the ticket is released as preempted (shutdown)
            log.warning("shutdown_deadline_passed" if not self._hurried else "shutdown_hurried",
                        drain_timeout_s=deadline)
            return
        with self._drain_step(deadline):
            try:
                written = await self.owner.engine_call(self.registry.flush_caches)
                log.info("prefix_caches_flushed", entries=written)
            except Exception:  # a cache that cannot be written is lost, the jobs are not
                log.exception("prefix_cache_flush_failed")

    def _drain_step(self, seconds: float) -> trio.CancelScope:
        """A scope for one step of the drain: ends after `seconds`, or at once when hurried."""
        self._drain_scope = trio.CancelScope(deadline=trio.current_time() + seconds)
        if self._hurried:
            self._drain_scope.cancel()
        return self._drain_scope

    def hurry(self) -> None:
        """Stop now: end the drain's current wait and skip what remains of it."""
        self._hurried = True
        self.request_stop()
        if self._drain_scope is not None:
            self._drain_scope.cancel()

    async def _signals(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with signals.receiver() as received:
            task_status.started()
            async for signum in received:
                if signum == signals.RELOAD:
                    sd_notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
                    await self.reload()
                    sd_notify("READY=1", f"STATUS={self.status_line()}")
                elif signum == signals.STATUS:
                    log.info("daemon_status", status=self.status_line())
                elif self._stop.is_set():  # a stop signal during the drain: only hurry it
                    log.warning("signal_received", signal=signals.name(signum), action="hurry")
                    self.hurry()
                else:
                    log.info("signal_received", signal=signals.name(signum), action="drain")
                    self.request_stop()

    async def reload(self) -> None:
        """SIGHUP: read the config file again and apply what can change in a running daemon."""
        if self.config_path is None:
            log.warning("config_reload_skipped", reason="no config file")
            return
        try:
            new = self.overrides(load_config(self.config_path))
            # the fixed fields are kept from the running config, and the mix is checked again:
            # removing [http]'s TCP keys keeps the old tcp_address without its tcp_owner_uid
            cfg, ignored = diff_for_reload(self.cfg, new)
        except DaemonConfigError as exc:
            log.error("config_reload_failed", error=str(exc), kept="the running configuration")
            return
        await self.apply(cfg)
        log.info("config_reloaded", path=str(self.config_path), ignored=ignored)

    async def apply(self, cfg: DaemonConfig) -> None:
        if cfg.device.power_mode != self.cfg.device.power_mode:
            self.power_mode = apply_power_mode(self.device, cfg.device.power_mode)
        self.cfg = cfg
        setup_logging(cfg.logging)
        self.queue.set_quantum(cfg.scheduler.quantum_tokens, cfg.scheduler.quantum_ms)
        self.thermal.cfg = cfg.thermal
        self.errors.reconfigure(cfg.errors)
        self.metrics.reconfigure(cfg.metrics)
        self.jobs.cfg = self.owner.cfg = self.server.cfg = self.http.cfg = self.api.cfg = cfg
        async with self.owner.device_lock:  # a load may be under way in the engine thread
            self.registry.reconfigure(cfg.models, cfg.device.max_resident_bytes, keep=self.owner.models_in_use())
