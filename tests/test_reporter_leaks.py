"""The suite's check that a test file closes the MeshClients it opens (reporter_leaks.py)."""

from __future__ import annotations

import os
from pathlib import Path

from reporter_leaks import LeakWatch, reporter_threads
from meshnet.ledger.reporting import DeliveryReporter
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.security import open_channel

# A file whose first test leaves a delivery reporter's thread running (its tracker answers every report,
# so the process exits at once), as a test that forgets to close its MeshClient does.
LEAKY_FILE = """
from meshnet.ledger.reporting import DeliveryReporter

class Tracker:
    def ReportDelivery(self, report, **kw):
        return None

KEPT = []

def test_leaves_its_reporter_open():
    KEPT.append(DeliveryReporter(Tracker(), "forgotten", interval_s=0.05))
    KEPT[-1].delivered("s", 0)

def test_closes_its_reporter():
    r = DeliveryReporter(Tracker(), "careful", interval_s=0.05)
    r.delivered("s", 0)
    r.close()
"""


def _reporter(port: int, client_id: str) -> DeliveryReporter:
    return DeliveryReporter(pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}")), client_id, interval_s=0.1)


def test_a_reporter_left_running_fails_its_files_last_test_naming_the_test_that_started_it(pytester, monkeypatch):
    pytester.makepyfile(test_leaky=LEAKY_FILE)
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess("-p", "reporter_leaks", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_closes_its_reporter*",
        "*left running (close each MeshClient, or reporter, in a finally): meshnet-deliveries thread started by "
        "test_leaky.py::test_leaves_its_reporter_open"])
    assert "careful" not in result.stdout.str()


def test_a_reporter_closed_by_the_files_end_is_not_named():
    watch = LeakWatch(wait_s=0.2)
    before = reporter_threads()
    left, closed = _reporter(1, "left"), _reporter(1, "closed")
    try:
        left.delivered("s", 0)  # starts its thread; nothing answers at port 1
        assert watch.after_test("t.py::test_a", before, file_ends=False) is None
        closed.delivered("s", 0)
        closed.close(timeout_s=0)
        assert watch.after_test("t.py::test_b", before, file_ends=True) == (
            "left running (close each MeshClient, or reporter, in a finally): "
            "meshnet-deliveries thread started by t.py::test_a")
        assert watch.started_by == {}  # the next file starts afresh
    finally:
        left.close(timeout_s=0)
    assert watch.after_test("u.py::test_c", before, file_ends=True) is None
