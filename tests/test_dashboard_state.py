"""The dashboard's state from plain data: layer coverage and gaps, late nodes, the clients' activity
(tokens/s, TTFT, sessions), the client's reporter, the tracker's ReportActivity and the HTTP endpoints."""

from __future__ import annotations

import hashlib
import math

import grpc
import pytest
from fastapi.testclient import TestClient

from meshnet.client.activity import ActivityReporter
from meshnet.dashboard.server import create_dashboard_app
from meshnet.dashboard.state import dashboard_state, layer_coverage, layer_maps
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.activity import CLIENT_TTL_S, ActivityBoard
from meshnet.tracker.server import serve_tracker
from meshnet.wire.security import open_channel


def _node(node_id, start, end, model="m1", n_layer=30, age=0.1, relay="direct"):
    """A node as ``meshnet nodes --json`` lists it (the fields the state reads)."""
    return {"node_id": node_id, "layers": [start, end], "n_layer": n_layer, "model_sha256": model,
            "last_heartbeat_age_s": age, "relay": relay, "active_sessions": 0, "max_sessions": 16}


def test_layer_coverage_splits_into_runs_with_replicas_and_gaps():
    assert layer_coverage(30, [("a", 0, 10), ("b", 10, 20), ("r", 10, 20), ("c", 20, 30)]) == [
        {"start": 0, "end": 10, "nodes": ["a"]}, {"start": 10, "end": 20, "nodes": ["b", "r"]},
        {"start": 20, "end": 30, "nodes": ["c"]}]
    # Overlaps split where the covering set changes; uncovered layers are a run with no nodes.
    assert layer_coverage(30, [("b", 10, 30), ("a", 0, 12)]) == [
        {"start": 0, "end": 10, "nodes": ["a"]}, {"start": 10, "end": 12, "nodes": ["a", "b"]},
        {"start": 12, "end": 30, "nodes": ["b"]}]
    assert layer_coverage(30, [("a", 0, 10), ("c", 25, 30)]) == [
        {"start": 0, "end": 10, "nodes": ["a"]}, {"start": 10, "end": 25, "nodes": []},
        {"start": 25, "end": 30, "nodes": ["c"]}]
    assert layer_coverage(8, []) == [{"start": 0, "end": 8, "nodes": []}]
    # Adjacent ranges of one node merge; parts beyond the model are ignored.
    assert layer_coverage(10, [("a", 0, 4), ("a", 4, 12)]) == [{"start": 0, "end": 10, "nodes": ["a"]}]
    with pytest.raises(ValueError, match="n_layer must be >= 1, got 0"):
        layer_coverage(0, [])


def test_layer_maps_per_model_and_a_late_node_leaves_a_gap():
    nodes = [_node("a", 0, 15), _node("b", 15, 30, age=0.9), _node("x", 0, 4, model="m2", n_layer=4)]
    # Heartbeat every 0.5 s: b, silent 0.9 s, is still on time (late after 2 intervals, 1.0 s).
    maps = layer_maps(nodes, 0.5)
    assert [(m["model_sha256"], m["n_layer"], m["gaps"], m["complete"], m["min_replicas"]) for m in maps] == [
        ("m1", 30, [], True, 1), ("m2", 4, [], True, 1)]
    nodes[1]["last_heartbeat_age_s"] = 1.01
    m1 = layer_maps(nodes, 0.5)[0]
    assert (m1["gaps"], m1["complete"], m1["min_replicas"]) == ([[15, 30]], False, 0)


def test_dashboard_state_joins_nodes_activity_and_ledger():
    activity = {"sessions": [{"client_id": "c1", "session_id": "s1", "epoch": 3, "tokens": 7, "age_s": 1.5,
                              "route": [{"node_id": "a", "address": "h:1", "layers": [0, 30], "relayed": False}]}],
                "clients": [], "tokens_per_s": 12.5, "tokens_series": [[100, 25], [101, 0]],
                "ttft_series": [[99.0, 0.25], [100.0, 0.05], [100.5, 0.1]]}
    ledger = {"nodes": [{"node_id": "a", "tokens": 3.0, "steps": 4}], "clients": []}
    tracker = {"version": "0.1.0", "heartbeat_interval_s": 1.0, "ttl_s": 3.0, "time": 101.2}
    state = dashboard_state({"nodes": [_node("a", 0, 30, age=2.5)]}, activity, ledger, tracker)
    assert state["nodes"][0]["late"] is True and state["maps"][0]["gaps"] == [[0, 30]]
    assert state["sessions"][0]["route"][0]["node_id"] == "a" and state["ledger"] is ledger
    assert state["throughput"] == {"tokens_per_s": 12.5, "series": [[100, 25], [101, 0]]}
    assert (state["ttft"]["last_s"], state["ttft"]["median_s"], state["ttft"]["count"]) == (0.1, 0.1, 3)
    empty = dashboard_state({"nodes": []}, {**activity, "ttft_series": []}, ledger, tracker)
    assert (empty["maps"], empty["ttft"]["last_s"], empty["ttft"]["median_s"]) == ([], None, None)


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _report(client_id="c1", tokens=0, ttft=(), sessions=()):
    return pb.ActivityReport(client_id=client_id, generated_tokens=tokens, ttft_s=list(ttft), sessions=[
        pb.SessionActivity(session_id=sid, epoch=1, tokens=3, age_s=0.5,
                           hops=[pb.Hop(node_id="a", address="h:1", layers=pb.LayerRange(start=0, end=30))])
        for sid in sessions])


def test_activity_board_rates_ttft_sessions_and_expiry():
    clock = _Clock(1000.2)
    board = ActivityBoard(clock)
    board.record(_report(tokens=30, ttft=[0.2], sessions=["s1"]))
    clock.t = 1001.3
    board.record(_report(tokens=60))  # 30 more; s1 ended
    board.record(_report("c2", tokens=9, sessions=["s2"]))
    clock.t = 1002.1
    snap = board.snapshot()
    # Whole seconds 999, 1000, 1001 (1002 is still filling): (30 + 39) / 3.
    assert snap["tokens_per_s"] == pytest.approx(23.0)
    assert snap["tokens_series"][-3:] == [[1000, 30], [1001, 39], [1002, 0]] and len(snap["tokens_series"]) == 120
    assert snap["ttft_series"] == [[1000.2, 0.2]]
    assert [(s["client_id"], s["session_id"], s["route"][0]["layers"]) for s in snap["sessions"]] == [("c2", "s2", [0, 30])]
    assert snap["sessions"][0]["age_s"] == pytest.approx(0.5 + 0.8)
    # A client whose count went down restarted: its new count is all new tokens.
    board.record(_report("c2", tokens=4))
    assert board.snapshot()["tokens_series"][-1] == [1002, 4]
    clock.t += CLIENT_TTL_S + 0.1
    assert board.snapshot()["clients"] == [] and board.snapshot()["sessions"] == []


@pytest.mark.parametrize("report, message", [
    (pb.ActivityReport(client_id=" "), "client_id is empty"),
    (pb.ActivityReport(client_id="c", ttft_s=[math.nan]), "ttft_s holds nan"),
    (pb.ActivityReport(client_id="c", ttft_s=[-1.0]), "ttft_s holds -1.0"),
    (pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(session_id="")]), "a session id is empty"),
    (pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(session_id="s", age_s=math.inf)]), "age_s=inf"),
])
def test_report_activity_refuses_a_malformed_report_naming_the_field(report, message):
    server, port = serve_tracker("127.0.0.1", 0)
    try:
        stub = pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as e:
            stub.ReportActivity(report, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
        assert stub.ReportActivity(_report(tokens=5, sessions=["ok"]), timeout=5) == pb.Empty()
    finally:
        server.stop(None)


class _Stage:
    def __init__(self, node_id, layers, address=None):
        self.node_id, self.layers, self.address = node_id, layers, address or f"relay:{node_id}"


class _Tracker:
    def __init__(self) -> None:
        self.reports: list[pb.ActivityReport] = []

    def ReportActivity(self, report, timeout=None):  # noqa: N802 - the stub's name
        self.reports.append(report)
        return pb.Empty()


def test_activity_reporter_counts_tokens_once_and_reports_routes():
    tracker = _Tracker()
    routes = {"s1": (4, [_Stage("a", (0, 15), "127.0.0.1:9"), _Stage("r", (15, 30))])}
    rep = ActivityReporter(tracker, "client-x", "sha", lambda: dict(routes), interval_s=3600)
    rep.opened("s1")
    rep.delivered("s1", 12)  # the prefill's token (12-token prompt)
    rep.delivered("s1", 13)
    rep.delivered("s1", 13)  # a replayed step: nothing new
    rep.delivered("s1", 16)  # a verification step kept 2 drafts and sampled 1 more
    rep.delivered("other", 3)  # never opened here
    assert rep.report()
    r = tracker.reports[-1]
    assert (r.client_id, r.model_sha256, r.generated_tokens, len(r.ttft_s)) == ("client-x", "sha", 5, 1)
    (s,) = r.sessions
    # A label, not the id, which would let anyone reading the dashboard end the session on its nodes.
    assert (s.session_id, s.epoch, s.tokens) == (hashlib.sha256(b"s1").hexdigest()[:16], 4, 5)
    assert [(h.node_id, h.address, h.layers.start, h.layers.end, h.relayed) for h in s.hops] == [
        ("a", "127.0.0.1:9", 0, 15, False), ("r", "relay:r", 15, 30, True)]
    assert rep.report() and list(tracker.reports[-1].ttft_s) == []  # sent once
    rep.ended("s1")
    del routes["s1"]
    rep.close()
    assert list(tracker.reports[-1].sessions) == [] and tracker.reports[-1].generated_tokens == 5


def test_http_endpoints_serve_the_page_and_the_state():
    state = {"tracker": {"time": 1.0}, "maps": [], "nodes": [], "sessions": [], "ledger": {}}
    with TestClient(create_dashboard_app(lambda: state)) as http:
        r = http.get("/api/state")
        assert (r.status_code, r.json()) == (200, state)
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="maps"' in page.text and "api/events" in page.text
        assert http.post("/api/state").status_code == 405
        assert http.get("/api/nothing").status_code == 404


def test_dashboard_port_options_and_a_busy_port(capsys):
    import argparse
    import socket

    from meshnet.dashboard.cli import (add_dashboard_args, dashboard_from_args, dashboard_port_problem,
                                       dashboard_port_taken)
    from meshnet.tracker.server import start_tracker

    assert [dashboard_port_problem(p) for p in (-1, 0, 7780, 65535)] == [None] * 4
    assert dashboard_port_problem(-2) == "--dashboard-port must be -1 (none) or in 0..65535, got -2"
    assert dashboard_port_problem(70000) == "--dashboard-port must be -1 (none) or in 0..65535, got 70000"
    parser = argparse.ArgumentParser()
    add_dashboard_args(parser)
    assert (parser.parse_args([]).dashboard_port, parser.parse_args([]).dashboard_host) == (7780, "127.0.0.1")
    server, _, service = start_tracker()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        try:
            args = parser.parse_args(["--dashboard-port", str(port)])
            # The tracker goes on without its dashboard, saying why.
            assert dashboard_from_args(service, args, "tracker:") is None
            assert f"tracker: no dashboard: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
            assert dashboard_from_args(service, parser.parse_args(["--dashboard-port", "-1"]), "x") is None
            # Asked for by name, a taken port is an error before anything starts (meshnet tracker and
            # meshnet up exit 2 with it); the default port taken only costs the dashboard, as above.
            assert dashboard_port_taken(args) == (
                f"the dashboard cannot listen on 127.0.0.1:{port} (Address already in use); pass another "
                "--dashboard-port (0 = any free port, -1 = no dashboard)")
            default_args = argparse.ArgumentParser()
            add_dashboard_args(default_args, default_port=port)
            assert dashboard_port_taken(default_args.parse_args([])) is None
            assert dashboard_port_taken(parser.parse_args(["--dashboard-port", "0"])) is None
            # A host that is not an address of this machine gets advice about the host, not the port.
            foreign = parser.parse_args(["--dashboard-port", str(port), "--dashboard-host", "192.0.2.1"])
            assert dashboard_port_taken(foreign) == (
                f"the dashboard cannot listen on 192.0.2.1:{port} (Cannot assign requested address); pass a "
                "--dashboard-host that is an address of this machine (127.0.0.1, or 0.0.0.0 for all)")
            assert dashboard_from_args(service, foreign, "tracker:") is None
            assert "(127.0.0.1, or 0.0.0.0 for all)" in capsys.readouterr().err
        finally:
            server.stop(None)


def test_a_dashboard_beyond_this_machine_of_a_mesh_with_a_join_token_is_warned_about(capsys):
    """The dashboard asks for no join token: shown on every interface, it gives a closed mesh's node
    addresses and routes to whoever reaches the port, which the operator is told as it starts."""
    import argparse

    from meshnet.dashboard.cli import add_dashboard_args, dashboard_from_args, open_dashboard_warning
    from meshnet.tracker.server import start_tracker

    assert open_dashboard_warning("127.0.0.1", "s3cret") is None
    assert open_dashboard_warning("localhost", "s3cret") is None
    assert open_dashboard_warning("0.0.0.0", None) is None  # an open mesh shows nothing a caller cannot ask for
    assert open_dashboard_warning("0.0.0.0", "s3cret").startswith("the dashboard on 0.0.0.0 asks for no join token")
    parser = argparse.ArgumentParser()
    add_dashboard_args(parser)
    server, _, service = start_tracker()
    try:
        for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
            args = parser.parse_args(["--dashboard-port", "0", "--dashboard-host", host])
            args.join_token = "s3cret"
            dashboard = dashboard_from_args(service, args, "tracker:")
            assert dashboard is not None
            dashboard.stop()
            err = capsys.readouterr().err
            assert ("tracker: WARNING: the dashboard on 0.0.0.0 asks for no join token" in err) == warned, err
    finally:
        server.stop(None)


def test_a_client_flooding_ttft_keeps_the_history_bounded():
    # One client may report as often as it likes: 4096 TTFTs per report must not grow the tracker's
    # memory (and /api/state) without bound within the chart's 120 s.
    from meshnet.tracker.activity import MAX_TTFT_HISTORY, MAX_TTFT_PER_REPORT

    now = [1000.0]
    board = ActivityBoard(lambda: now[0])
    for i in range(3 * MAX_TTFT_HISTORY // MAX_TTFT_PER_REPORT + 1):
        board.record(pb.ActivityReport(client_id="flood", ttft_s=[0.5 + i] * MAX_TTFT_PER_REPORT))
    series = board.snapshot()["ttft_series"]
    assert len(series) == MAX_TTFT_HISTORY and series[-1] == [1000.0, 0.5 + i]  # the newest kept


def test_report_activity_refuses_a_route_too_long_or_hop_ids_too_long():
    from meshnet.tracker.activity import MAX_HOPS, check_report

    hop = pb.Hop(node_id="n", address="a")
    long_route = pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(session_id="s", hops=[hop] * (MAX_HOPS + 1))])
    assert check_report(long_route) == f"session 's' has {MAX_HOPS + 1} hops (at most {MAX_HOPS})"
    fat = pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(session_id="s", hops=[pb.Hop(node_id="n" * 300)])])
    message = "session 's' has a hop whose node_id is over 256 characters or address over 300"
    assert check_report(fat) == message
    # Any address a node may register fits (a 253-character DNS name and a port).
    named = pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(
        session_id="s", hops=[pb.Hop(node_id="n", address="h" * 253 + ":7700")])])
    assert check_report(named) is None
    far = pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(session_id="s", hops=[pb.Hop(address="a" * 301)])])
    assert check_report(far) == message


def test_reports_are_bounded_in_bytes_each_and_all_together():
    """1000 sessions of 30 hops with 200-character ids passed every count (12.6 MB a report): 40 clients
    grew the tracker by 700 MB and an /api/state answer to 565 MB."""
    from meshnet.tracker.activity import MAX_BOARD_BYTES, MAX_REPORT_BYTES, check_report

    hop = pb.Hop(node_id="n" * 200, address="a" * 200, layers=pb.LayerRange(start=0, end=30))
    fat = pb.ActivityReport(client_id="c", sessions=[pb.SessionActivity(session_id=f"s{i}", hops=[hop] * 30)
                                                     for i in range(1000)])
    assert check_report(fat) == f"the report has {fat.ByteSize()} bytes (at most {MAX_REPORT_BYTES})"
    # Reports just under the bound each: the board keeps the newest that fit MAX_BOARD_BYTES together.
    n = MAX_REPORT_BYTES // (30 * hop.ByteSize() + 40)
    board = ActivityBoard(_Clock(1000.0))
    for c in range(40):
        report = pb.ActivityReport(client_id=f"c{c:02}", sessions=[
            pb.SessionActivity(session_id=f"s{i}", hops=[hop] * 30) for i in range(n)])
        assert report.ByteSize() <= MAX_REPORT_BYTES
        board.record(report)
    kept = [c["client_id"] for c in board.snapshot()["clients"]]
    assert len(kept) == MAX_BOARD_BYTES // report.ByteSize() and kept[-1] == "c39"
    assert board._bytes == sum(report.ByteSize() for _ in kept) <= MAX_BOARD_BYTES


def test_processes_under_one_named_client_id_report_activity_apart_and_are_charged_together():
    """``--client-id alice`` in two processes: the tracker keeps one activity report per id, so they
    replaced each other's session lists every second and their token counts read as restarts. Their
    activity now carries a suffix of each process's own; the ledger still charges alice."""
    from meshnet.client.accounting import StepAccounting

    tracker = _Tracker()
    a, b = (StepAccounting(tracker, "alice", "sha", dict, shared_id=True) for _ in range(2))
    assert a.deliveries.client_id == b.deliveries.client_id == "alice"
    ids = {a.activity.client_id, b.activity.client_id}
    assert len(ids) == 2 and all(i.startswith("alice (") and len(i) == len("alice (abcdef)") for i in ids)
    assert StepAccounting(tracker, "client-1234", "sha", dict).activity.client_id == "client-1234"  # its own
    longest = StepAccounting(tracker, "x" * 256, "sha", dict, shared_id=True)  # the tracker takes 256 at most
    assert len(longest.activity.client_id) == 256 and longest.deliveries.client_id == "x" * 256
    for acc in (a, b, longest):
        acc.close()
