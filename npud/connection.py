"""One connection's protocol state, without I/O: framing, limits and timeouts.

The server's connection task (npud/server.py) feeds it the bytes it receives and does what
it answers: run a parsed request in its own task, or send an error reply. It also asks how
long the next read may wait. Everything a client can get wrong on a connection is decided
here, so it is tested without sockets (tests/test_npud_connection.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import structlog

from npud.config import DaemonConfig
from npud.protocol import ApiError, ErrorCode, LineReader, LineTooLong, Request, error_reply, parse_request

log = structlog.get_logger(__name__)


@dataclass(slots=True, frozen=True)
class Limits:
    max_line_bytes: int
    line_timeout_s: float  # a started line must end within this
    idle_timeout_s: float  # no request in flight and no input
    max_inflight: int

    @classmethod
    def from_config(cls, cfg: DaemonConfig) -> "Limits":
        return cls(cfg.limits.max_line_bytes, cfg.server.line_timeout_s, cfg.server.idle_timeout_s,
                   cfg.server.max_inflight_per_connection)


class ConnectionState:
    """What to do with a connection's input: `receive(data, now)` returns, in order, the requests
    to run and the error replies to send; `finished(now)` is called when a run request has replied.
    `deadline()` is when the connection times out, on the caller's clock (trio.current_time())."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.inflight = 0
        self._reader = LineReader(limits.max_line_bytes)
        self._idle_since = now  # when the last request replied (or the connection opened)
        self._line_started: float | None = None  # when the first byte of the unfinished line came

    @property
    def partial(self) -> bool:
        """True while a request line has started but not ended."""
        return self._reader.partial

    def deadline(self) -> float:
        """When the connection times out: a started line must end line_timeout_s after its first
        byte (however slowly it drips), an idle connection closes idle_timeout_s after its last
        reply, and one with requests in flight may stay silent (a stream has no deadline)."""
        if self._line_started is not None:
            return self._line_started + self.limits.line_timeout_s
        if self.inflight == 0:
            return self._idle_since + self.limits.idle_timeout_s
        return math.inf

    def timed_out(self) -> list[dict]:
        """The read timed out: the replies to send before the connection closes."""
        log.info("connection_timeout", partial_line=self._reader.partial)
        if self._reader.partial:
            return [error_reply(None, ApiError(
                ErrorCode.BAD_REQUEST, f"the request line did not end within {self.limits.line_timeout_s} s"))]
        return []

    def receive(self, data: bytes, now: float) -> list[Request | dict]:
        """Bytes from the client at time `now`: a Request to run (counted in flight) or an error
        reply (a dict) for each complete line, in order. Blank lines are skipped."""
        out: list[Request | dict] = []
        for line in self._reader.feed(data):
            if isinstance(line, LineTooLong):
                log.warning("request_line_too_long", length=line.length)
                out.append(error_reply(None, ApiError(
                    ErrorCode.LINE_TOO_LONG, f"the request line has {line.length} bytes, more than "
                    f"limits.max_line_bytes = {self.limits.max_line_bytes}; it was discarded")))
                continue
            if not line.strip():
                continue
            try:
                req = parse_request(line)
            except ApiError as exc:
                out.append(error_reply(getattr(exc, "req_id", None), exc))
                continue
            if self.inflight >= self.limits.max_inflight:
                out.append(error_reply(req.id, ApiError(
                    ErrorCode.OVERLOADED, f"{self.limits.max_inflight} requests are already in flight on this "
                                          "connection (server.max_inflight_per_connection)")))
                continue
            self.inflight += 1
            out.append(req)
        if not self._reader.partial:
            self._line_started = None
        elif self._line_started is None or b"\n" in data:  # a line ended in `data` and another began
            self._line_started = now
        if b"\n" in data:  # a complete line is input: the idle time counts from it
            self._idle_since = now
        return out

    def finished(self, now: float) -> None:
        """A request returned by receive() has sent its reply at time `now`."""
        self.inflight -= 1
        if self.inflight == 0:
            self._idle_since = now
