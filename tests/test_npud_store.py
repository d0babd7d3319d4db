"""The durable store: what survives, what is requeued, and how write failures are reported."""

import pytest

from npud.store import Store, StoreError


def _job(store, owner=1000, n=3, created=100.0):
    return store.insert_job(owner_uid=owner, priority="batch", interactive=False, model="m",
                            request={"prompts": ["a"] * n}, num_prompts=n, created_at=created)


def _ticket(tid, job, state="granted", outcome=None, reason=None):
    return {"ticket": tid, "job": job, "priority": "batch", "state": state, "outcome": outcome, "reason": reason,
            "queued_at": 1.0, "granted_at": 2.0, "released_at": None, "thermal_c": 50.0, "errors_at_grant": 0,
            "errors_at_release": None, "fault_lines": [], "tokens": 0, "drafted": 0, "accepted": 0}


def test_wal_mode_and_rows_survive_reopening(tmp_path):
    store = Store.open(tmp_path)
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    job = _job(store)
    store.add_result(job, 0, {"text": "x", "finish_reason": "stop"}, tokens=4)
    store.close()
    again = Store.open(tmp_path)
    row = again.job(job)
    assert row["state"] == "queued" and row["done_prompts"] == 1 and row["tokens"] == 4
    assert again.results(job) == [{"prompt": 0, "text": "x", "finish_reason": "stop"}]


def test_a_prompt_result_is_recorded_once(tmp_path):
    store = Store.open(tmp_path)
    job = _job(store)
    store.add_result(job, 1, {"text": "a"}, tokens=1)
    with pytest.raises(StoreError) as info:
        store.add_result(job, 1, {"text": "b"}, tokens=1)
    assert info.value.code == "store_error"
    assert store.results(job) == [{"prompt": 1, "text": "a"}] and store.job(job)["tokens"] == 1


def test_recover_requeues_running_jobs_and_closes_open_tickets(tmp_path):
    store = Store.open(tmp_path)
    running, queued, done = _job(store), _job(store), _job(store)
    store.set_job_state(running, "running", started_at=5.0)
    store.set_job_state(done, "done", finished_at=9.0)
    store.save_ticket(_ticket(1, running))
    store.save_ticket(_ticket(2, done, state="released", outcome="done"))
    assert store.recover(now=50.0) == 1
    unfinished = store.unfinished_jobs()
    assert [j["job"] for j in unfinished] == [running, queued]
    assert all(j["state"] == "queued" for j in unfinished) and unfinished[0]["request"] == {"prompts": ["a"] * 3}
    tickets = {t["ticket"]: t for t in store.tickets()}
    assert tickets[1]["outcome"] == "preempted" and tickets[1]["reason"] == "restart"
    assert tickets[1]["released_at"] == 50.0 and tickets[2]["outcome"] == "done"
    assert store.max_ticket_id() == 2


def test_ticket_filters_and_owner(tmp_path):
    store = Store.open(tmp_path)
    mine, theirs = _job(store, owner=1), _job(store, owner=2)
    store.save_ticket(_ticket(1, mine, state="released", outcome="done"))
    store.save_ticket(_ticket(2, theirs, state="released", outcome="faulted"))
    assert [t["ticket"] for t in store.tickets(owner_uid=1)] == [1]
    assert [t["ticket"] for t in store.tickets(outcome="faulted")] == [2]
    assert [t["ticket"] for t in store.tickets(job_id=mine)] == [1]
    assert store.tickets(since=1.5) == []
    store.save_ticket({**_ticket(1, mine, state="released", outcome="done"), "tokens": 9})
    assert store.tickets(job_id=mine)[0]["tokens"] == 9  # an update, not a second row
    assert store.ticket_counts() == {"done": 1, "faulted": 1}


def test_jobs_listing_by_owner_state_and_page(tmp_path):
    store = Store.open(tmp_path)
    ids = [_job(store, owner=1) for _ in range(5)] + [_job(store, owner=2)]
    store.set_job_state(ids[0], "done", finished_at=1.0)
    assert [j["job"] for j in store.jobs(owner_uid=1, limit=2)] == [ids[4], ids[3]]
    assert [j["job"] for j in store.jobs(owner_uid=1, before=ids[3])] == [ids[2], ids[1], ids[0]]
    assert [j["job"] for j in store.jobs(states=["done"])] == [ids[0]]
    assert store.job_counts() == {"done": 1, "queued": 5}


def test_retention_prunes_finished_history_only(tmp_path):
    store = Store.open(tmp_path)
    old, recent, unfinished = _job(store), _job(store), _job(store)
    store.set_job_state(old, "done", finished_at=10.0)
    store.set_job_state(recent, "done", finished_at=1000.0)
    store.add_result(old, 0, {"text": "x"}, tokens=1)
    store.save_ticket(_ticket(1, old, state="released", outcome="done"))
    assert store.prune(finished_before=500.0) == 1
    assert store.job(old) is None and store.results(old) == [] and store.tickets(job_id=old) == []
    assert store.job(recent) is not None and store.job(unfinished) is not None


def test_device_state_round_trip(tmp_path):
    store = Store.open(tmp_path)
    store.set_state("quarantine", {"reason": "r", "lines": ["l"]})
    assert Store.open(tmp_path).get_state("quarantine") == {"reason": "r", "lines": ["l"]}
    store.set_state("quarantine", None)
    assert store.get_state("quarantine") is None


def test_a_full_store_is_a_clear_error_and_nothing_half_written(tmp_path):
    store = Store.open(tmp_path)
    job = _job(store)
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store.set_page_limit(pages)
    with pytest.raises(StoreError) as info:
        store.add_result(job, 0, {"text": "x" * 200_000}, tokens=1)
    assert info.value.code == "store_full" and "full" in info.value.message
    assert store.results(job) == [] and store.job(job)["tokens"] == 0  # the transaction rolled back
    with pytest.raises(StoreError) as info:
        for _ in range(1000):
            _job(store)
    assert info.value.code == "store_full"


def test_a_read_only_store_is_a_clear_error(tmp_path):
    store = Store.open(tmp_path)
    store._conn.execute("PRAGMA query_only = 1")
    with pytest.raises(StoreError) as info:
        _job(store)
    assert info.value.code == "store_readonly"


def test_an_unusable_state_dir_is_reported_at_open(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError) as info:
        Store.open(tmp_path / "file" / "state")
    assert "state directory" in info.value.message


def test_a_corrupt_database_is_reported_at_open(tmp_path):
    (tmp_path / "npud.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError) as info:
        Store.open(tmp_path)
    assert info.value.code == "store_error" and "npud.sqlite3" in info.value.message


def test_a_schema_1_store_gains_the_firmware_column(tmp_path):
    import sqlite3

    conn = sqlite3.connect(tmp_path / "npud.sqlite3")
    conn.executescript("""
        CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, owner_uid INTEGER NOT NULL, priority TEXT NOT NULL,
            interactive INTEGER NOT NULL, model TEXT NOT NULL, request TEXT NOT NULL, num_prompts INTEGER NOT NULL,
            state TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL, finished_at REAL, error_code TEXT,
            error_message TEXT, tokens INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE tickets (id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
            priority TEXT NOT NULL, state TEXT NOT NULL, outcome TEXT, reason TEXT, queued_at REAL NOT NULL,
            granted_at REAL, released_at REAL, thermal_c REAL, errors_at_grant INTEGER, errors_at_release INTEGER,
            fault_lines TEXT NOT NULL DEFAULT '[]', tokens INTEGER NOT NULL DEFAULT 0,
            drafted INTEGER NOT NULL DEFAULT 0, accepted INTEGER NOT NULL DEFAULT 0);
        INSERT INTO jobs VALUES (1, 1000, 'batch', 0, 'm', '{}', 1, 'done', 1.0, 1.0, 2.0, NULL, NULL, 3);
        INSERT INTO tickets (id, job_id, priority, state, queued_at) VALUES (1, 1, 'batch', 'released', 1.0);
        PRAGMA user_version=1;
    """)
    conn.close()
    store = Store.open(tmp_path)
    assert store.tickets(job_id=1)[0]["fw_version"] is None  # the old ticket kept, no firmware known
    store.save_ticket({**_ticket(2, 1), "fw_version": "1.5.2.380"})
    assert store.tickets(job_id=1)[-1]["sequences"] == []  # and a schema 4 sequences column, empty
    assert [t["fw_version"] for t in store.tickets(job_id=1)] == ["1.5.2.380", None]
    assert store._conn.execute("PRAGMA user_version").fetchone()[0] == 4
    store.close()
    assert Store.open(tmp_path).tickets(job_id=1)[0]["fw_version"] == "1.5.2.380"  # reopening adds nothing twice
