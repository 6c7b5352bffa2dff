"""The ledger's database on SQLite and PostgreSQL: the URLs users write, the Alembic migrations on an
empty database and from each earlier revision, trackers opening one database at once, and 50 nodes
registering, heartbeating and reporting work at once through a real tracker. Tests taking
``ledger_url`` run on both databases (PostgreSQL skips, saying why, without
``$MESHNET_TEST_POSTGRES_URL``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from ledger_db import fresh_database, ledger_url, needs_postgres  # noqa: F401 - ledger_url: the fixture
from meshnet.ledger.database import alembic_config, make_ledger_engine, normalise_url
from meshnet.ledger.schema import metadata
from meshnet.ledger.store import Ledger, LedgerError, WorkRecord
from meshnet.membership.identity import NodeIdentity
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.server import serve_tracker
from meshnet.wire.security import open_channel
from test_ledger import SHA, node_info

TABLES = {"work", "deliveries", "node_keys", "alembic_version"}


# ---- URLs ----------------------------------------------------------------------------------------------

def test_a_bare_postgresql_url_gets_the_psycopg_driver(monkeypatch):
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("psycopg is not installed (pip install 'meshnet[postgres]')")
    for written in ("postgresql://alice:s3cret@db.example:5433/ledger", "postgres://alice:s3cret@db.example:5433/ledger",
                    "postgresql+psycopg://alice:s3cret@db.example:5433/ledger"):
        u = normalise_url(written)
        assert (u.drivername, u.username, u.password, u.host, u.port, u.database) == \
            ("postgresql+psycopg", "alice", "s3cret", "db.example", 5433, "ledger")
    # A driver the user named is kept; SQLite is left alone.
    assert normalise_url("postgresql+psycopg2://a@h/d").drivername == "postgresql+psycopg2"
    assert normalise_url("sqlite:///x.db").drivername == "sqlite"
    # Without psycopg, a bare URL goes to SQLAlchemy's default PostgreSQL driver.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert normalise_url("postgresql://a@h/d").drivername == "postgresql"


def test_an_unreachable_postgresql_server_is_named_without_its_password():
    with pytest.raises(LedgerError) as ei:
        Ledger("postgresql://alice:s3cret@127.0.0.1:1/ledger")
    message = str(ei.value)
    assert "127.0.0.1:1/ledger" in message and "s3cret" not in message


def test_a_ledger_of_another_release_a_damaged_one_and_a_garbage_file_are_refused_in_one_line(tmp_path):
    """A schema revision this release does not know (a newer meshnet's), a ledger missing a table or a
    column, and a file that is not a database are refused when the tracker opens them, each in one line
    naming the database and what is wrong (no SQL, no traceback)."""
    newer = tmp_path / "newer.db"
    Ledger(f"sqlite:///{newer}").close()
    with make_ledger_engine(f"sqlite:///{newer}").begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'deadbeef'"))
    with pytest.raises(LedgerError) as ei:
        Ledger(f"sqlite:///{newer}")
    assert "Can't locate revision identified by 'deadbeef'" in str(ei.value)
    assert "its schema comes from another meshnet release" in str(ei.value) and "\n" not in str(ei.value)

    damaged = tmp_path / "damaged.db"
    Ledger(f"sqlite:///{damaged}").close()
    with make_ledger_engine(f"sqlite:///{damaged}").begin() as conn:
        conn.execute(text("DROP TABLE deliveries"))
        conn.execute(text("ALTER TABLE node_keys DROP COLUMN bound_at"))
    with pytest.raises(LedgerError) as ei:
        Ledger(f"sqlite:///{damaged}")
    assert str(ei.value) == (f"ledger sqlite:///{damaged} is at the newest schema revision but lacks table "
                             "deliveries, column node_keys.bound_at: it is damaged or not a meshnet ledger; give "
                             "--ledger another database")

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database " * 100)
    with pytest.raises(LedgerError) as ei:
        Ledger(f"sqlite:///{garbage}")
    assert str(ei.value) == f"cannot open or migrate ledger sqlite:///{garbage}: file is not a database"


def test_a_ledger_failing_under_a_running_tracker_answers_in_one_line(tmp_path):
    """Reads and writes that fail once the tracker runs (a table dropped behind its back) are LedgerError
    with the driver's one line, which the tracker answers UNAVAILABLE."""
    path = tmp_path / "l.db"
    ledger = Ledger(f"sqlite:///{path}")
    with make_ledger_engine(f"sqlite:///{path}").begin() as conn:
        conn.execute(text("DROP TABLE deliveries"))
    with pytest.raises(LedgerError) as ei:
        ledger.client_balances()
    assert str(ei.value) == "ledger read failed: no such table: deliveries"
    with pytest.raises(LedgerError) as ei:
        ledger.record_deliveries("c", [("s", 0)])
    assert str(ei.value) == "ledger write failed: no such table: deliveries"
    server, port = serve_tracker("127.0.0.1", 0, ledger=ledger)
    try:
        with open_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as ei:
            pb_grpc.TrackerStub(ch).GetLedger(pb.Empty(), timeout=5)
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        assert ei.value.details() == "GetLedger: ledger read failed: no such table: deliveries"
    finally:
        server.stop(None)
        ledger.close()


@needs_postgres
def test_both_spellings_of_a_postgresql_url_open_the_same_ledger(tmp_path):
    with fresh_database("postgresql", tmp_path) as url:
        bare = url.replace("postgresql+psycopg://", "postgresql://", 1)
        first = Ledger(bare)
        assert first.display_url.startswith("postgresql+psycopg://")
        assert first.record_deliveries("alice", [("s", 0), ("s", 1)]) == (2, 0)
        first.close()
        second = Ledger(bare.replace("postgresql://", "postgresql+psycopg://", 1))
        assert second.record_deliveries("alice", [("s", 1), ("s", 2)]) == (1, 1)
        assert [(c.client_id, c.delivered_tokens) for c in second.client_balances()] == [("alice", 3)]
        second.close()


# ---- migrations ----------------------------------------------------------------------------------------

def schema_problems(engine) -> list:
    """What differs between the migrated database and :mod:`meshnet.ledger.schema` (empty: nothing)."""
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), metadata)


def migrate(engine, verb: str, target: str) -> None:
    """``alembic upgrade|downgrade TARGET`` on the ledger's migrations."""
    with engine.begin() as conn:
        getattr(command, verb)(alembic_config(conn), target)


def test_migrations_build_the_declared_schema_on_an_empty_database(ledger_url):
    engine = make_ledger_engine(ledger_url)
    try:
        assert inspect(engine).get_table_names() == []
        Ledger(ledger_url).close()
        assert set(inspect(engine).get_table_names()) == TABLES
        assert schema_problems(engine) == []
        columns = {c["name"]: c for c in inspect(engine).get_columns("work")}
        assert len(columns) == 12 and not any(c["nullable"] for c in columns.values())
        assert (str(columns["position"]["type"]), str(columns["credited_token_layers"]["type"])) == ("BIGINT", "BIGINT")
        uniques = {u["name"]: u["column_names"] for u in inspect(engine).get_unique_constraints("work")}
        assert uniques["uq_work_step"] == ["model_sha256", "session_id", "layer_start", "layer_end", "position",
                                           "n_tokens"]
    finally:
        engine.dispose()


def test_each_revision_upgrades_to_head_and_downgrades_back(ledger_url):
    """From every revision (the first one: from an empty database) ``upgrade head`` reaches the declared
    schema and a ledger that credits work; ``downgrade base`` leaves no table behind, and ``upgrade head``
    builds it all again. A new revision joins the walk by itself."""
    engine = make_ledger_engine(ledger_url)
    try:
        with engine.connect() as conn:
            script = ScriptDirectory.from_config(alembic_config(conn))
        revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
        assert revisions[0] == "0001" and script.get_current_head() == revisions[-1]
        for revision in revisions:
            migrate(engine, "upgrade", revision)
            ledger = Ledger(ledger_url)  # upgrade head from `revision`
            assert ledger.record_work([WorkRecord("n", SHA, 30, f"from-{revision}", 0, 10, 0, 4, False)]).credited == 40
            ledger.close()
            assert schema_problems(engine) == []
            migrate(engine, "downgrade", "base")
            assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        Ledger(ledger_url).close()
        assert set(inspect(engine).get_table_names()) == TABLES and schema_problems(engine) == []
    finally:
        engine.dispose()


def test_trackers_opening_an_empty_database_at_once_migrate_it_once(ledger_url, tmp_path):
    """Four processes open one empty database at the same moment: each ends with a usable ledger."""
    go = tmp_path / "go"
    code = ("import os, sys, time\n"
            "from meshnet.ledger.store import Ledger\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.002)\n"
            "ledger = Ledger(sys.argv[1])\n"
            "print(ledger.node_balances(), ledger.client_balances())\n"
            "ledger.close()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, ledger_url, str(go)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    time.sleep(2.0)  # past the imports: the four wait for `go`
    go.touch()
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-1500:] for _, err in results]
    assert [out.strip() for out, _ in results] == ["[] []"] * 4
    engine = make_ledger_engine(ledger_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("select version_num from alembic_version")).all() == [("0001",)]
        assert schema_problems(engine) == []
    finally:
        engine.dispose()


@needs_postgres
def test_a_second_tracker_on_the_same_postgresql_database_is_refused_naming_the_first(tmp_path):
    """Two trackers on one PostgreSQL ledger each counted their own mesh into it. The second waits for the
    first to let go (a restart), then is refused naming the first's server process; a tracker on another
    database of the same server is not held up, and a killed tracker's lock goes with its session."""
    with fresh_database("postgresql", tmp_path) as url, fresh_database("postgresql", tmp_path) as other:
        first = Ledger(url)
        try:
            with pytest.raises(LedgerError) as ei:
                Ledger(url, lock_wait_s=0.2)
            message = str(ei.value)
            assert "is in use by another tracker (PostgreSQL server process " in message
            assert "still after 0.2 s): one tracker writes a ledger at a time; give this one --ledger with " \
                   "another database; if that tracker is gone, its session ends within about 25 s" in message
            assert "or now with SELECT pg_terminate_backend(" in message
            Ledger(other, lock_wait_s=0.2).close()
            threading.Timer(0.5, first.close).start()
            Ledger(url, lock_wait_s=10).close()  # a tracker being restarted gets it once the old one lets go
        finally:
            first.close()
        code = ("import os, sys\nfrom meshnet.ledger.store import Ledger\nLedger(sys.argv[1])\n"
                "print('held', flush=True)\nsys.stdin.read()\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        holder = subprocess.Popen([sys.executable, "-c", code, url], env=env, text=True, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
        try:
            assert holder.stdout.readline() == "held\n"
            with pytest.raises(LedgerError, match="is in use by another tracker"):
                Ledger(url, lock_wait_s=0.2)
        finally:
            holder.kill()
            holder.wait(timeout=10)
        Ledger(url, lock_wait_s=10).close()  # the server ended the killed process's session and its lock


# ---- many nodes at once --------------------------------------------------------------------------------

N_NODES = 50
ROUNDS = 8  # each node: one prefill, then ROUNDS - 1 decode steps, each reported with a heartbeat
PROMPT = 8  # tokens in a node's own prefill
SHARED_PROMPT = 4  # tokens in the prefill both nodes of a pair report (one replaying the other's steps)
N_CLIENTS = 10


def layers_of(i: int) -> tuple[int, int]:
    """Node ``i``'s range of 10 of 30 layers; both nodes of a pair (2j, 2j+1) serve the same one."""
    start = (i // 2) % 3 * 10
    return start, start + 10


def node_steps(i: int, round_: int) -> list[pb.WorkItem]:
    """Node ``i``'s steps in one round: its own session's, and the session it shares with its pair."""
    start, end = layers_of(i)
    items = []
    for session, prompt in ((f"own-{i}", PROMPT), (f"pair-{i // 2}", SHARED_PROMPT)):
        position, n = (0, prompt) if round_ == 0 else (prompt + round_ - 1, 1)
        items.append(pb.WorkItem(session_id=session, position=position, n_tokens=n, decode=round_ > 0,
                                 model_sha256=SHA, layers=pb.LayerRange(start=start, end=end)))
    return items


def test_fifty_nodes_reporting_at_once_lose_and_double_no_credit(ledger_url):
    """50 node threads register, then each round heartbeat, report their steps and resend the previous
    round's report (a lost acknowledgement), all through one tracker; 10 clients report deliveries with
    resends meanwhile. Every step is stored once and credited once, whoever reported it first."""
    ledger = Ledger(ledger_url)
    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=5.0, ledger=ledger)
    sent = [0] * N_NODES
    recorded = [0] * N_NODES
    failures = []
    barrier = threading.Barrier(N_NODES + N_CLIENTS)

    def node(i: int) -> None:
        me = NodeIdentity.generate()
        channel = open_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.TrackerStub(channel)
        try:
            stub.Register(me.sign(node_info(me.node_id, *layers_of(i))), timeout=30)
            barrier.wait()
            previous = []
            for round_ in range(ROUNDS):
                assert stub.Heartbeat(me.sign(pb.HeartbeatRequest(node_id=me.node_id, active_sessions=2)),
                                      timeout=30).known
                items = node_steps(i, round_)
                for batch in (items, previous):
                    if batch:
                        reply = stub.ReportWork(me.sign(pb.WorkReport(node_id=me.node_id, items=batch)), timeout=30)
                        assert reply.known and reply.recorded + reply.duplicates == len(batch)
                        sent[i] += len(batch)
                        recorded[i] += reply.recorded
                previous = items
            ids[i] = me.node_id
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append((i, repr(e)))
        finally:
            channel.close()

    def client(c: int) -> None:
        channel = open_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.TrackerStub(channel)
        try:
            barrier.wait()
            for first in range(0, 100, 10):  # positions 0..99 in batches of 15 that overlap by 5
                tokens = [pb.DeliveredToken(session_id=f"c{c}", position=p) for p in range(first, min(first + 15, 100))]
                for _ in range(2):
                    stub.ReportDelivery(pb.DeliveryReport(client_id=f"client-{c}", tokens=tokens), timeout=30)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append((f"client {c}", repr(e)))
        finally:
            channel.close()

    ids = [""] * N_NODES
    threads = [threading.Thread(target=node, args=(i,)) for i in range(N_NODES)]
    threads += [threading.Thread(target=client, args=(c,)) for c in range(N_CLIENTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert failures == []
        got = {b.node_id: b for b in ledger.node_balances()}
        charges = [(c.client_id, c.delivered_tokens, c.sessions) for c in ledger.client_balances()]
    finally:
        server.stop(None)
        ledger.close()

    own = 10 * (PROMPT + ROUNDS - 1)  # token-layers of a node's own session
    shared = 10 * (SHARED_PROMPT + ROUNDS - 1)  # of a pair's shared session, credited once between the two
    distinct_steps = N_NODES * ROUNDS + N_NODES // 2 * ROUNDS
    assert sum(recorded) == distinct_steps
    assert sum(sent) == N_NODES * 2 * (2 * ROUNDS - 1)
    assert sum(b.token_layers for b in got.values()) == N_NODES * own + N_NODES // 2 * shared
    assert sum(b.steps for b in got.values()) == distinct_steps
    for j in range(N_NODES // 2):
        a, b = got[ids[2 * j]], got[ids[2 * j + 1]]
        assert a.token_layers >= own and b.token_layers >= own
        assert a.token_layers + b.token_layers == 2 * own + shared
        assert a.steps + b.steps == 3 * ROUNDS
        assert a.uncredited_steps == b.uncredited_steps == 0
    assert sorted(charges) == [(f"client-{c}", 100, 1) for c in range(N_CLIENTS)]


@needs_postgres
def test_a_tracker_whose_postgresql_session_ended_takes_the_ledger_again_unless_another_holds_it(
        tmp_path, monkeypatch, caplog):
    """The session holding a tracker's lock can end while it runs (a server restart, an
    idle_session_timeout, pg_terminate_backend): it went on writing without the lock, beside a second
    tracker that then took it. Now a write first takes the lock again (a warning), and while another
    tracker holds it writes are refused, and succeed again once it lets go."""
    from sqlalchemy import create_engine

    from meshnet.ledger import hold
    from meshnet.ledger.database import normalise_url

    monkeypatch.setattr(hold, "CHECK_EVERY_S", 0.0)
    with fresh_database("postgresql", tmp_path) as url:
        admin = create_engine(normalise_url(url), isolation_level="AUTOCOMMIT")

        def held_by_anyone() -> bool:
            with admin.connect() as conn:
                return bool(conn.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = :key "
                    "AND granted"), {"key": hold._LEDGER_LOCK}).scalar())

        def until_nobody_holds_it() -> None:
            # The server ends a session (and drops its lock) once its process has seen the end: not at once.
            deadline = time.monotonic() + 10
            while held_by_anyone() and time.monotonic() < deadline:
                time.sleep(0.05)

        def end_the_holding_session() -> None:
            with admin.connect() as conn:
                assert conn.execute(text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND classid = 0 AND objid = :key AND granted"), {"key": hold._LEDGER_LOCK}).scalar() == 1
            until_nobody_holds_it()

        ledger = Ledger(url)
        try:
            end_the_holding_session()
            with caplog.at_level("WARNING", logger="meshnet.ledger"):
                assert ledger.record_deliveries("client-a", [("s1", 0)]) == (1, 0)
            assert "this tracker's session holding it ended (terminating connection due to administrator " \
                   "command); taken again" in caplog.text
            end_the_holding_session()
            second = Ledger(url, lock_wait_s=0.2)  # the lock was free: a second tracker takes it
            try:
                for every_s in (0.0, 60.0):  # once lost, the lock is asked for at every write, not once a while
                    monkeypatch.setattr(hold, "CHECK_EVERY_S", every_s)
                    with pytest.raises(LedgerError, match="this tracker's session holding the ledger ended .* and "
                                                          "it could not take it again: the ledger .* is in use by "
                                                          "another tracker"):
                        ledger.record_deliveries("client-a", [("s1", 1)])
                assert second.record_deliveries("client-b", [("s2", 0)]) == (1, 0)
            finally:
                second.close()
            until_nobody_holds_it()
            assert ledger.record_deliveries("client-a", [("s1", 1)]) == (1, 0)
            assert [(b.client_id, b.delivered_tokens) for b in ledger.client_balances()] == [("client-a", 2), ("client-b", 1)]
        finally:
            ledger.close()
            admin.dispose()


def test_a_three_slash_sqlite_url_that_meant_an_absolute_path_is_warned_about(tmp_path, monkeypatch, caplog):
    """``sqlite:///tmp/x.db`` is tmp/x.db under the working directory: a new user who meant /tmp/x.db got a
    folder inside the repository without a word."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="meshnet.ledger"):
        make_ledger_engine("sqlite:///tmp/ledger-test/x.db").dispose()
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger file tmp/ledger-test/x.db is relative to the working directory ({tmp_path}); for "
        "/tmp/ledger-test/x.db write sqlite:////tmp/ledger-test/x.db (four slashes)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshnet.ledger"):
        make_ledger_engine("sqlite:///tmp/ledger-test/y.db").dispose()  # tmp/ exists here now: meant
        make_ledger_engine("sqlite:///nosuchroot/x.db").dispose()  # no /nosuchroot: relative was meant
        make_ledger_engine(f"sqlite:////{tmp_path}/z.db").dispose()
    assert caplog.records == []


def test_a_ledger_that_cannot_be_written_is_refused_at_start(tmp_path):
    """A tracker on a ledger it could read but not write (an immutable file, a read-only role) started
    as if healthy and answered every node's registration INTERNAL, saying nothing itself."""
    path = tmp_path / "ledger.db"
    Ledger(f"sqlite:///{path}").close()
    with pytest.raises(LedgerError, match="cannot be written: attempt to write a readonly database"):
        Ledger(f"sqlite:///file:{path}?mode=ro&uri=true")
    Ledger(f"sqlite:///{path}").close()  # the file itself is unchanged and opens as before
