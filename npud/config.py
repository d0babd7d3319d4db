"""The daemon's configuration: a TOML file read into validated frozen dataclasses.

Every field is checked where it is declared (`__post_init__`); an error names the field
and the bad value. `npud --check-config` runs exactly this code and exits.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npud.engine.api import BUILTIN_CHAT_TEMPLATES, DEFAULT_CACHE_USERS
from npud.hfcache import NotCached, looks_like_repo_id, resolve_repo
from npud.kernels.amdxdna import POWER_MODES  # the driver's ioctls: standard library only, no tensor
from npud.kmsg import PRE_HANG_PATTERNS
from npud.packaged import PACKAGED, PackagedModelError, packaged_path

DEFAULT_CONFIG_PATH = Path("/etc/npud/npud.toml")
# npud.kernels.base.WeightFormat's values, and "gguf-q8" (a GGUF file's blocks against q8 activations)
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int8-q8", "int8-q16", "bf16-bf16", "gguf-q8")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
MAX_CACHE_USERS = 64  # store.prefix_cache_users: more shares than this leave each too small to hold a prompt
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class DaemonConfigError(ValueError):
    """A daemon configuration value is missing, of the wrong type or out of range."""

    def __init__(self, field_name: str, value: Any, why: str) -> None:
        super().__init__(f"{field_name} = {value!r}: {why}")
        self.field = field_name
        self.value = value


def _positive(name: str, value: float) -> None:
    if not value > 0:  # `not >` so that NaN is refused too
        raise DaemonConfigError(name, value, "must be > 0")
    if value == math.inf:
        raise DaemonConfigError(name, value, "must be finite")


@dataclass(slots=True, frozen=True)
class ServerConfig:
    socket_path: str = "/run/npud/npud.sock"
    socket_group: str = ""  # "" keeps the daemon's own group
    socket_mode: int = 0o660
    admin_group: str = "npud-admin"  # root is always admin; a missing group means root only
    max_connections: int = 512
    max_connections_per_uid: int = 32  # one user cannot hold every slot (root and the admin group are exempt)
    admin_reserved_connections: int = 4  # the last slots of max_connections: root and the admin group only
    max_inflight_per_connection: int = 32
    idle_timeout_s: float = 600.0  # a connection with no request in flight and no input
    line_timeout_s: float = 30.0  # a started line must end within this
    drain_timeout_s: float = 10.0  # SIGTERM: how long the running round may take to finish
    shutdown_grace_s: float = 5.0  # SIGTERM: how long in-flight `complete`/HTTP requests may take to end
    # HTTP: a connection that has not yet sent a whole (and, on TCP, authorized) first request
    first_request_timeout_s: float = 10.0  # ... is closed after this
    max_pending_per_peer: int = 8  # ... counts against this per peer uid (or address), not the uid's slots

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise DaemonConfigError("server.socket_path", self.socket_path, "must not be empty")
        if len(self.socket_path.encode()) > 107:
            raise DaemonConfigError("server.socket_path", self.socket_path, "a Unix socket path is at most 107 bytes")
        if not 0 <= self.socket_mode <= 0o777:
            raise DaemonConfigError("server.socket_mode", self.socket_mode, "must be a permission mode like 0o660")
        if self.socket_mode & 0o007:
            raise DaemonConfigError("server.socket_mode", oct(self.socket_mode), "must not grant access to other users")
        for name in ("max_connections", "max_connections_per_uid", "max_inflight_per_connection", "idle_timeout_s",
                     "line_timeout_s", "drain_timeout_s", "shutdown_grace_s", "first_request_timeout_s", "max_pending_per_peer"):
            _positive(f"server.{name}", getattr(self, name))
        if not 0 <= self.admin_reserved_connections < self.max_connections:
            raise DaemonConfigError("server.admin_reserved_connections", self.admin_reserved_connections,
                                    f"must be >= 0 and below server.max_connections ({self.max_connections})")


MIN_BEARER_TOKEN_CHARS = 16


def split_host_port(address: str) -> tuple[str, int]:
    """("127.0.0.1", 8080) from "127.0.0.1:8080" or "[::1]:8080"; raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected HOST:PORT with a port in [0, 65535], e.g. 127.0.0.1:8080")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)  # a literal address: a name could resolve to anything
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address; expected HOST:PORT with a literal address, "
                         "e.g. 127.0.0.1:8080 or [::1]:8080") from None
    return host, int(port)


@dataclass(slots=True, frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front end (npud/http/, docs/http.md). It listens on a Unix
    socket (peer credentials as on the main socket) and, only when tcp_address is set, on a
    TCP address: loopback unless allow_remote, which needs a bearer token. A TCP peer has no
    credentials, so its requests run as tcp_owner_uid (never an admin)."""

    enabled: bool = True
    socket_path: str = ""  # "" = http.sock beside server.socket_path (mode and group as that socket)
    tcp_address: str = ""  # "" = no TCP; "127.0.0.1:8080" or "[::1]:8080" (port 0: the kernel picks)
    tcp_owner_uid: int | None = None  # whose jobs TCP requests make; required with tcp_address
    allow_remote: bool = False  # a non-loopback tcp_address; needs bearer_token
    bearer_token: str = ""  # when set, TCP requests need "Authorization: Bearer <token>"

    def __post_init__(self) -> None:
        if len(self.socket_path.encode()) > 107:
            raise DaemonConfigError("http.socket_path", self.socket_path, "a Unix socket path is at most 107 bytes")
        if self.bearer_token and len(self.bearer_token) < MIN_BEARER_TOKEN_CHARS:
            raise DaemonConfigError("http.bearer_token", "(hidden)", f"must have at least {MIN_BEARER_TOKEN_CHARS} "
                                                                     "characters")
        if self.tcp_owner_uid is not None and not 0 <= self.tcp_owner_uid < 2**32 - 1:
            raise DaemonConfigError("http.tcp_owner_uid", self.tcp_owner_uid, "must be a uid (>= 0)")
        if self.allow_remote and not self.bearer_token:  # on any address: the docs promise the token
            raise DaemonConfigError("http.allow_remote", True, "needs http.bearer_token")
        if not self.tcp_address:
            return
        try:
            host, _ = split_host_port(self.tcp_address)
        except ValueError as exc:
            raise DaemonConfigError("http.tcp_address", self.tcp_address, str(exc)) from None
        if self.tcp_owner_uid is None:
            raise DaemonConfigError("http.tcp_owner_uid", None, "is required with http.tcp_address (a TCP peer has "
                                                                "no credentials: its jobs belong to this uid)")
        if not ipaddress.ip_address(host).is_loopback and not self.allow_remote:
            raise DaemonConfigError("http.tcp_address", self.tcp_address,
                                    "not a loopback address; set http.allow_remote (with http.bearer_token) "
                                    "to serve other hosts")

    def unix_path(self, server: "ServerConfig") -> str:
        """The HTTP socket's path: socket_path, or http.sock beside the main socket."""
        if self.socket_path:
            return self.socket_path
        return str(Path(server.socket_path).parent / "http.sock")


@dataclass(slots=True, frozen=True)
class LimitsConfig:
    max_line_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    max_prompts_per_job: int = 1024
    max_queued_jobs_per_user: int = 64
    max_queued_bytes_per_user: int = 32 << 20  # prompt bytes of one user's unfinished jobs

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _positive(f"limits.{f.name}", getattr(self, f.name))
        if self.max_line_bytes < 1024:
            raise DaemonConfigError("limits.max_line_bytes", self.max_line_bytes, "must be at least 1024")


@dataclass(slots=True, frozen=True)
class StoreConfig:
    state_dir: str = "/var/lib/npud"
    retention_days: float = 30.0  # finished jobs, their results and tickets are kept this long
    persist_prefix_cache: bool = True  # prefix-cache entries spill to <state_dir>/prefix-cache/<model>
    # each model's prefix-cache budgets: a share for the shared scope and one for each of this
    # many users (0: one budget for all, for a daemon only one user talks to)
    prefix_cache_users: int = DEFAULT_CACHE_USERS

    def __post_init__(self) -> None:
        if not self.state_dir:
            raise DaemonConfigError("store.state_dir", self.state_dir, "must not be empty")
        if not 0 <= self.prefix_cache_users <= MAX_CACHE_USERS:
            raise DaemonConfigError("store.prefix_cache_users", self.prefix_cache_users,
                                    f"must be in [0, {MAX_CACHE_USERS}]")
        _positive("store.retention_days", self.retention_days)


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    # A ticket holds the device for at most this much work when another ticket of the same
    # or a higher class waits; an interactive ticket waiting preempts batch at once.
    quantum_tokens: int = 256
    quantum_ms: float = 2000.0

    def __post_init__(self) -> None:
        _positive("scheduler.quantum_tokens", self.quantum_tokens)
        _positive("scheduler.quantum_ms", self.quantum_ms)


MAX_BATCH_LIMIT = 256  # sequences in one running batch, at most (engine rows per round grow with it)


@dataclass(slots=True, frozen=True)
class BatchingConfig:
    # Sequences of one model advanced together, one batched engine round at a time: a batch
    # job's prompts and interactive requests that join at a round boundary. 1: no batching
    # (each ticket runs one prompt of one job at a time).
    max_batch: int = 16
    # The context positions (prompt tokens + max_tokens, each clamped to the model's context)
    # of the running sequences, summed: the KV memory they may come to hold. A sequence that
    # does not fit waits; one sequence alone always runs.
    max_batch_positions: int = 32768
    # Prompt rows that sequences still prefilling may take in one round between them, so a long
    # prompt joining does not stall the running sequences' steps (npud.engine.api run_batch).
    prefill_budget: int = 64
    # While an interactive sequence runs, batch sequences run beside it only while a round of all
    # the running sequences costs at most this many of one sequence's steps (the model's
    # calibrated pass costs, ServedModel.round_cost); the others are set aside until it ends. A
    # number past any round's cost (1000) leaves max_batch alone to decide.
    interactive_round_cost: float = 1.5

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_batch_positions", "prefill_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DaemonConfigError(f"batching.{name}", value, "must be a whole number of at least 1")
        cost = self.interactive_round_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 1.0 <= cost < math.inf:
            raise DaemonConfigError("batching.interactive_round_cost", cost,
                                    "must be a finite number of at least 1.0 (one sequence's step)")
        if self.max_batch > MAX_BATCH_LIMIT:
            raise DaemonConfigError("batching.max_batch", self.max_batch, f"must be at most {MAX_BATCH_LIMIT}")


POWER_MODE_NAMES = ("", *POWER_MODES)  # "": the driver's mode is left as it is


@dataclass(slots=True, frozen=True)
class DeviceConfig:
    accel_dir: str = "/dev/accel"
    sysfs_class_dir: str = "/sys/class/accel"
    max_resident_bytes: int = 0  # models kept loaded (LRU); 0 = half of the physical memory
    backend: str = "auto"  # auto: the NPU where it can run (device, pyxrt, xrt_design), else the host
    xrt_design: str = ""  # the NPU GEMM design table (npud/kernels/xrt_design.py); "" = none configured
    xrt_timeout_ms: int = 5000  # one GEMM run on the NPU longer than this is a fault
    # the driver's power mode, by xrt-smi's names (npud/kernels/amdxdna.py); "" = leave it as it is
    power_mode: str = ""

    def __post_init__(self) -> None:
        if self.max_resident_bytes < 0:
            raise DaemonConfigError("device.max_resident_bytes", self.max_resident_bytes, "must be >= 0")
        if self.power_mode not in POWER_MODE_NAMES:
            raise DaemonConfigError("device.power_mode", self.power_mode,
                                    f"expected one of {list(POWER_MODE_NAMES)}")
        if self.backend not in ("auto", "host", "xrt"):
            raise DaemonConfigError("device.backend", self.backend, "must be auto, host or xrt")
        _positive("device.xrt_timeout_ms", self.xrt_timeout_ms)


@dataclass(slots=True, frozen=True)
class ThermalConfig:
    enabled: bool = True
    # hwmon devices: the NPU's own sensor ("amdxdna" NPU_temperature) and k10temp's Tctl, the hotter counts;
    # "" reads none
    hwmon_dir: str = "/sys/class/hwmon"
    psutil_chips: tuple[str, ...] = ("k10temp",)  # read when hwmon has neither; () = none
    paths: tuple[str, ...] = ()  # files or globs in millidegrees C (hwmon temp*_input, thermal_zone*/temp)
    hold_above_c: float = 95.0
    resume_below_c: float = 85.0
    abort_above_c: float = 100.0
    poll_interval_s: float = 2.0

    def __post_init__(self) -> None:
        _positive("thermal.poll_interval_s", self.poll_interval_s)
        if not self.resume_below_c < self.hold_above_c:
            raise DaemonConfigError("thermal.resume_below_c", self.resume_below_c,
                              f"must be below thermal.hold_above_c ({self.hold_above_c})")
        if not self.hold_above_c <= self.abort_above_c:
            raise DaemonConfigError("thermal.abort_above_c", self.abort_above_c,
                              f"must be at least thermal.hold_above_c ({self.hold_above_c})")


@dataclass(slots=True, frozen=True)
class ErrorsConfig:
    """The amdxdna error count read from the kernel log."""

    enabled: bool = True
    source: str = "/dev/kmsg"
    # Errors are the amdxdna device's kernel messages at level err or worse (both driver
    # variants, npud/kmsg.py); these further regexes make one of its messages an error too.
    patterns: tuple[str, ...] = ()
    # The device's warnings that come before a hang or a firmware reset: counted, not faulted on.
    pre_hang_patterns: tuple[str, ...] = PRE_HANG_PATTERNS
    # Error-level lines of the device that any process can cause, beside npud/guards.py's
    # built-in BENIGN_PATTERNS: counted apart, never faulted on.
    benign_patterns: tuple[str, ...] = ()
    poll_interval_s: float = 0.25

    def __post_init__(self) -> None:
        _positive("errors.poll_interval_s", self.poll_interval_s)
        for name in ("patterns", "pre_hang_patterns", "benign_patterns"):
            for i, pattern in enumerate(getattr(self, name)):
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise DaemonConfigError(f"errors.{name}[{i}]", pattern, f"not a regular expression: {exc}") from None


@dataclass(slots=True, frozen=True)
class LoggingConfig:
    level: str = "info"
    format: str = "auto"  # auto: JSON lines unless stdout is a TTY

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise DaemonConfigError("logging.level", self.level, f"expected one of {list(LOG_LEVELS)}")
        if self.format not in LOG_FORMATS:
            raise DaemonConfigError("logging.format", self.format, f"expected one of {list(LOG_FORMATS)}")


@dataclass(slots=True, frozen=True)
class MetricsConfig:
    """The `metrics` method's window, and the optional Prometheus text file (node_exporter's
    textfile collector reads every `*.prom` file of its directory)."""

    textfile_path: str = ""  # "" writes no file
    textfile_interval_s: float = 15.0
    rate_window_s: float = 60.0  # tokens per second are measured over this much recent time

    def __post_init__(self) -> None:
        if self.textfile_path and not self.textfile_path.endswith(".prom"):
            raise DaemonConfigError("metrics.textfile_path", self.textfile_path,
                              "must end in .prom (the textfile collector reads only *.prom files)")
        if self.textfile_path and not self.textfile_path.startswith("/"):
            raise DaemonConfigError("metrics.textfile_path", self.textfile_path, "must be an absolute path")
        _positive("metrics.textfile_interval_s", self.textfile_interval_s)
        _positive("metrics.rate_window_s", self.rate_window_s)


@dataclass(slots=True, frozen=True)
class ModelEntry:
    name: str
    checkpoint_dir: str
    draft_dir: str | None = None
    dflash_dir: str | None = None  # a DFlash / DFlash 2 block drafter trained on this base
    assistant_dir: str | None = None  # a Gemma 4 assistant (gemma4_assistant) made for this base
    weight_format: str = "bf16"
    preload: bool = False  # loaded when the daemon starts, not on the first request
    context_length: int = 0  # positions the model serves: 0 = the checkpoint's (a larger value is clamped to it)
    threads: int = 0  # host threads of its rounds: 0 = NPUD_HOST_THREADS, else the CPUs npud may use
    # seconds the model stays loaded once no job uses it; negative: until evicted for memory
    # (or unloaded); a request's `keep_alive` sets it for that model from then on
    keep_alive_s: float = -1.0
    # how chats are rendered: a Jinja file or a built-in (gemma, chatml, llama3, mistral);
    # None: the checkpoint's own template, else the built-in its vocabulary names
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.context_length < 0:
            raise DaemonConfigError(f"models[{self.name}].context_length", self.context_length,
                                    "must be >= 0 (0: the checkpoint's)")
        if not 0 <= self.threads <= 1024:
            raise DaemonConfigError(f"models[{self.name}].threads", self.threads, "must be in [0, 1024] (0: the default)")
        if not MODEL_NAME_RE.match(self.name):
            raise DaemonConfigError("models.name", self.name, "letters, digits, '.', '_', '-' (at most 64)")
        if not self.checkpoint_dir:
            raise DaemonConfigError(f"models[{self.name}].checkpoint_dir", self.checkpoint_dir, "must not be empty")
        if self.weight_format not in WEIGHT_FORMATS:
            raise DaemonConfigError(f"models[{self.name}].weight_format", self.weight_format,
                              f"expected one of {list(WEIGHT_FORMATS)}")


@dataclass(slots=True, frozen=True)
class DaemonConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    errors: ErrorsConfig = field(default_factory=ErrorsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    models: tuple[ModelEntry, ...] = ()
    default_model: str | None = None  # None: the first model

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise DaemonConfigError("models.name", sorted(dup)[0], "model names must be unique")
        if self.default_model is not None and self.default_model not in names:
            raise DaemonConfigError("default_model", self.default_model, f"not one of the models {names}")
        if self.http.enabled and self.http.unix_path(self.server) == self.server.socket_path:
            raise DaemonConfigError("http.socket_path", self.http.socket_path, "must differ from server.socket_path")

    @property
    def default_model_name(self) -> str | None:
        if self.default_model is not None:
            return self.default_model
        return self.models[0].name if self.models else None

    def model(self, name: str) -> ModelEntry | None:
        return next((m for m in self.models if m.name == name), None)

    def replace(self, **sections: Any) -> "DaemonConfig":
        return dataclasses.replace(self, **sections)


# Fields that SIGHUP cannot change in a running daemon (the socket and the store are open).
RELOAD_FIXED = ("server.socket_path", "server.socket_group", "server.socket_mode", "store.state_dir",
                "http.enabled", "http.socket_path", "http.tcp_address", "http.allow_remote")


def _coerce(cls_name: str, name: str, hint: Any, value: Any) -> Any:
    """Check a TOML value against a field's type hint; tuples come from TOML arrays."""
    where = f"{cls_name}.{name}" if cls_name else name
    origin = typing.get_origin(hint)
    if hint is bool:
        if not isinstance(value, bool):
            raise DaemonConfigError(where, value, "expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DaemonConfigError(where, value, "expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DaemonConfigError(where, value, "expected a number")
        if not math.isfinite(value):  # TOML has nan and inf; no setting means either
            raise DaemonConfigError(where, value, "must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise DaemonConfigError(where, value, "expected a string")
        return value
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise DaemonConfigError(where, value, "expected a list of strings")
        return tuple(value)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(cls_name, name, args[0], value)
    raise TypeError(f"no coercion for {hint!r}")


_ENV_VAR_RE = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def is_path_field(name: str) -> bool:
    """Whether a setting names a file or directory (and so gets ~ and $VAR expanded)."""
    return name.endswith(("_path", "_dir")) or name in ("paths", "source", "xrt_design")


def expand_path(where: str, value: str) -> str:
    """`value` with $VAR / ${VAR} replaced from the environment and a leading ~ or ~user made a
    home directory. An unset variable is an error naming it (not left in the path as text)."""
    def var(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            raise DaemonConfigError(where, value, f"the environment variable {name} is not set")
        return os.environ[name]
    return os.path.expanduser(_ENV_VAR_RE.sub(var, value))


def model_path(where: str, value: str, base_dir: Path | None) -> str:
    """A model's checkpoint (or drafter) as a path: relative to base_dir; a value that names no
    file there but reads like a Hugging Face repo id (org/name) is that repo's snapshot in the
    local cache (npud/hfcache.py), and the short name of a packaged model (npud/packaged.py:
    gemma-3-270m) is that model's file. Raises DaemonConfigError when such a repo is not
    cached or such a package is not installed."""
    path = Path(value) if base_dir is None else base_dir / value
    if not path.exists() and value in PACKAGED:
        try:
            return str(packaged_path(value))
        except PackagedModelError as exc:
            raise DaemonConfigError(where, value, str(exc)) from None
    if path.exists() or not looks_like_repo_id(value):
        return str(path)
    try:
        return str(resolve_repo(value))
    except NotCached as exc:
        raise DaemonConfigError(where, value, f"no such file or directory, and {exc}") from None


def _build(cls: type, raw: Any, section: str) -> Any:
    if not isinstance(raw, dict):
        raise DaemonConfigError(section, raw, "expected a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise DaemonConfigError(f"{section}.{sorted(unknown)[0]}", raw[sorted(unknown)[0]], "unknown field")
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in raw:
            raise DaemonConfigError(f"{section}.{f.name}", None, "is required")
    values = {k: _coerce(section, k, hints[k], v) for k, v in raw.items()}
    for k, v in values.items():
        if is_path_field(k) and isinstance(v, str):
            values[k] = expand_path(f"{section}.{k}", v)
        elif is_path_field(k) and isinstance(v, tuple):
            values[k] = tuple(expand_path(f"{section}.{k}[{i}]", p) for i, p in enumerate(v))
    return cls(**values)


_SECTIONS = {
    "server": ServerConfig, "limits": LimitsConfig, "store": StoreConfig, "scheduler": SchedulerConfig,
    "batching": BatchingConfig, "device": DeviceConfig, "thermal": ThermalConfig, "errors": ErrorsConfig, "logging": LoggingConfig,
    "metrics": MetricsConfig, "http": HttpConfig,
}


def parse_config(raw: dict, base_dir: Path | None = None) -> DaemonConfig:
    """Build a DaemonConfig from parsed TOML; relative model paths are taken from base_dir.

    Raises DaemonConfigError naming the first bad field.
    """
    unknown = set(raw) - set(_SECTIONS) - {"models", "default_model"}
    if unknown:
        key = sorted(unknown)[0]
        raise DaemonConfigError(key, raw[key], "unknown section or field")
    sections = {name: _build(cls, raw.get(name, {}), name) for name, cls in _SECTIONS.items()}
    models_raw = raw.get("models", [])
    if not isinstance(models_raw, list):
        raise DaemonConfigError("models", models_raw, "expected an array of tables ([[models]])")
    models = []
    for i, entry in enumerate(models_raw):
        model = _build(ModelEntry, entry, f"models[{i}]")
        dirs = {label: model_path(f"models[{model.name}].{label}", getattr(model, label), base_dir)
                for label in ("checkpoint_dir", "draft_dir", "dflash_dir", "assistant_dir")
                if getattr(model, label) is not None}
        if model.chat_template is not None and model.chat_template not in BUILTIN_CHAT_TEMPLATES:
            template = expand_path(f"models[{model.name}].chat_template", model.chat_template)
            template = str(Path(template) if base_dir is None else base_dir / template)
            if not Path(template).is_file():
                raise DaemonConfigError(f"models[{model.name}].chat_template", model.chat_template,
                                        f"no such file, and not one of the built-in templates {list(BUILTIN_CHAT_TEMPLATES)}")
            dirs["chat_template"] = template
        models.append(dataclasses.replace(model, **dirs))
    default_model = raw.get("default_model")
    if default_model is not None and not isinstance(default_model, str):
        raise DaemonConfigError("default_model", default_model, "expected a string")
    return DaemonConfig(models=tuple(models), default_model=default_model, **sections)


def load_config(path: Path) -> DaemonConfig:
    """Read and validate a TOML config file; raises DaemonConfigError (also for I/O and syntax)."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise DaemonConfigError("--config", str(path), f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise DaemonConfigError("--config", str(path), "not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise DaemonConfigError("--config", str(path), f"not valid TOML: {exc}") from None
    if not raw:
        raise DaemonConfigError("--config", str(path), "the file sets nothing; systemd/npud.toml is the commented "
                                "example, and a [[models]] table with name and checkpoint_dir serves a model")
    return parse_config(raw, Path(path).resolve().parent)


def check_models(cfg: DaemonConfig) -> list[str]:
    """Problems a --check-config reports, one per model file that would not load: the base
    checkpoint and a draft model are read as a load reads them but for the tensor data
    (npud.engine.loader.describe_checkpoint: config.json, tokenizer, safetensors headers, or a .gguf's
    metadata and tensor table); a drafter directory must hold a config.json."""
    problems = []
    for m in cfg.models:
        for label, d in (("checkpoint_dir", m.checkpoint_dir), ("draft_dir", m.draft_dir),
                         ("dflash_dir", m.dflash_dir), ("assistant_dir", m.assistant_dir)):
            if d is None:
                continue
            p = Path(d)
            if not p.exists():
                problems.append(f"models[{m.name}].{label} = {d!r}: does not exist")
            elif label in ("checkpoint_dir", "draft_dir") and (p.is_dir() or p.suffix == ".gguf"):
                problems.extend(_describe(f"models[{m.name}].{label}", d))
            elif not p.is_dir():
                problems.append(f"models[{m.name}].{label} = {d!r}: not a directory")
            elif not (p / "config.json").is_file():
                problems.append(f"models[{m.name}].{label} = {d!r}: no config.json in it")
    return problems


def _describe(where: str, path: str) -> list[str]:
    """A checkpoint read by the engine without its weights: an unsupported architecture, a
    broken config or tokenizer, a missing weight file is reported here, not on the first request."""
    from npud.engine.loader import describe_checkpoint

    if not Path(path).exists():
        return [f"{where} = {path!r}: no such GGUF file"]
    try:
        describe_checkpoint(path)
    except (ValueError, OSError) as exc:  # engine ConfigError / WeightsError / TokenizerError
        return [f"{where}: {exc}"]
    return []


def diff_for_reload(old: DaemonConfig, new: DaemonConfig) -> tuple[DaemonConfig, list[str]]:
    """The config a SIGHUP applies: `new` with the fields that cannot change kept from `old`.

    Returns (config, names of the fixed fields the new file tried to change).
    """
    ignored = []
    for dotted in RELOAD_FIXED:
        section, name = dotted.split(".")
        if getattr(getattr(old, section), name) != getattr(getattr(new, section), name):
            ignored.append(dotted)
    merged = new.replace(
        server=dataclasses.replace(new.server, socket_path=old.server.socket_path,
                                   socket_group=old.server.socket_group, socket_mode=old.server.socket_mode),
        store=dataclasses.replace(new.store, state_dir=old.store.state_dir),
        http=dataclasses.replace(new.http, enabled=old.http.enabled, socket_path=old.http.socket_path,
                                 tcp_address=old.http.tcp_address, allow_remote=old.http.allow_remote),
    )
    return merged, ignored
