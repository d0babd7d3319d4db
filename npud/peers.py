"""Who is at the other end of a TCP connection, and how many descriptors npud may hold.

A TCP peer sends no credentials, but on the loopback interface its socket is one of this
host's: /proc/net/tcp (tcp6) lists it with the uid that owns it. The HTTP front end uses that
uid, or else the peer's address, to count a peer's connections that have not yet sent an
authorized request, and to name the peer in its log. Nothing is granted on it: a TCP request
still acts as http.tcp_owner_uid once its bearer token checks out.
"""

from __future__ import annotations

import ipaddress
import resource
import struct

import structlog

log = structlog.get_logger(__name__)

FD_RESERVE_MIN = 64  # descriptors kept for the store, the models, the guards, the log, threads


def _hex_address(host: str) -> str:
    """An address as /proc/net/tcp* spells it: 32-bit words in host byte order, in hex."""
    ip = ipaddress.ip_address(host)
    packed = ip.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words)


def tcp_peer_uid(local: tuple, remote: tuple, *, proc: str = "/proc/net") -> int | None:
    """The uid owning the socket at `remote` connected to our `local` (host, port, ...), when
    that socket is on this host (a loopback peer); None when it cannot be found."""
    try:
        ip = ipaddress.ip_address(remote[0])
        if not ip.is_loopback:
            return None
        table = "tcp6" if ip.version == 6 else "tcp"
        # the peer's own row: its local address is our remote one and the reverse
        needle = f" {_hex_address(remote[0])}:{remote[1]:04X} {_hex_address(local[0])}:{local[1]:04X} ".encode()
        with open(f"{proc}/{table}", "rb") as f:
            data = f.read()
    except (OSError, ValueError, IndexError):
        return None
    at = data.find(needle)
    if at < 0:
        return None
    end = data.find(b"\n", at)
    line = data[at:end if end >= 0 else len(data)].split()
    try:  # local rem st tx:rx tr:when retrnsmt uid ...
        return int(line[6])
    except (IndexError, ValueError):
        return None


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (a service's LimitNOFILE=); returns the soft
    limit now in force. A process cannot go past its hard limit, so this never fails."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("nofile_limit_raised", soft=soft, to=hard)
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("nofile_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    return soft


def fd_budget() -> int:
    """How many connections npud may hold: the soft RLIMIT_NOFILE less a reserve (an eighth,
    at least FD_RESERVE_MIN) that the store, the models and the guards keep when clients take
    the rest; past it new connections are refused at accept."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, soft - max(FD_RESERVE_MIN, soft // 8))


def peer_name(remote: tuple) -> str:
    """host:port of a TCP peer, for the log."""
    host, port = remote[0], remote[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

