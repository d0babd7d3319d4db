"""The durable store: jobs, per-prompt results and tickets in SQLite (WAL) under the state dir.

Synchronous and thread-confined by the caller (npud/jobs.py runs every call in one worker
thread at a time). Every write is its own transaction with synchronous=FULL: when a call
returns, the row survives a crash or a power loss. Write failures become StoreError with a
stable code, so a full disk reaches the client as `store_full`, never as a silent loss. (The
store knows nothing of the protocol: npud/jobs.py turns a StoreError into the error a client
sees.)
"""

from __future__ import annotations

import enum
import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

DB_NAME = "npud.sqlite3"
SCHEMA_VERSION = 4  # 2: tickets.fw_version; 3: jobs.idempotency_key; 4: tickets.sequences (each migration checks its column)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner_uid INTEGER NOT NULL,
    priority TEXT NOT NULL,
    interactive INTEGER NOT NULL,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    num_prompts INTEGER NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    error_code TEXT,
    error_message TEXT,
    tokens INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner_uid, id);
CREATE TABLE IF NOT EXISTS results (
    job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    prompt INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (job_id, prompt)
);
CREATE TABLE IF NOT EXISTS tickets (
    id INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    priority TEXT NOT NULL,
    state TEXT NOT NULL,
    outcome TEXT,
    reason TEXT,
    queued_at REAL NOT NULL,
    granted_at REAL,
    released_at REAL,
    thermal_c REAL,
    errors_at_grant INTEGER,
    errors_at_release INTEGER,
    fault_lines TEXT NOT NULL DEFAULT '[]',
    tokens INTEGER NOT NULL DEFAULT 0,
    drafted INTEGER NOT NULL DEFAULT 0,
    accepted INTEGER NOT NULL DEFAULT 0,
    fw_version TEXT,
    sequences TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS tickets_job ON tickets(job_id);
CREATE TABLE IF NOT EXISTS device_state (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

UNFINISHED = ("queued", "running")
_TICKET_COLUMNS = ("id", "job_id", "priority", "state", "outcome", "reason", "queued_at", "granted_at",
                   "released_at", "thermal_c", "errors_at_grant", "errors_at_release", "fault_lines",
                   "tokens", "drafted", "accepted", "fw_version", "sequences")


class StoreCode(enum.StrEnum):
    """Why the store failed; the values are the protocol's codes for the same failures."""

    FULL = "store_full"
    READONLY = "store_readonly"
    ERROR = "store_error"


class StoreError(Exception):
    """The store could not be read or written; `code` (a StoreCode) says how, `message` says
    what it was doing."""

    def __init__(self, code: StoreCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _store_error(exc: sqlite3.Error, path: Path, doing: str) -> StoreError:
    code = getattr(exc, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    if primary == sqlite3.SQLITE_FULL:
        return StoreError(StoreCode.FULL, f"the job store {path} is full (no space left) while {doing}; "
                                                "nothing was recorded")
    if primary in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_CANTOPEN):
        return StoreError(StoreCode.READONLY, f"the job store {path} is not writable while {doing}: {exc}")
    return StoreError(StoreCode.ERROR, f"the job store {path} failed while {doing}: {exc}")


class Store:
    """One SQLite database; open with Store.open(state_dir)."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path

    @classmethod
    def open(cls, state_dir: str | Path) -> "Store":
        """Open (creating if needed) the store; raises StoreError with a clear message."""
        state = Path(state_dir)
        path = state / DB_NAME
        try:
            state.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(StoreCode.READONLY, f"cannot create the state directory {state}: {exc.strerror}") from None
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.executescript(_SCHEMA)
            columns = {r["name"] for r in conn.execute("PRAGMA table_info(tickets)")}
            if "fw_version" not in columns:  # a store written by schema 1
                conn.execute("ALTER TABLE tickets ADD COLUMN fw_version TEXT")
            if "sequences" not in columns:  # a store written before schema 4
                conn.execute("ALTER TABLE tickets ADD COLUMN sequences TEXT NOT NULL DEFAULT '[]'")
            columns = {r["name"] for r in conn.execute("PRAGMA table_info(jobs)")}
            if "idempotency_key" not in columns:  # a store written before schema 3
                conn.execute("ALTER TABLE jobs ADD COLUMN idempotency_key TEXT")
            conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs(owner_uid, idempotency_key)"
                         " WHERE idempotency_key IS NOT NULL")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise _store_error(exc, path, "opening") from None
        return cls(conn, path)

    def close(self) -> None:
        self._conn.close()

    def _write(self, doing: str, statements: Iterable[tuple[str, tuple]]) -> list[sqlite3.Cursor]:
        cursors = []
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    cursors.append(self._conn.execute(sql, args))
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _store_error(exc, self.path, doing) from None
        return cursors

    def _read(self, doing: str, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise _store_error(exc, self.path, doing) from None

    # -- jobs ----------------------------------------------------------------------------

    def insert_job(self, *, owner_uid: int, priority: str, interactive: bool, model: str, request: dict,
                   num_prompts: int, created_at: float, idempotency_key: str | None = None) -> int:
        """Store a new job as queued; returns its id. At most one job per (owner, key): a
        second insert with the same key fails (StoreError); look it up with job_by_key first."""
        (cur,) = self._write("accepting a job", [(
            "INSERT INTO jobs (owner_uid, priority, interactive, model, request, num_prompts, state, created_at,"
            " idempotency_key) VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?)",
            (owner_uid, priority, int(interactive), model, json.dumps(request), num_prompts, created_at,
             idempotency_key),
        )])
        return int(cur.lastrowid)

    def job_by_key(self, owner_uid: int, idempotency_key: str) -> dict | None:
        """{"job", "priority", "request"} of the owner's job submitted with that key, or None."""
        rows = self._read("looking up an idempotency key",
                          "SELECT id, priority, request FROM jobs WHERE owner_uid = ? AND idempotency_key = ?",
                          (owner_uid, idempotency_key))
        if not rows:
            return None
        return {"job": rows[0]["id"], "priority": rows[0]["priority"], "request": json.loads(rows[0]["request"])}

    def set_job_state(self, job_id: int, state: str, *, started_at: float | None = None,
                      finished_at: float | None = None, error: dict | None = None,
                      ticket: dict | None = None) -> None:
        """Update a job's state (`error`: {"code", "message"} of a failed job), and with `ticket`
        (its wire form) save that ticket in the same commit."""
        statements = [] if ticket is None else [_ticket_upsert(ticket)]
        statements.append((
            "UPDATE jobs SET state = ?, started_at = COALESCE(started_at, ?), finished_at = ?,"
            " error_code = ?, error_message = ? WHERE id = ?",
            (state, started_at, finished_at, None if error is None else error["code"],
             None if error is None else error["message"], job_id),
        ))
        self._write("updating a job", statements)

    def add_result(self, job_id: int, prompt: int, body: dict, tokens: int, *, ticket: dict | None = None) -> None:
        """Record one prompt's result (exactly once: a second one for the same prompt is an error),
        and with `ticket` (its wire form) the ticket it was made under, in the same commit."""
        self._write("recording a result", [
            ("INSERT INTO results (job_id, prompt, body) VALUES (?, ?, ?)", (job_id, prompt, json.dumps(body))),
            ("UPDATE jobs SET tokens = tokens + ? WHERE id = ?", (tokens, job_id)),
            *([] if ticket is None else [_ticket_upsert(ticket)]),
        ])

    def job(self, job_id: int) -> dict | None:
        rows = self._read("reading a job", f"SELECT {_JOB_SELECT} FROM jobs WHERE id = ?", (job_id,))
        return _job_row(rows[0]) if rows else None

    def jobs(self, *, owner_uid: int | None = None, states: Iterable[str] | None = None, limit: int = 50,
             before: int | None = None) -> list[dict]:
        where, args = [], []
        if owner_uid is not None:
            where.append("owner_uid = ?")
            args.append(owner_uid)
        if states:
            states = list(states)
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if before is not None:
            where.append("id < ?")
            args.append(before)
        sql = f"SELECT {_JOB_SELECT} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        return [_job_row(r) for r in self._read("listing jobs", sql, (*args, limit))]

    def unfinished_jobs(self) -> list[dict]:
        """Jobs to requeue after a restart, oldest first, each with its request and done prompts."""
        rows = self._read("recovering jobs",
                          f"SELECT {_JOB_SELECT}, request FROM jobs WHERE state IN ('queued', 'running') ORDER BY id")
        out = []
        for r in rows:
            job = _job_row(r)
            job["request"] = json.loads(r["request"])
            out.append(job)
        return out

    def results(self, job_id: int, prompts: Iterable[int] | None = None) -> list[dict]:
        rows = self._read("reading results", "SELECT prompt, body FROM results WHERE job_id = ? ORDER BY prompt",
                          (job_id,))
        wanted = None if prompts is None else set(prompts)
        return [{"prompt": r["prompt"], **json.loads(r["body"])} for r in rows
                if wanted is None or r["prompt"] in wanted]

    def job_counts(self, owner_uid: int | None = None) -> dict[str, int]:
        """Jobs by state: every user's, or `owner_uid`'s only."""
        if owner_uid is None:
            rows = self._read("counting jobs", "SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        else:
            rows = self._read("counting jobs", "SELECT state, COUNT(*) AS n FROM jobs WHERE owner_uid = ?"
                              " GROUP BY state", (owner_uid,))
        return {r["state"]: r["n"] for r in rows}

    # -- tickets -------------------------------------------------------------------------

    def save_ticket(self, ticket: dict) -> None:
        """Insert or update a ticket from its wire form."""
        self._write("recording a ticket", [_ticket_upsert(ticket)])

    def tickets(self, *, job_id: int | None = None, owner_uid: int | None = None, state: str | None = None,
                outcome: str | None = None, since: float | None = None, until: float | None = None,
                limit: int = 100) -> list[dict]:
        """Tickets newest first; `job_id` and `owner_uid` match the ticket's own job and the
        jobs whose sequences rode it in a batch."""
        where, args = [], []
        rode = "EXISTS (SELECT 1 FROM json_each(t.sequences) s WHERE json_extract(s.value, '$.{}') = ?)"
        for clause, value in (("(t.job_id = ? OR " + rode.format("job") + ")", job_id),
                              ("(j.owner_uid = ? OR " + rode.format("owner_uid") + ")", owner_uid),
                              ("t.state = ?", state),
                              ("t.outcome = ?", outcome), ("t.queued_at >= ?", since),
                              ("t.queued_at < ?", until)):
            if value is not None:
                where.append(clause)
                args.extend([value] * clause.count("?"))
        sql = (f"SELECT {', '.join('t.' + c for c in _TICKET_COLUMNS)}, j.owner_uid AS owner_uid"
               " FROM tickets t JOIN jobs j ON j.id = t.job_id")
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY t.id DESC LIMIT ?"
        return [_ticket_row(r) for r in self._read("listing tickets", sql, (*args, limit))]

    def max_ticket_id(self) -> int:
        rows = self._read("reading ticket ids", "SELECT COALESCE(MAX(id), 0) AS m FROM tickets")
        return int(rows[0]["m"])

    def ticket_counts(self, owner_uid: int | None = None) -> dict[str, int]:
        """Ended tickets by outcome: every user's, or those of `owner_uid`'s jobs only."""
        if owner_uid is None:
            rows = self._read("counting tickets",
                              "SELECT outcome, COUNT(*) AS n FROM tickets WHERE outcome IS NOT NULL GROUP BY outcome")
        else:
            rows = self._read("counting tickets",
                              "SELECT t.outcome, COUNT(*) AS n FROM tickets t JOIN jobs j ON j.id = t.job_id"
                              " WHERE t.outcome IS NOT NULL AND j.owner_uid = ? GROUP BY t.outcome", (owner_uid,))
        return {r["outcome"]: r["n"] for r in rows}

    def recover(self, now: float) -> int:
        """After a restart: close the tickets that were open when the daemon stopped, and put
        running jobs back to queued. Returns the number of tickets closed."""
        (cur, _) = self._write("recovering after a restart", [
            ("UPDATE tickets SET state = 'released', outcome = 'preempted', reason = 'restart',"
             " released_at = ? WHERE state != 'released'", (now,)),
            ("UPDATE jobs SET state = 'queued' WHERE state = 'running'", ()),
        ])
        return cur.rowcount

    # -- device state and retention -------------------------------------------------------

    def get_state(self, key: str) -> object:
        """The JSON value recorded under `key`, or None."""
        rows = self._read("reading device state", "SELECT value FROM device_state WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else None

    def set_state(self, key: str, value: object) -> None:
        """Record a JSON value under `key` (None deletes it)."""
        if value is None:
            self._write("clearing device state", [("DELETE FROM device_state WHERE key = ?", (key,))])
        else:
            self._write("recording device state", [(
                "INSERT INTO device_state (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, json.dumps(value)))])

    def prune(self, finished_before: float) -> int:
        """Delete finished jobs (with their results and tickets) older than the cutoff."""
        (cur,) = self._write("pruning history", [(
            "DELETE FROM jobs WHERE state NOT IN ('queued', 'running') AND finished_at < ?", (finished_before,))])
        return cur.rowcount

    def set_page_limit(self, pages: int) -> None:
        """Cap the database size in pages (SQLite's max_page_count); used to exercise a full store."""
        self._conn.execute(f"PRAGMA max_page_count = {int(pages)}")


_JOB_SELECT = ("id, owner_uid, priority, interactive, model, num_prompts, state, created_at, started_at,"
               " finished_at, error_code, error_message, tokens,"
               " (SELECT COUNT(*) FROM results r WHERE r.job_id = jobs.id) AS done_prompts,"
               " (SELECT COUNT(*) FROM tickets t WHERE t.job_id = jobs.id) AS num_tickets")


def _ticket_upsert(ticket: dict) -> tuple[str, tuple]:
    values = (ticket["ticket"], ticket["job"], ticket["priority"], ticket["state"], ticket["outcome"],
              ticket["reason"], ticket["queued_at"], ticket["granted_at"], ticket["released_at"],
              ticket["thermal_c"], ticket["errors_at_grant"], ticket["errors_at_release"],
              json.dumps(ticket["fault_lines"]), ticket["tokens"], ticket["drafted"], ticket["accepted"],
              ticket.get("fw_version"), json.dumps(ticket.get("sequences", [])))
    updates = ", ".join(f"{c} = excluded.{c}" for c in _TICKET_COLUMNS[1:])
    return (f"INSERT INTO tickets ({', '.join(_TICKET_COLUMNS)}) VALUES ({', '.join('?' * len(_TICKET_COLUMNS))})"
            f" ON CONFLICT(id) DO UPDATE SET {updates}", values)


def _job_row(r: sqlite3.Row) -> dict:
    return {
        "job": r["id"], "owner_uid": r["owner_uid"], "state": r["state"], "priority": r["priority"],
        "interactive": bool(r["interactive"]), "model": r["model"], "num_prompts": r["num_prompts"],
        "done_prompts": r["done_prompts"], "tokens": r["tokens"], "tickets": r["num_tickets"],
        "created_at": r["created_at"], "started_at": r["started_at"], "finished_at": r["finished_at"],
        "cancel_requested": False,
        "error": None if r["error_code"] is None else {"code": r["error_code"], "message": r["error_message"]},
    }


def _ticket_row(r: sqlite3.Row) -> dict:
    out = {("ticket" if c == "id" else "job" if c == "job_id" else c): r[c] for c in _TICKET_COLUMNS}
    out["fault_lines"] = json.loads(out["fault_lines"])
    out["sequences"] = json.loads(out["sequences"])
    out["owner_uid"] = r["owner_uid"]
    out["jobs"] = [out["job"], *dict.fromkeys(s["job"] for s in out["sequences"] if s["job"] != out["job"])]
    return out

