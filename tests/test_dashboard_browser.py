"""The tracker's dashboard in a real browser: headless Chromium (Debian's ``chromium`` package, driven by
Playwright; scripts/test.sh installs the package when it can) against a live loopback mesh of a tracker and
three fake-engine node processes heartbeating every second: ``a-head`` [0, 20), ``r-relay`` [10, 20)
(relayed: a replica of part of the head's range) and ``c-tail`` [20, 30).

Screenshots land in ``test-artifacts/dashboard/`` (gitignored); the run prints where. Chromium is looked for
at /usr/bin/chromium (``$MESHNET_TEST_CHROMIUM_PATH`` names another). The tests share one
mesh and one page and run in file order: the last one kills a node.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import grpc
import pytest

from mesh_util import Mesh, greedy_steps
import meshnet
from meshnet.cli import main as cli_main
from meshnet.client.activity import session_label
from meshnet.contract import StepRequest
from meshnet.ledger.cli import ledger_dict
from meshnet.proto import meshnet_pb2 as pb

CHROMIUM = os.environ.get("MESHNET_TEST_CHROMIUM_PATH", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "dashboard"
HEARTBEAT_S = 1.0
NODES = [("a-head", "0:20"), ("r-relay", "10:20", ("--relay",)), ("c-tail", "20:30")]
FAKE = ("--engine", "fake", "--in-process-engine")


def _chromium_or_skip():
    """Playwright's sync API, or a skip naming what is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the test extra has it: scripts/setup.sh --test)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: install Debian's chromium package (scripts/test.sh does when it "
                    "runs as root with apt-get); Playwright's own browser downloads are not used")
    return sync_playwright


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(heartbeat_s=HEARTBEAT_S, dashboard=True)
    try:
        m.start_nodes(NODES, "smollm2", *FAKE)
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def page(request):
    sync_playwright = _chromium_or_skip()  # before the mesh starts: a skip costs nothing
    mesh = request.getfixturevalue("mesh")
    pw = sync_playwright().start()
    try:
        # --no-sandbox: Chromium's sandbox refuses to run as root (CI containers).
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    except Exception as e:  # noqa: BLE001 - a Chromium that cannot start is a missing prerequisite here
        pw.stop()
        pytest.skip(f"Chromium at {CHROMIUM} did not start: {str(e).splitlines()[0]}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    p = browser.new_page(viewport={"width": 1280, "height": 1100})
    p.goto(mesh.dashboard.url)
    yield p
    browser.close()
    pw.stop()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"dashboard screenshots: {ARTIFACTS}")


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _eventually(read, expected, timeout_s: float = 5.0):
    """Poll ``read()`` until it equals ``expected()`` (both re-read each time); returns the last value read."""
    deadline = time.monotonic() + timeout_s
    while True:
        got, want = read(), expected()
        if got == want or time.monotonic() > deadline:
            return got, want
        time.sleep(0.05)


def _bars(page) -> set[tuple]:
    return {tuple(b) for b in page.eval_on_selector_all(
        "rect.node-bar", "els => els.map(e => [e.dataset.nodeId, +e.dataset.start, +e.dataset.end, "
                         "e.dataset.relayed === 'true'])")}


def _runs(page) -> list[list]:
    return page.eval_on_selector_all(
        "rect.run", "els => els.map(e => [+e.dataset.start, +e.dataset.end, +e.dataset.replicas])")


def test_layer_map_matches_meshnet_nodes_json(mesh, page, capsys):
    # The command's own entry point, in this process (a second Python start costs seconds on a busy machine).
    assert cli_main(["nodes", "--tracker", mesh.tracker, "--json", "--no-load"]) == 0
    listed = json.loads(capsys.readouterr().out)["nodes"]
    expected = {(n["node_id"], *n["layers"], n["relay"] == "relayed") for n in listed}
    assert expected == {("a-head", 0, 20, False), ("r-relay", 10, 20, True), ("c-tail", 20, 30, False)}
    got, _ = _eventually(lambda: _bars(page), lambda: expected)
    assert got == expected
    # The relayed node doubles [10, 20). Read until it holds: on a busy machine a heartbeat may come late
    # for a moment, and a late node stops counting.
    runs, want = _eventually(lambda: _runs(page), lambda: [[0, 10, 1], [10, 20, 2], [20, 30, 1]])
    assert runs == want
    assert page.locator("rect.run.gap").count() == 0
    version = page.text_content("#nodes-table tr[data-node-id='a-head'] td:nth-child(7)")
    assert version == f"{meshnet.__version__} (protocol {listed[0]['protocol']})"
    _shot(page, "01-layer-map")


def test_relayed_node_is_marked(page):
    assert page.get_attribute("rect.node-bar[data-node-id='r-relay']", "stroke-dasharray") == "4 2"
    assert page.get_attribute("rect.node-bar[data-node-id='a-head']", "stroke-dasharray") == "none"
    reach = {nid: page.text_content(f"#nodes-table tr[data-node-id='{nid}'] td:last-child")
             for nid in ("a-head", "r-relay", "c-tail")}
    assert reach == {"a-head": "direct", "r-relay": "relayed", "c-tail": "direct"}
    assert page.locator("#maps text", has_text="r-relay (relayed)").count() == 1


def test_open_session_and_its_route_appear_then_leave(mesh, page):
    client = mesh.client()
    try:
        res = client.step(StepRequest("dash-open", 0, 0, (11, 12, 13, 14)), decode=False)
        assert res.ok, res.message
        hops = client._sessions["dash-open"].hops
        route = " → ".join(f"{h.node_id} [{h.layers[0]}, {h.layers[1]}){' (relayed)' if h.node_id == 'r-relay' else ''}"
                           for h in hops)
        # Labelled by a hash of its id: the id itself lets whoever knows it end the session on its nodes.
        assert session_label("dash-open") == hashlib.sha256(b"dash-open").hexdigest()[:16]
        assert "dash-open" not in page.content()
        row = page.locator(f"#sessions-table tr[data-session-id='{session_label('dash-open')}']")
        row.wait_for(timeout=5000)
        assert row.locator("td.route").text_content() == route
        assert (hops[0].node_id, hops[-1].node_id) == ("a-head", "c-tail")
        assert row.locator("td:nth-child(2)").text_content() == client.client_id
        _shot(page, "02-open-session")
        client.release("dash-open")
        row.wait_for(state="detached", timeout=5000)
    finally:
        client.close()


def test_tokens_per_second_and_ttft_after_a_generation(mesh, page):
    client = mesh.client()
    try:
        step = client.step
        ids = greedy_steps(lambda r: step(r, False), lambda r: step(r, True), "dash-gen", (21, 22, 23), 40)
        assert len(ids) == 40
        client.release("dash-gen")
    finally:
        client.close()  # sends the last activity report
    page.wait_for_function("parseFloat(document.getElementById('tokens-per-s').textContent) > 0", timeout=5000)
    shown = float(page.text_content("#tokens-per-s"))
    # 40 tokens (and the previous test's 1) arrived within the last few seconds: the 3-second mean is at
    # most 41/3, less while some of them are still in the current second or already out of the window.
    assert 0 < shown <= 41 / 3 + 0.05
    ttft_ms = page.text_content("#ttft-last")
    assert ttft_ms.endswith(" ms") and 0 <= int(ttft_ms[:-3]) < 5000
    assert page.locator("#tokens-chart polyline").count() == 1 and page.locator("#ttft-chart circle").count() >= 1
    _shot(page, "03-throughput")


def _page_ledger(page) -> dict:
    rows = page.eval_on_selector_all(
        "#ledger-nodes tbody tr[data-node-id]",
        "trs => trs.map(t => [t.dataset.nodeId, ...[...t.querySelectorAll('td')].slice(1).map(c => c.textContent)])")
    clients = page.eval_on_selector_all(
        "#ledger-clients tbody tr[data-client-id]",
        "trs => trs.map(t => [t.dataset.clientId, ...[...t.querySelectorAll('td')].slice(1).map(c => c.textContent)])")
    return {"nodes": sorted(rows), "clients": sorted(clients)}


def _tracker_ledger(mesh) -> dict:
    d = ledger_dict(mesh.tracker_stub().GetLedger(pb.Empty(), timeout=5))
    return {"nodes": sorted([n["node_id"], f"{n['tokens']:.2f}", str(n["steps"]), str(n["prefill_token_layers"]),
                             str(n["decode_token_layers"])] for n in d["nodes"]),
            "clients": sorted([c["client_id"], str(c["delivered_tokens"]), str(c["sessions"])] for c in d["clients"])}


def test_ledger_balances_match_the_trackers_ledger(mesh, page):
    got, want = _eventually(lambda: _page_ledger(page), lambda: _tracker_ledger(mesh))
    assert got == want
    credited = {row[0] for row in want["nodes"]}
    # The generations of the tests before ran through the head and the tail (each session's route).
    assert {"a-head", "c-tail"} <= credited
    assert sum(int(c[1]) for c in want["clients"]) >= 41  # 1 + 40 tokens delivered
    _shot(page, "04-ledger")


def test_killed_node_leaves_a_gap_within_three_heartbeats(mesh, page):
    victim = next(n for n in mesh.nodes if n.node_id == "c-tail")
    assert page.locator("rect.run.gap").count() == 0
    t0 = time.monotonic()
    victim.kill()
    page.wait_for_selector("rect.run.gap[data-start='20'][data-end='30']", timeout=10_000)
    elapsed = time.monotonic() - t0
    print(f"the gap appeared {elapsed:.2f} s after the kill")
    _shot(page, "05-gap")
    assert elapsed < 3 * HEARTBEAT_S, f"the gap took {elapsed:.2f} s to appear"
    assert page.locator("#maps text", has_text="gap [20, 30)").count() >= 1
    # Once the tracker drops the node (three silent heartbeats), the map still shows the gap, without it.
    page.wait_for_selector("rect.node-bar[data-node-id='c-tail']", state="detached", timeout=5000)
    assert _runs(page) == [[0, 10, 1], [10, 20, 2], [20, 30, 0]]
    try:
        mesh.tracker_stub().GetRoute(pb.RouteRequest(), timeout=5)
        raise AssertionError("a route without [20, 30)")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
