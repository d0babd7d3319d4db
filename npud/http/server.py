"""The HTTP front end's sockets and HTTP/1.1 framing, on the daemon's trio loop.

h11 parses and writes HTTP (a maintained sans-IO library; this module only moves bytes), so
each connection is a plain task like the main socket's: peer credentials from SO_PEERCRED on
the Unix socket, the configured owner on TCP, the main socket's connection limits and
timeouts. While a request runs, the connection is read on the side: a client that goes away
(EOF or a reset) cancels the request, and with it its job (npud/api.py's run_single).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hmac
import itertools
import os
import socket
import time
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11
import structlog
import trio

from npud.config import DaemonConfig, split_host_port
from npud.http import errors
from npud.http.app import App, ClientGone, HttpRequest, send_error
from npud.jobs import Caller
from npud.peers import peer_name, tcp_peer_uid
from npud.protocol import ApiError, ErrorCode, encode
from npud.server import Peer, bind_unix, is_admin, peer_credentials

if TYPE_CHECKING:
    from npud.api import Api
    from npud.server import Server

log = structlog.get_logger(__name__)

RECEIVE_BYTES = 65536
MAX_HEAD_BYTES = 16384  # the request line and headers


class H11Responder:
    """app.Responder over one h11 connection."""

    def __init__(self, stream: trio.SocketStream, conn: h11.Connection, send_timeout_s: float, *,
                 head_only: bool = False) -> None:
        self.stream = stream
        self.head_only = head_only  # a HEAD request: the headers say what a GET's body would be, no body follows
        self.conn = conn
        self.send_timeout_s = send_timeout_s
        self.started = False
        self.status: int | None = None

    async def _send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if not data:
            return
        try:
            with trio.fail_after(self.send_timeout_s):
                await self.stream.send_all(data)
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise ClientGone() from None

    async def send_json(self, status: int, payload: dict) -> None:
        body = encode(payload)  # the main socket's JSON writer (lone surrogates escaped)
        self.status, self.started = status, True
        await self._send(h11.Response(status_code=status, reason=HTTPStatus(status).phrase, headers=[
            ("content-type", "application/json"), ("content-length", str(len(body)))]))
        if not self.head_only:
            await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def send_text(self, status: int, content_type: str, body: bytes) -> None:
        self.status, self.started = status, True
        await self._send(h11.Response(status_code=status, reason=HTTPStatus(status).phrase, headers=[
            ("content-type", content_type), ("content-length", str(len(body)))]))
        if not self.head_only:
            await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def send_continue(self) -> None:
        await self._send(h11.InformationalResponse(status_code=100, headers=[]))

    async def start_stream(self, content_type: str = "text/event-stream") -> None:
        self.status, self.started = 200, True
        await self._send(h11.Response(status_code=200, reason=b"OK", headers=[
            ("content-type", content_type), ("cache-control", "no-cache")]))

    async def send_event(self, data: bytes) -> None:
        if not self.head_only:
            await self._send(h11.Data(data=data))

    async def end_stream(self) -> None:
        await self._send(h11.EndOfMessage())


class HttpServer:
    """Serves the App on http.socket_path (Unix) and, when configured, http.tcp_address."""

    def __init__(self, cfg: DaemonConfig, api: "Api", server: "Server") -> None:
        self.cfg = cfg
        self.app = App(api)
        self.server = server  # the main socket's server: one count of connections per uid for both
        self._ids = itertools.count(1)
        self.pending: collections.Counter[str] = collections.Counter()  # TCP connections before an authorized request
        self._accept_scope: trio.CancelScope | None = None
        self.unix_path: str | None = None
        self.tcp_address: tuple[str, int] | None = None  # as bound (port 0 becomes the kernel's)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; started() once the sockets accept connections."""
        http = self.cfg.http
        path = http.unix_path(self.cfg.server)
        unix = await bind_unix(self.cfg.server, path)
        self.unix_path = path
        listeners = [(unix, False)]
        try:
            if http.tcp_address:
                host, port = split_host_port(http.tcp_address)
                tcp = (await trio.open_tcp_listeners(port, host=host))[0]
                self.tcp_address = tcp.socket.getsockname()[:2]
                listeners.append((tcp, True))
            log.info("http_listening", socket=path, tcp=None if self.tcp_address is None else
                     f"{self.tcp_address[0]}:{self.tcp_address[1]}", tcp_owner_uid=http.tcp_owner_uid)
            async with trio.open_nursery() as conns:
                with trio.CancelScope() as self._accept_scope:
                    async with trio.open_nursery() as accepting:
                        for listener, tcp in listeners:
                            accepting.start_soon(functools.partial(
                                trio.serve_listeners, functools.partial(self.handle, tcp=tcp), [listener],
                                handler_nursery=conns))
                        task_status.started()
                self._close(listeners)
        finally:
            self._close(listeners)

    def _close(self, listeners: list) -> None:
        for listener, _ in listeners:
            listener.socket.close()
        if self.unix_path is not None:
            try:
                os.unlink(self.unix_path)
            except FileNotFoundError:
                pass
            self.unix_path = None

    def stop_accepting(self) -> None:
        if self._accept_scope is not None:
            self._accept_scope.cancel()

    def _peer(self, stream: trio.SocketStream, conn_id: int, tcp: bool) -> Peer:
        """Who the connection acts for: SO_PEERCRED on the Unix socket; on TCP, which has no
        credentials, http.tcp_owner_uid and never an admin."""
        if tcp:  # no process and no group to speak of: pid 0, gid -1
            uid = self.cfg.http.tcp_owner_uid
            return Peer(conn_id, 0, uid, -1, Caller(uid, admin=False))
        pid, uid, gid = peer_credentials(stream.socket)
        return Peer(conn_id, pid, uid, gid, Caller(uid, is_admin(uid, gid, self.cfg.server.admin_group)))

    @staticmethod
    async def _tcp_peer(stream: trio.SocketStream) -> str:
        """A TCP peer as its limits count it and the log names it: "uid N" when its socket is
        this host's (loopback), else its address."""
        local, remote = stream.socket.getsockname(), stream.socket.getpeername()
        uid = await trio.to_thread.run_sync(tcp_peer_uid, local, remote)
        return peer_name(remote) if uid is None else f"uid {uid}"

    def _tcp_refusal(self, who: str) -> ApiError | None:
        """Why a new TCP connection of `who` is refused before it has sent a request, or None.
        Until its first request is authorized it holds none of tcp_owner_uid's slots, only one
        of its peer's server.max_pending_per_peer, so a peer without the token cannot lock
        anyone out; descriptors running low refuse it too (npud/peers.py)."""
        server, limit = self.server, self.cfg.server.max_pending_per_peer
        if self.pending[who] >= limit:
            return ApiError(ErrorCode.OVERLOADED, f"{who} has {limit} connections that have not sent an authorized "
                                                  "request, its limit (server.max_pending_per_peer)")
        if server.pending >= self.cfg.server.max_connections or server.short_of_descriptors():
            return ApiError(ErrorCode.OVERLOADED, "npud has too many connections waiting for a first request")
        return None

    async def handle(self, stream: trio.SocketStream, *, tcp: bool) -> None:
        conn_id = next(self._ids)
        server = self.server
        with contextlib.ExitStack() as counts, structlog.contextvars.bound_contextvars(http_conn=conn_id):
            try:
                try:
                    peer = self._peer(stream, conn_id, tcp)
                    who = await self._tcp_peer(stream) if tcp else f"uid {peer.uid}"
                except OSError as exc:  # the peer left before its credentials or address were read
                    log.info("peer_credentials_failed", error=exc.strerror)
                    return
                if tcp:
                    refusal = self._tcp_refusal(who)
                    if refusal is None:
                        counts.callback(self._count_pending(who))
                else:
                    counts.callback(server.count(peer.uid))
                    refusal = server.refusal(peer.uid, peer.caller.admin)
                if refusal is not None:  # answered at once, never by reading: HTTP has no greeting
                    log.warning("connection_refused", peer=who, reason=refusal.message)
                    await self._refuse(stream, refusal)
                    return
                await self._serve_connection(stream, peer, tcp, who, counts)
            except ClientGone:
                pass
            except Exception:
                log.exception("connection_error", http_conn=conn_id)
            finally:
                await trio.aclose_forcefully(stream)

    def _count_pending(self, who: str):
        """Count a connection of `who` as waiting for its first authorized request; returns the uncount."""
        self.pending[who] += 1
        self.server.pending += 1

        def release() -> None:
            self.pending[who] -= 1
            self.server.pending -= 1
            if not self.pending[who]:
                del self.pending[who]
        return release

    async def _refuse(self, stream: trio.SocketStream, exc: ApiError) -> None:
        """503 and the error, written before any request is read (h11 would wait for one), then close."""
        body = encode(errors.error_body(exc))
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(head + body)
                stream.socket.shutdown(socket.SHUT_WR)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _serve_connection(self, stream: trio.SocketStream, peer: Peer, tcp: bool, who: str,
                                counts: contextlib.ExitStack) -> None:
        cfg = self.cfg
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        first, pending = True, tcp  # a TCP connection is pending until a request carries the token
        while True:
            request = None
            try:
                request = await self._read_request(stream, conn, first=first or pending)
                if request is not None and pending:
                    if self._has_token(request):
                        pending = False
                        counts.close()  # one of the owner's connections from here on
                        counts.callback(self.server.count(peer.uid))
                        refusal = self.server.refusal(peer.uid, False)
                        if refusal is not None:
                            log.warning("connection_refused", peer=who, uid=peer.uid, reason=refusal.message)
                            raise refusal
                    elif request.path != "/health":  # no slot of the owner's for a peer without the token
                        log.warning("http_unauthorized", peer=who, method=request.method[:16], path=request.path[:128])
                        raise ApiError(errors.UNAUTHORIZED, "this TCP listener needs "
                                                            "Authorization: Bearer <http.bearer_token>")
            except ApiError as exc:  # unreadable, too large, too slow or over a limit: answered, then closed
                await self._answer_early(stream, conn, exc, head_only=request is not None and request.method == "HEAD")
                return
            if request is None:
                return
            first = False
            responder = H11Responder(stream, conn, cfg.server.idle_timeout_s, head_only=request.method == "HEAD")
            started = time.monotonic()
            gone = await self._run(stream, conn, peer, request, responder, tcp)
            log.info("http_request", method=request.method, path=request.path, uid=peer.uid, status=responder.status,
                     client_gone=gone, elapsed_ms=round((time.monotonic() - started) * 1000, 1))
            if gone or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _answer_early(self, stream: trio.SocketStream, conn: h11.Connection, exc: ApiError, *,
                            head_only: bool = False) -> None:
        """An error reply before (or instead of) reading a request, if h11 still lets one go out."""
        responder = H11Responder(stream, conn, self.cfg.server.idle_timeout_s, head_only=head_only)
        try:
            await send_error(responder, exc)
        except (h11.LocalProtocolError, ClientGone):
            pass

    async def _read_request(self, stream: trio.SocketStream, conn: h11.Connection, *,
                            first: bool = False) -> HttpRequest | None:
        """The next request with its whole body, or None when the client closed or stayed idle.

        An idle connection waits server.idle_timeout_s for a request; once its first bytes
        arrive, the whole request must within server.line_timeout_s. A new connection's
        `first` request must arrive whole within server.first_request_timeout_s. A body longer
        than limits.max_line_bytes (the main socket's bound on a request) is refused, and so is
        a request with both Content-Length and Transfer-Encoding (RFC 9112 6.3: a smuggling
        attempt; the connection closes)."""
        server, limit = self.cfg.server, self.cfg.limits.max_line_bytes
        deadline = trio.current_time() + (server.first_request_timeout_s if first else server.idle_timeout_s)
        first_byte = conn.their_state is not h11.IDLE or bool(conn.trailing_data[0])
        if first_byte:
            deadline = min(deadline, trio.current_time() + server.line_timeout_s)
        head: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise ApiError(ErrorCode.BAD_REQUEST, f"not an HTTP/1.1 request npud can read ({exc})") from None
            if event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:  # curl's `Expect: 100-continue` for a large body
                    await H11Responder(stream, conn, server.idle_timeout_s).send_continue()
                data = None
                with trio.move_on_at(deadline):
                    try:
                        data = await stream.receive_some(RECEIVE_BYTES)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        data = b""
                if data is None:
                    if not first_byte:
                        return None  # idle: close quietly
                    raise ApiError(errors.REQUEST_TIMEOUT, f"the request did not arrive within "
                                                           f"{server.line_timeout_s} s (server.line_timeout_s)")
                if not data and not first_byte:
                    return None
                conn.receive_data(data)
                if not first_byte:
                    first_byte = True
                    deadline = min(deadline, trio.current_time() + server.line_timeout_s)
            elif isinstance(event, h11.Request):
                head = event
                names = {name for name, _ in event.headers}
                if b"content-length" in names and b"transfer-encoding" in names:
                    raise ApiError(ErrorCode.BAD_REQUEST, "a request may not have both Content-Length and "
                                                          "Transfer-Encoding (RFC 9112)")
                length = dict(event.headers).get(b"content-length")
                if length is not None and int(length) > limit:
                    raise ApiError(errors.REQUEST_TOO_LARGE, f"the body has {int(length)} bytes, more than "
                                                             f"limits.max_line_bytes = {limit}")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    raise ApiError(errors.REQUEST_TOO_LARGE, f"the body is longer than limits.max_line_bytes = {limit}")
            elif isinstance(event, h11.EndOfMessage):
                target = head.target.decode("ascii", "replace")
                return HttpRequest(head.method.decode("ascii", "replace"), target.split("?", 1)[0], bytes(body),
                                   _bearer(head.headers))
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _run(self, stream: trio.SocketStream, conn: h11.Connection, peer: Peer, request: HttpRequest,
                   responder: H11Responder, tcp: bool) -> bool:
        """Answer the request while watching the connection; returns True when the connection
        must close: the client went away first (the request, and its job, were cancelled), or it
        pipelined more than limits.max_line_bytes behind the request (discarded)."""
        self.server.requests_inflight += 1
        try:
            return await self._answer(stream, conn, peer, request, responder, tcp)
        finally:
            self.server.requests_inflight -= 1

    async def _answer(self, stream: trio.SocketStream, conn: h11.Connection, peer: Peer, request: HttpRequest,
                      responder: H11Responder, tcp: bool) -> bool:
        gone = overflow = False

        async def watch(cancel: trio.CancelScope) -> None:
            nonlocal gone, overflow
            buffered = 0
            while True:
                try:
                    data = await stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                if not data:
                    gone = True
                    cancel.cancel()
                    return
                buffered += len(data)
                if buffered > self.cfg.limits.max_line_bytes:
                    overflow = True  # read on (a disconnect must still be seen) but dropped: the
                    continue  # connection closes after this answer
                conn.receive_data(data)  # a pipelined request: h11 keeps it for the next cycle

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:  # caught here, not around the nursery: it would come out wrapped in an ExceptionGroup
                if tcp and not self._authorized(request):
                    await send_error(responder, ApiError(errors.UNAUTHORIZED, "this TCP listener needs "
                                                                              "Authorization: Bearer <http.bearer_token>"))
                else:
                    await self.app(peer, request, responder)
            except ClientGone:  # a send failed: the client stopped reading, or reset the connection
                gone = True
            nursery.cancel_scope.cancel()
        return gone or overflow

    def _authorized(self, request: HttpRequest) -> bool:
        return request.path == "/health" or self._has_token(request)

    def _has_token(self, request: HttpRequest) -> bool:
        """The request carries http.bearer_token (or none is configured)."""
        token = self.cfg.http.bearer_token
        if not token:
            return True
        return request.bearer is not None and hmac.compare_digest(request.bearer.encode(), token.encode())


def _bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None
