"""The systemd protocols npud speaks, without libsystemd: readiness and status (sd_notify),
the watchdog, and the listening socket passed by socket activation (sd_listen_fds).

Each one is a no-op when its environment variable is absent, so npud runs the same way in
a terminal, under a plain supervisor and under systemd.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

import structlog
import trio

log = structlog.get_logger(__name__)

SD_LISTEN_FDS_START = 3  # the first descriptor passed by socket activation
NOTIFY_TIMEOUT_S = 2.0  # the service manager reads its notify socket promptly; never wait longer
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def sd_notify(*assignments: str) -> bool:
    """Send `assignments` ("READY=1", "STATUS=...") to $NOTIFY_SOCKET as one datagram.

    Returns False when there is no $NOTIFY_SOCKET or the message could not be sent (logged).
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # an abstract socket
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        log.warning("sd_notify_unsupported_address", address=addr)
        return False
    message = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(NOTIFY_TIMEOUT_S)
            s.sendto(message, addr)
    except OSError as exc:
        log.warning("sd_notify_failed", state=assignments[0] if assignments else None,
                    error=exc.strerror or type(exc).__name__)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between two WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when the service
    manager expects none from this process. Raises RuntimeError for a malformed value."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None  # meant for another process (we were started by a wrapper)
        value = int(usec)
    except ValueError:
        raise RuntimeError(f"WATCHDOG_USEC={usec!r} / WATCHDOG_PID={pid!r}: not integers") from None
    if value <= 0:
        raise RuntimeError(f"WATCHDOG_USEC={usec!r}: must be > 0")
    return value / 2e6


def listen_fds() -> list[int]:
    """The descriptors passed to this process by socket activation, or [] when there are none.

    Like sd_listen_fds(unset_environment=1): the LISTEN_* variables are removed, so nothing
    started later takes the sockets for its own, and the descriptors are made close-on-exec.
    Raises RuntimeError for malformed variables meant for this process.
    """
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    for name in _LISTEN_VARS:
        os.environ.pop(name, None)
    if not pid or not count:
        return []
    try:
        if int(pid) != os.getpid():
            return []
        n = int(count)
    except ValueError:
        raise RuntimeError(f"LISTEN_PID={pid!r} / LISTEN_FDS={count!r}: not integers") from None
    if n < 0:
        raise RuntimeError(f"LISTEN_FDS={count!r}: must be >= 0")
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n))
    for fd in fds:
        try:
            os.set_inheritable(fd, False)
        except OSError as exc:
            raise RuntimeError(f"LISTEN_FDS={n}, but descriptor {fd} is not open: {exc.strerror}") from None
    return fds


def inherited_listener() -> socket.socket | None:
    """The listening Unix stream socket passed by socket activation, or None when npud must
    bind its own. Raises RuntimeError when what was passed is not one such socket."""
    fds = listen_fds()
    if not fds:
        return None
    if len(fds) != 1:
        raise RuntimeError(f"socket activation passed {len(fds)} sockets; npud serves exactly one "
                           "(give npud.socket one ListenStream=)")
    try:
        sock = socket.socket(fileno=fds[0])
    except OSError as exc:
        raise RuntimeError(f"descriptor {fds[0]} passed by socket activation is not a socket: {exc.strerror}") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        what = f"family {sock.family.name}, type {sock.type.name}, listening {bool(listening)}"
        sock.detach()
        raise RuntimeError(f"the socket passed by socket activation (fd {fds[0]}) is not a listening "
                           f"Unix stream socket ({what}); use ListenStream= with a path")
    return sock


async def run_watchdog(interval_s: float, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Ping the service manager's watchdog while the event loop runs (a stuck loop stops the
    pings, and systemd restarts npud after WatchdogSec=)."""
    task_status.started()
    while True:
        sd_notify("WATCHDOG=1")
        await trio.sleep(interval_s)


async def report_status(describe: Callable[[], str], wait_changed: Callable[[], Awaitable[None]], *,
                        sent: str | None = None, min_interval_s: float = 1.0, max_interval_s: float = 10.0,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Send STATUS= whenever describe() says something new (`sent` was said already): checked
    on every change that wait_changed() reports and at least every max_interval_s, at most once
    per min_interval_s."""
    task_status.started()
    last = sent
    while True:
        line = describe()
        if line != last:
            sd_notify(f"STATUS={line}")
            last = line
        with trio.move_on_after(max_interval_s):
            await wait_changed()
        await trio.sleep(min_interval_s)
