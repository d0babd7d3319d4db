"""The Unix socket: listening, peer credentials, and one task per connection and per request.

Accepting is trio's `serve_listeners`. Each connection's task is a thin loop around its
sans-IO state (npud/connection.py: framing, limits, timeouts): it reads with the timeout the
state gives, feeds it the bytes, and runs each request it returns in its own task in the
connection's nursery, so a streaming request and a `status` share a connection. Whatever a
client sends, the answer is an error with a stable code on that connection, and every other
connection carries on.
"""

from __future__ import annotations

import collections
import grp
import itertools
import os
import pwd
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
import trio

from npud.config import DaemonConfig, ServerConfig
from npud.connection import ConnectionState, Limits
from npud.jobs import Caller
from npud.peers import fd_budget
from npud.protocol import ApiError, ErrorCode, Request, encode, error_reply, event, reply
from npud.systemd import inherited_listener

log = structlog.get_logger(__name__)

RECEIVE_BYTES = 65536
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(slots=True, frozen=True)
class Peer:
    conn: int
    pid: int
    uid: int
    gid: int
    caller: Caller


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


def is_admin(uid: int, gid: int, admin_group: str) -> bool:
    """Root, the user the daemon runs as (a per-user npud's user administers it), or a member
    of the admin group (primary or supplementary)."""
    if uid == 0 or uid == os.getuid():
        return True
    try:
        group = grp.getgrnam(admin_group)
    except KeyError:
        return False
    if gid == group.gr_gid:
        return True
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return user.pw_gid == group.gr_gid or user.pw_name in group.gr_mem


def _refuse_if_live(path: str) -> None:
    """Remove a stale socket file; raise if a daemon is listening on it."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    finally:
        probe.close()
    raise RuntimeError(f"another npud is already listening on {path}")


async def open_listener(cfg: DaemonConfig) -> tuple[trio.SocketListener, bool]:
    """The listening socket and whether it was passed by socket activation (systemd owns its
    file, mode and group then); else bind server.socket_path with the configured mode and group.

    Raises OSError/RuntimeError naming the path or what was passed.
    """
    inherited = inherited_listener()
    if inherited is not None:
        sock = trio.socket.from_stdlib_socket(inherited)
        return trio.SocketListener(sock), True
    return await bind_unix(cfg.server, cfg.server.socket_path), False


async def bind_unix(server: ServerConfig, path: str) -> trio.SocketListener:
    """A listening Unix socket at `path` with server.socket_mode and server.socket_group (the
    main socket's, and the HTTP front end's beside it). Raises OSError/RuntimeError."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.lexists(path):
        _refuse_if_live(path)
    gid = -1
    if server.socket_group:
        try:
            gid = grp.getgrnam(server.socket_group).gr_gid
        except KeyError:
            raise RuntimeError(f"server.socket_group {server.socket_group!r} does not exist") from None
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The socket file is created with the umask's mode; make it no wider than the target
    # before it exists, so no other user can connect in between bind and chmod.
    old_umask = os.umask(0o777 & ~server.socket_mode)
    try:
        await sock.bind(path)
    except OSError as exc:  # bind's own error names no path
        sock.close()
        raise OSError(exc.errno, f"cannot listen on a socket there ({exc.strerror})", path) from None
    finally:
        os.umask(old_umask)
    os.chmod(path, server.socket_mode)
    if gid != -1:
        os.chown(path, -1, gid)
    sock.listen(socket.SOMAXCONN)
    return trio.SocketListener(sock)


class Connection:
    def __init__(self, stream: trio.SocketStream, peer: Peer, send_timeout_s: float) -> None:
        self.stream = stream
        self.peer = peer
        self.send_timeout_s = send_timeout_s
        self.closed = False
        self._send_lock = trio.Lock()
        self.read_scope: trio.CancelScope | None = None  # the pending read; its deadline moves with the state

    async def send(self, message: dict) -> None:
        """Write one message; a client that stops reading for send_timeout_s is disconnected."""
        if self.closed:
            raise trio.ClosedResourceError("connection closed")
        data = encode(message)
        async with self._send_lock:
            try:
                with trio.fail_after(self.send_timeout_s):
                    await self.stream.send_all(data)
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.closed = True
                raise trio.ClosedResourceError("connection closed") from None


Handler = Callable[[Peer, Request, Callable[[str, dict], Awaitable[None]]], Awaitable[dict]]


class Server:
    def __init__(self, cfg: DaemonConfig, handler: Handler) -> None:
        self.cfg = cfg
        self.handler = handler
        self.connections = 0
        self.by_uid: collections.Counter[int] = collections.Counter()  # open connections per peer uid
        self.pending = 0  # HTTP TCP connections not yet counted (no authorized request yet)
        self.requests_inflight = 0  # requests of both front ends not yet answered (the drain waits for them)
        self.fd_budget = fd_budget()  # past this many connections, new ones are refused at accept
        self._ids = itertools.count(1)
        self._accept_scope: trio.CancelScope | None = None
        self._listener: trio.SocketListener | None = None
        self.socket_activated = False  # the socket file belongs to npud.socket: never unlinked here

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; started() once the socket accepts connections."""
        self._listener, self.socket_activated = await open_listener(self.cfg)
        if self.socket_activated:
            path = self._listener.socket.getsockname()
            log.info("socket_inherited", path=path, socket_path=self.cfg.server.socket_path)
            if path != self.cfg.server.socket_path:
                # clients find npud through server.socket_path ($NPUD_SOCKET aside)
                log.warning("socket_path_mismatch", path=path, socket_path=self.cfg.server.socket_path)
        else:
            log.info("socket_listening", path=self.cfg.server.socket_path, mode=oct(self.cfg.server.socket_mode),
                     group=self.cfg.server.socket_group or None)
        try:
            async with trio.open_nursery() as conns:
                with trio.CancelScope() as self._accept_scope:
                    task_status.started()
                    # retries only what a full process table or memory makes accept() fail with
                    await trio.serve_listeners(self.handle, [self._listener], handler_nursery=conns)
                self._close_listener()
                # accepting has stopped; existing connections carry on until the daemon ends
        finally:
            self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.socket.close()
            self._listener = None
            if self.socket_activated:
                return  # systemd keeps listening and queues connections until npud runs again
            try:
                os.unlink(self.cfg.server.socket_path)
            except FileNotFoundError:
                pass

    def stop_accepting(self) -> None:
        if self._accept_scope is not None:
            self._accept_scope.cancel()

    async def handle(self, stream: trio.SocketStream) -> None:
        conn_id = next(self._ids)
        self.connections += 1
        try:
            with structlog.contextvars.bound_contextvars(conn=conn_id):
                await self._handle(stream, conn_id)
        except Exception:
            log.exception("connection_error", conn=conn_id)
        finally:
            self.connections -= 1
            await trio.aclose_forcefully(stream)

    def count(self, uid: int) -> Callable[[], None]:
        """Count a connection of `uid` (in `connections` and `by_uid`); returns the uncount."""
        self.connections += 1
        self.by_uid[uid] += 1

        def release() -> None:
            self.connections -= 1
            self.by_uid[uid] -= 1
            if not self.by_uid[uid]:
                del self.by_uid[uid]
        return release

    def short_of_descriptors(self) -> bool:
        """Connections (counted and pending) have taken the descriptors npud may give them: new
        ones are refused, so the store, the models and the guards keep theirs (npud/peers.py)."""
        return self.connections + self.pending > self.fd_budget

    def refusal(self, uid: int, admin: bool) -> ApiError | None:
        """Why a new connection of `uid` is refused, or None. Counts include it. One uid holds at
        most max_connections_per_uid, and the last admin_reserved_connections slots are kept for
        root and the admin group, so an operator can act while someone holds every other slot.
        Nobody gets a connection past the descriptor budget."""
        server = self.cfg.server
        if self.short_of_descriptors():
            log.warning("descriptors_low", connections=self.connections, pending=self.pending, budget=self.fd_budget)
            return ApiError(ErrorCode.OVERLOADED, "npud is short of file descriptors; try again later")
        if self.connections > server.max_connections:
            return ApiError(ErrorCode.OVERLOADED,
                            f"npud has {server.max_connections} connections, its limit (server.max_connections)")
        if admin:
            return None
        if self.by_uid[uid] > server.max_connections_per_uid:
            return ApiError(ErrorCode.OVERLOADED, f"uid {uid} has {server.max_connections_per_uid} connections, "
                                                  "its limit (server.max_connections_per_uid)")
        if self.connections > server.max_connections - server.admin_reserved_connections:
            return ApiError(ErrorCode.OVERLOADED,
                            f"npud has {server.max_connections - server.admin_reserved_connections} connections; "
                            "the rest are reserved for the admin group (server.admin_reserved_connections)")
        return None

    async def _handle(self, stream: trio.SocketStream, conn_id: int) -> None:
        server = self.cfg.server
        try:
            pid, uid, gid = peer_credentials(stream.socket)
        except OSError as exc:
            log.warning("peer_credentials_failed", error=exc.strerror)
            return
        peer = Peer(conn_id, pid, uid, gid, Caller(uid, is_admin(uid, gid, server.admin_group)))
        conn = Connection(stream, peer, server.idle_timeout_s)
        self.by_uid[uid] += 1
        try:
            refusal = self.refusal(uid, peer.caller.admin)
            if refusal is not None:
                log.warning("connection_refused", uid=uid, pid=pid, reason=refusal.message)
                await self._send_quietly(conn, error_reply(None, refusal))
                return
            log.debug("connection_opened", uid=uid, pid=pid)
            await self._serve_connection(conn)
        finally:
            self.by_uid[uid] -= 1
            if not self.by_uid[uid]:
                del self.by_uid[uid]

    async def _serve_connection(self, conn: Connection) -> None:
        stream = conn.stream
        state = ConnectionState(Limits.from_config(self.cfg), trio.current_time())
        async with trio.open_nursery() as tasks:
            while not conn.closed:
                data = None
                with trio.CancelScope(deadline=state.deadline()) as conn.read_scope:
                    try:
                        data = await stream.receive_some(RECEIVE_BYTES)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        data = b""
                conn.read_scope = None
                if data is None:
                    for message in state.timed_out():
                        await self._send_quietly(conn, message)
                    break
                if not data:
                    break  # the client closed its end
                for item in state.receive(data, trio.current_time()):
                    if isinstance(item, Request):
                        tasks.start_soon(self._run_request, conn, state, item)
                    else:
                        await self._send_quietly(conn, item)
            tasks.cancel_scope.cancel()  # the client is gone: its streams and completions end
        conn.closed = True
        log.debug("connection_closed")

    async def _run_request(self, conn: Connection, state: ConnectionState, req: Request) -> None:
        async def emit(name: str, data: dict) -> None:
            await conn.send(event(req.id, name, data))

        self.requests_inflight += 1
        try:
            try:
                result = await self.handler(conn.peer, req, emit)
                message = reply(req.id, result)
            except ApiError as exc:
                message = error_reply(req.id, exc)
            except trio.ClosedResourceError:
                return  # the client went away while we streamed to it
            except Exception:  # the traceback goes to the log, never to the client
                log.exception("internal_error", method=req.method)
                message = error_reply(req.id, ApiError(ErrorCode.INTERNAL_ERROR,
                                                       "the request failed in the daemon; its log has the details"))
            await self._send_quietly(conn, message)
        finally:
            self.requests_inflight -= 1
            state.finished(trio.current_time())
            if conn.read_scope is not None:  # the last reply re-arms the idle deadline of the pending read
                conn.read_scope.deadline = state.deadline()

    @staticmethod
    async def _send_quietly(conn: Connection, message: dict) -> None:
        try:
            await conn.send(message)
        except trio.ClosedResourceError:
            pass
