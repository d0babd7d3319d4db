"""Opaque job references for HTTP replies (issue 26).

Job ids count up across the daemon's life, so an id in a reply would tell an HTTP client how
much work other users submitted between two of its requests. HTTP replies name a job by its
reference instead: the 64-bit job id put through a keyed permutation (a six-round Feistel
network whose round function is HMAC-SHA256 under a random 32-byte key kept in the store), as
16 hex digits. The same job has the same reference for as long as the store keeps the key, across
restarts; a reference turns back into its id without a lookup, so every method that takes a job
(`status`, `result`, `stream`, `cancel`, `tickets`) takes either. Without the key, references
of consecutive jobs look unrelated, and a guessed reference names a job id at random (which the
owner check then answers `not_found`, as any job of another user).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

import structlog

from npud.store import Store, StoreError

log = structlog.get_logger(__name__)

KEY_STATE = "job_ref_key"  # the store's device_state key the key is kept under (hex)
REF = re.compile(r"^[0-9a-f]{16}$")
ROUNDS = 6
_MASK32 = 0xFFFFFFFF


class JobRefs:
    """The keyed permutation of 64-bit job ids and its inverse."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key if key is not None else secrets.token_bytes(32)

    def _f(self, round_: int, half: int) -> int:
        digest = hmac.new(self.key, bytes([round_]) + half.to_bytes(4, "big"), hashlib.sha256).digest()
        return int.from_bytes(digest[:4], "big")

    def ref(self, job_id: int) -> str:
        """The reference of a job id (0 < id < 2**63)."""
        left, right = job_id >> 32, job_id & _MASK32
        for i in range(ROUNDS):
            left, right = right, left ^ self._f(i, right)
        return f"{(left << 32) | right:016x}"

    def job_id(self, ref: str) -> int | None:
        """The 64-bit number a reference stands for (a job id when npud made it: in (0, 2**63)),
        or None when the text is not 16 lowercase hex digits."""
        if not isinstance(ref, str) or not REF.match(ref):
            return None
        value = int(ref, 16)
        left, right = value >> 32, value & _MASK32
        for i in reversed(range(ROUNDS)):
            left, right = right ^ self._f(i, left), left
        return (left << 32) | right


def stored_refs(store: Store) -> JobRefs:
    """The references under the key kept in the store, made and kept there on the first start,
    so that a reference names the same job after a restart. A store that cannot be read or
    written gives this run a key of its own (its references last until the next start)."""
    try:
        key = store.get_state(KEY_STATE)
        if not (isinstance(key, str) and re.fullmatch(r"[0-9a-f]{64}", key)):
            key = secrets.token_hex(32)
            store.set_state(KEY_STATE, key)
        return JobRefs(bytes.fromhex(key))
    except StoreError as exc:
        log.warning("job_ref_key_unsaved", error=exc.message)
        return JobRefs()
