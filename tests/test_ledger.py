"""The ledger without processes: credit arithmetic, idempotency over plain data, a restart on the same
database, the gRPC reports, the reporters' resend behaviour and ``meshnet ledger``. Each test taking
``ledger_url`` runs on a fresh SQLite file and on a fresh PostgreSQL database (skipped, saying why,
without ``$MESHNET_TEST_POSTGRES_URL``)."""

from __future__ import annotations

import argparse
import json
import threading

import grpc
import pytest
from sqlalchemy import create_engine, inspect, text

from ledger_db import ledger_url  # noqa: F401 - the fixture
from meshnet.contract import LayerRange, StepRequest
from meshnet.ledger.cli import add_ledger_parser
from meshnet.ledger.credit import Rect, new_area
from meshnet.ledger.reporting import DeliveryReporter, WorkReporter
from meshnet.ledger.database import normalise_url
from meshnet.ledger.store import Ledger, LedgerError, WorkRecord
from meshnet.membership.identity import NodeIdentity
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.server import serve_tracker
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR
from meshnet.wire.security import open_channel

SHA = "ab" * 32


def step(node: str, start: int, end: int, position: int, n: int = 1, session: str = "s1",
         decode: bool | None = None, n_layer: int = 30) -> WorkRecord:
    return WorkRecord(node_id=node, model_sha256=SHA, n_layer=n_layer, session_id=session, layer_start=start,
                      layer_end=end, position=position, n_tokens=n, decode=(n == 1) if decode is None else decode)


def balances(ledger: Ledger) -> dict[str, tuple[int, int, int, int]]:
    return {b.node_id: (b.prefill_token_layers, b.decode_token_layers, b.steps, b.uncredited_steps)
            for b in ledger.node_balances()}


# ---- credit arithmetic ---------------------------------------------------------------------------------

def test_new_area_counts_only_uncovered_token_layers():
    r = Rect(0, 10, 0, 30)  # 10 tokens through 30 layers
    assert new_area(r, []) == 300
    assert new_area(r, [r]) == 0
    assert new_area(r, [Rect(0, 10, 0, 10), Rect(0, 10, 20, 30)]) == 100  # only [10, 20) is new
    assert new_area(r, [Rect(0, 4, 0, 30), Rect(2, 6, 0, 30)]) == 120  # overlapping covers count once
    assert new_area(r, [Rect(20, 30, 0, 30), Rect(0, 10, 30, 40)]) == 300  # disjoint covers
    assert new_area(r, [Rect(5, 6, 10, 20)]) == 290
    assert new_area(Rect(3, 3, 0, 30), []) == 0


# ---- the ledger over plain records -------------------------------------------------------------------

def test_a_step_is_credited_once_however_often_or_by_whom_it_is_reported(ledger_url):
    ledger = Ledger(ledger_url)
    prefill = [step("head", 0, 10, 0, 7), step("mid", 10, 20, 0, 7), step("tail", 20, 30, 0, 7)]
    out = ledger.record_work(prefill)
    assert (out.recorded, out.duplicates, out.credited) == (3, 0, 3 * 70)
    # The same batch again (a resend after a lost acknowledgement) changes nothing.
    out = ledger.record_work(prefill)
    assert (out.recorded, out.duplicates, out.credited) == (0, 3, 0)
    # A repeat inside one batch counts once.
    out = ledger.record_work([step("head", 0, 10, 7), step("head", 0, 10, 7)])
    assert (out.recorded, out.duplicates, out.credited) == (1, 1, 10)
    # A replacement for [10, 20) replaying the dead node's steps earns nothing; its new step earns.
    out = ledger.record_work([step("spare", 10, 20, 0, 7), step("spare", 10, 20, 7)])
    assert (out.recorded, out.duplicates, out.credited) == (1, 1, 10)
    assert balances(ledger) == {"head": (70, 10, 2, 0), "mid": (70, 0, 1, 0), "spare": (0, 10, 1, 0),
                                "tail": (70, 0, 1, 0)}
    # A replacement with another range ([10, 30) for mid + tail) is credited only for layers nobody ran.
    out = ledger.record_work([step("wide", 10, 30, 0, 7), step("wide", 10, 30, 7)])
    assert (out.recorded, out.duplicates, out.credited) == (2, 0, 10)  # position 7 of [20, 30) was new
    assert balances(ledger)["wide"] == (0, 10, 2, 2)
    # Another session and another model are separate work.
    assert ledger.record_work([step("head", 0, 10, 0, 7, session="s2")]).credited == 70
    other = WorkRecord("head", "cd" * 32, 30, "s1", 0, 10, 0, 7, False)
    assert ledger.record_work([other]).credited == 70
    [b1, b2] = [b for b in ledger.node_balances() if b.node_id == "head"]
    assert (b1.model_sha256, b1.token_layers, b1.tokens) == (SHA, 150, 5.0)
    assert (b2.model_sha256, b2.token_layers) == ("cd" * 32, 70)
    ledger.close()


def test_steps_past_two_to_the_31_are_credited_like_any_other(ledger_url):
    """Positions are 64-bit (a session's records go up to 2**62): on PostgreSQL a bound computed from a
    32-bit column was sent as an INTEGER and failed the whole report ("integer out of range"), losing the
    other sessions' credit with it."""
    ledger = Ledger(ledger_url)
    far = 2**31 + 5
    out = ledger.record_work([step("head", 0, 10, 0, 3, session="near"), step("head", 0, 10, far, 4),
                              step("head", 0, 10, 2**62 - 8, 1, session="farther")])
    assert (out.recorded, out.duplicates, out.credited) == (3, 0, 30 + 40 + 10)
    out = ledger.record_work([step("spare", 0, 10, far + 2), step("spare", 0, 10, far + 4)])
    assert (out.recorded, out.duplicates, out.credited) == (2, 0, 10)  # far + 2 is inside the step at far
    ledger.close()


def test_bad_records_are_refused_whole(ledger_url):
    ledger = Ledger(ledger_url)
    good = step("n", 0, 10, 0)
    for bad, fragment in [(step("n", 10, 40, 0), "not inside a model of 30 layers"),
                          (step("n", 0, 10, 0, n=0), "n_tokens >= 1"),
                          (step("n", 0, 10, 0, session=""), "session id"),
                          (step("n", 0, 10, 0, session="x" * 300), "session id")]:
        with pytest.raises(ValueError, match=fragment):
            ledger.record_work([good, bad])
    assert ledger.node_balances() == []
    with pytest.raises(ValueError, match="client id"):
        ledger.record_deliveries("", [("s", 1)])
    with pytest.raises(ValueError, match="out of range"):
        ledger.record_deliveries("c", [("s", -1)])
    assert ledger.client_balances() == []
    ledger.close()


def test_deliveries_are_charged_once_per_position(ledger_url):
    ledger = Ledger(ledger_url)
    assert ledger.record_deliveries("alice", [("s1", p) for p in range(5, 10)]) == (5, 0)
    assert ledger.record_deliveries("alice", [("s1", 9), ("s1", 10), ("s1", 10)]) == (1, 2)
    assert ledger.record_deliveries("alice", [("s2", 9)]) == (1, 0)
    assert ledger.record_deliveries("bob", [("s1", 9)]) == (1, 0)
    assert [(c.client_id, c.delivered_tokens, c.sessions) for c in ledger.client_balances()] == \
        [("alice", 7, 2), ("bob", 1, 1)]
    ledger.close()


def test_an_sqlite_file_s_directory_is_created(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'sub' / 'ledger.db'}")
    assert ledger.record_deliveries("alice", [("s1", 0)]) == (1, 0)
    ledger.close()
    assert (tmp_path / "sub" / "ledger.db").is_file()


def test_a_ledger_survives_a_restart_and_keeps_counting_once(ledger_url):
    url = ledger_url
    first = Ledger(url)
    first.record_work([step("head", 0, 10, 0, 5), step("head", 0, 10, 5)])
    first.record_deliveries("alice", [("s1", 5), ("s1", 6)])
    assert first.bind_node_key("alice-node", b"k" * 32) == b"k" * 32
    first.close()

    again = Ledger(url)  # the "restarted tracker": upgrade head is a no-op, every row is there
    assert balances(again) == {"head": (50, 10, 2, 0)}
    out = again.record_work([step("head", 0, 10, 0, 5), step("head", 0, 10, 5), step("head", 0, 10, 6)])
    assert (out.recorded, out.duplicates, out.credited) == (1, 2, 10)
    assert again.record_deliveries("alice", [("s1", 6), ("s1", 7)]) == (1, 1)
    assert again.bind_node_key("alice-node", b"z" * 32) == b"k" * 32  # the first key stays bound
    assert again.node_key("alice-node") == b"k" * 32 and again.node_key("nobody") is None
    again.close()

    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as db:
            assert db.execute(text("select version_num from alembic_version")).all() == [("0001",)]
            assert set(inspect(db).get_table_names()) == {"work", "deliveries", "node_keys", "alembic_version"}
            assert db.execute(text("select count(*) from work")).scalar() == 3
            assert db.execute(text("select count(*) from deliveries")).scalar() == 3
    finally:
        engine.dispose()


def test_concurrent_reports_of_the_same_steps_count_once(ledger_url):
    ledger = Ledger(ledger_url)
    batch = [step("n", 0, 10, p) for p in range(200)]

    threads = [threading.Thread(target=ledger.record_work, args=(batch,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert balances(ledger) == {"n": (0, 2000, 200, 0)}
    ledger.close()


def test_unusable_urls_are_named():
    with pytest.raises(LedgerError, match="nosuchdb"):
        Ledger("nosuchdb://x")
    with pytest.raises(LedgerError, match="ledger URL"):
        Ledger("not a url")


def test_the_log_names_an_sqlite_ledgers_file_by_its_absolute_path(tmp_path, monkeypatch):
    """``--ledger sqlite:///tmp/x.db`` is SQLAlchemy's relative path (tmp/x.db here): the tracker's line said
    only the URL, and the file turned up under the working directory."""
    monkeypatch.chdir(tmp_path)
    # "~" is the home folder, as the shell's: SQLite took it for a folder named "~" and failed to open.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for url, shown, file in (("sqlite:///tmp/x.db", "sqlite:///tmp/x.db", tmp_path / "tmp" / "x.db"),
                             ("sqlite:///~/ledger.db", f"sqlite:///{tmp_path}/home/ledger.db",
                              tmp_path / "home" / "ledger.db")):
        ledger = Ledger(url)
        try:
            assert ledger.display_url == f"{shown} (file {file})"
            assert file.is_file()
        finally:
            ledger.close()
    memory = Ledger("sqlite://")
    assert memory.display_url == "sqlite://"
    memory.close()


# ---- over gRPC -----------------------------------------------------------------------------------------

def node_info(node_id: str, start: int, end: int) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node_id, address="127.0.0.1:9", layers=pb.LayerRange(start=start, end=end),
                       model=pb.ModelIdentity(sha256=SHA, architecture="llama", n_layer=30),
                       protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR)


@pytest.fixture
def tracker(ledger_url):
    ledger = Ledger(ledger_url)
    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=5.0, ledger=ledger)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.TrackerStub(channel), port
    finally:
        channel.close()
        server.stop(None)
        ledger.close()


def test_report_work_and_delivery_over_grpc(tracker):
    stub, port = tracker
    me = NodeIdentity.generate()
    stub.Register(me.sign(node_info(me.node_id, 0, 10)), timeout=5)
    reporter = WorkReporter(me.node_id, SHA, LayerRange(0, 10), sign=me.sign)
    reporter.record(StepRequest("s1", 0, 0, (1, 2, 3)), decode=False)
    reporter.record(StepRequest("s1", 0, 3, (4,)), decode=True)
    assert reporter.flush(stub) is True and reporter.pending == 0
    # A resend (the acknowledgement was lost) is harmless.
    reply = stub.ReportWork(me.sign(pb.WorkReport(node_id=me.node_id, items=[
        pb.WorkItem(session_id="s1", position=3, n_tokens=1, decode=True, model_sha256=SHA,
                    layers=pb.LayerRange(start=0, end=10))])), timeout=5)
    assert (reply.known, reply.recorded, reply.duplicates) == (True, 0, 1)
    # Steps through layers the node does not serve are refused, and named.
    with pytest.raises(grpc.RpcError) as ei:
        stub.ReportWork(me.sign(pb.WorkReport(node_id=me.node_id, items=[
            pb.WorkItem(session_id="s1", position=4, n_tokens=1, decode=True, model_sha256=SHA,
                        layers=pb.LayerRange(start=0, end=30))])), timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "registered for layers [0, 10)" in ei.value.details() and "[0, 30)" in ei.value.details()
    # Somebody else's key cannot report work in this node's name.
    thief = NodeIdentity.generate()
    with pytest.raises(grpc.RpcError) as ei:
        stub.ReportWork(thief.sign(pb.WorkReport(node_id=me.node_id, items=[
            pb.WorkItem(session_id="s9", position=0, n_tokens=1, model_sha256=SHA,
                        layers=pb.LayerRange(start=0, end=10))])), timeout=5)
    assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED
    # A node the tracker does not know is told to register; its records stay pending.
    stranger = NodeIdentity.generate()
    other = WorkReporter(stranger.node_id, SHA, LayerRange(0, 10), sign=stranger.sign)
    other.record(StepRequest("s1", 0, 4, (5,)), decode=True)
    assert other.flush(stub) is False and other.pending == 1

    deliveries = DeliveryReporter(stub, "alice", SHA, interval_s=60)
    for position in (3, 4, 4, 2, 5):  # an old position again is no new delivery
        deliveries.delivered("s1", position)
    assert deliveries.pending == 3 and deliveries.flush() and deliveries.pending == 0
    for position in (6, 7, 8, 8):  # a verification step's kept drafts, as the consumer gets them
        deliveries.delivered("s1", position)
    assert deliveries.pending == 3 and deliveries.flush() and deliveries.pending == 0
    assert deliveries.close()  # its thread would outlive the tracker (see reporter_leaks.py)
    reply = stub.ReportDelivery(pb.DeliveryReport(client_id="alice", tokens=[
        pb.DeliveredToken(session_id="s1", position=5)]), timeout=5)
    assert (reply.recorded, reply.duplicates) == (0, 1)
    with pytest.raises(grpc.RpcError) as ei:
        stub.ReportDelivery(pb.DeliveryReport(client_id="", tokens=[pb.DeliveredToken(session_id="s")]),
                            timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    got = stub.GetLedger(pb.Empty(), timeout=5)
    [n] = got.nodes
    assert (n.node_id, n.prefill_token_layers, n.decode_token_layers, n.steps, n.n_layer) == (me.node_id, 30, 10, 2, 30)
    assert n.tokens == pytest.approx(40 / 30)
    assert [(c.client_id, c.delivered_tokens, c.sessions) for c in got.clients] == [("alice", 6, 1)]

    # `meshnet ledger` prints the same, as JSON and as tables.
    parser = argparse.ArgumentParser(prog="meshnet")
    add_ledger_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ledger", "--tracker", f"127.0.0.1:{port}", "--json"])
    assert args.func.__name__ == "run_ledger"
    return_code, printed = _run(args)
    assert return_code == 0
    data = json.loads(printed)
    assert data["clients"] == [{"client_id": "alice", "delivered_tokens": 6, "sessions": 1}]
    assert data["nodes"][0]["decode_token_layers"] == 10
    return_code, printed = _run(parser.parse_args(["ledger", "--tracker", f"127.0.0.1:{port}"]))
    lines = printed.splitlines()
    assert lines[0].split() == ["NODE", "MODEL", "PREFILL_TL", "DECODE_TL", "TOKENS", "STEPS"]
    assert lines[1].split() == [me.node_id, SHA[:12], "30", "10", "1.33", "2"]
    assert lines[4].split() == ["alice", "6", "1"]
    # Steps no node could have run: a decode step of 2^32-1 tokens was credited (2.1e12 tokens for a node
    # at a dead address), and so was a prefill of as many by a node that registered no context (an older one).
    with pytest.raises(grpc.RpcError) as ei:
        stub.ReportWork(me.sign(pb.WorkReport(node_id=me.node_id, items=[
            pb.WorkItem(session_id="s3", position=0, n_tokens=2**32 - 1, model_sha256=SHA,
                        layers=pb.LayerRange(start=0, end=10))])), timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().endswith("reports a step of session 's3' through positions [0, 4294967295), past "
                                       "the 16777216 tokens of context a node that registered none is taken to "
                                       "hold at most")
    sized = node_info(me.node_id, 0, 10)
    sized.n_ctx = 2048
    stub.Register(me.sign(sized), timeout=5)
    for position, n_tokens, decode, problem in [
            (5, 2**32 - 1, True, "as a decode step of 4294967295 tokens (at most 17: one and its drafts)"),
            (0, 0, False, "of 0 tokens"),
            (2000, 49, False, "through positions [2000, 2049), past the 2048 tokens of context it registered")]:
        with pytest.raises(grpc.RpcError) as ei:
            stub.ReportWork(me.sign(pb.WorkReport(node_id=me.node_id, items=[
                pb.WorkItem(session_id="s2", position=position, n_tokens=n_tokens, decode=decode, model_sha256=SHA,
                            layers=pb.LayerRange(start=0, end=10))])), timeout=5)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details() == f"ReportWork: node {me.node_id!r} reports a step of session 's2' {problem}"
    reply = stub.ReportWork(me.sign(pb.WorkReport(node_id=me.node_id, items=[
        pb.WorkItem(session_id="s2", position=2000, n_tokens=48, model_sha256=SHA,
                    layers=pb.LayerRange(start=0, end=10)),
        pb.WorkItem(session_id="s2", position=2048 - 17, n_tokens=17, decode=True, model_sha256=SHA,
                    layers=pb.LayerRange(start=0, end=10))])), timeout=5)
    assert (reply.known, reply.recorded) == (True, 2)


def test_reporters_keep_records_through_a_tracker_outage(ledger_url):
    """Records made while the tracker is down are sent once it is back; the new tracker process opens the
    same database and counts nothing twice."""
    url = ledger_url
    ledger = Ledger(url)
    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=5.0, ledger=ledger)
    stub = pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}"))
    me = NodeIdentity.generate()
    stub.Register(me.sign(node_info(me.node_id, 10, 20)), timeout=5)
    work = WorkReporter(me.node_id, SHA, LayerRange(10, 20), sign=me.sign)
    deliveries = DeliveryReporter(stub, "bob", interval_s=60)
    work.record(StepRequest("s", 0, 0, (1, 2)), decode=False)
    deliveries.delivered("s", 2)
    assert work.flush(stub) and deliveries.flush()
    server.stop(None).wait()
    ledger.close()

    work.record(StepRequest("s", 0, 2, (3,)), decode=True)
    deliveries.delivered("s", 3)
    with pytest.raises(grpc.RpcError):
        work.flush(stub, timeout_s=1)
    assert deliveries.flush(timeout_s=1) is False
    assert (work.pending, deliveries.pending) == (1, 1)

    ledger = Ledger(url)
    server, _ = serve_tracker("127.0.0.1", port, heartbeat_interval_s=5.0, ledger=ledger)
    try:
        assert _eventually(lambda: work.flush(stub, timeout_s=1) is False)  # the new tracker: register first
        stub.Register(me.sign(node_info(me.node_id, 10, 20)), timeout=5)
        assert work.flush(stub) and work.pending == 0
        assert deliveries.close() and deliveries.pending == 0
        got = stub.GetLedger(pb.Empty(), timeout=5)
        assert [(n.prefill_token_layers, n.decode_token_layers) for n in got.nodes] == [(20, 10)]
        assert [(c.client_id, c.delivered_tokens) for c in got.clients] == [("bob", 2)]
    finally:
        server.stop(None)
        ledger.close()


def _eventually(fn, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if fn():
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    return False


def _run(args) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args)
    return code, out.getvalue()


def test_a_second_tracker_on_the_same_sqlite_file_is_refused_naming_the_first(tmp_path):
    """Two trackers on one machine both opened the default ledger.db, each counting its own mesh into it.
    The second waits a few seconds for the first to let go (a restart), then is refused."""
    import os
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    first = Ledger(url)
    try:
        with pytest.raises(LedgerError) as e:
            Ledger(url, lock_wait_s=0.2)
        assert str(e.value) == (f"the ledger {tmp_path / 'ledger.db'} is in use by another tracker (this process, "
                                "still after 0.2 s): one tracker writes a ledger at a time; give this one another "
                                "file, --ledger sqlite:////ABSOLUTE/PATH (four slashes)")
        r = subprocess.run([sys.executable, "-m", "meshnet.cli", "tracker", "--port", "0", "--ledger", url],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"is in use by another tracker (pid {os.getpid()}, still after 5 s)" in r.stderr, r.stderr
        # A tracker being restarted gets the file once the old one lets go.
        threading.Timer(0.5, first.close).start()
        Ledger(url, lock_wait_s=10).close()
    finally:
        first.close()
    Ledger(url).close()  # free again once the first is closed


def test_a_client_closing_while_its_tracker_restarts_still_reports_its_tokens():
    """A client exiting while its tracker was being restarted made one attempt, which failed at once,
    and its charges were lost (the nodes' credits not): its close now keeps trying while the tracker
    comes back (here 1.5 s later, on the same port)."""
    from mesh_util import free_port

    port = free_port()
    deliveries = DeliveryReporter(pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}")), "carol", interval_s=60)
    for position in (5, 6, 7):
        deliveries.delivered("s", position)
    ledger = Ledger()
    started = {}
    timer = threading.Timer(1.5, lambda: started.setdefault(
        "server", serve_tracker("127.0.0.1", port, heartbeat_interval_s=5.0, ledger=ledger)[0]))
    timer.start()
    try:
        assert deliveries.close() and deliveries.pending == 0
        assert [(c.client_id, c.delivered_tokens) for c in ledger.client_balances()] == [("carol", 3)]
    finally:
        timer.join()
        started["server"].stop(None)
        ledger.close()


def test_a_client_closing_with_the_tracker_unreachable_says_how_many_tokens_went_unreported(caplog):
    """A short-lived client (meshnet generate) exiting during a tracker outage lost its charges silently."""
    import logging

    deliveries = DeliveryReporter(pb_grpc.TrackerStub(open_channel("127.0.0.1:1")), "bob", interval_s=60)
    for position in (5, 6, 7):
        deliveries.delivered("s", position)
    with caplog.at_level(logging.WARNING, logger="meshnet.ledger"):
        assert deliveries.close(timeout_s=0.5) is False
    assert ("the tracker's ledger is unreachable: 3 delivered tokens of client bob go unreported (uncharged)"
            in caplog.text)


def test_a_client_whose_tracker_was_already_silent_for_the_whole_wait_closes_after_one_attempt():
    """``meshnet generate`` whose whole mesh was gone failed over for 8 s (its tracker unreachable), printed
    its error, then kept trying to report its tokens for 5 s more: the wait for a tracker being restarted
    now counts from when the tracker stopped answering, and a tracker silent for all of it gets one try."""
    import time

    from mesh_util import RpcFailure

    class Down:
        calls = 0

        def ReportDelivery(self, *args, **kwargs):
            Down.calls += 1
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "connection refused")

    deliveries = DeliveryReporter(Down(), "dave", interval_s=60)
    deliveries.delivered("s", 5)
    assert deliveries.flush() is False and Down.calls == 1  # a background report: the tracker is gone
    time.sleep(0.6)
    assert deliveries.close(timeout_s=0.5) is False
    assert Down.calls == 2 and deliveries.pending == 1

    # A tracker that only now stopped answering is still waited for: tries again until the timeout.
    Down.calls = 0
    fresh = DeliveryReporter(Down(), "erin", interval_s=60)
    fresh.delivered("s", 5)
    assert fresh.close(timeout_s=0.5) is False
    assert Down.calls >= 3
