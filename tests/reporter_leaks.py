"""A pytest plugin (loaded by conftest.py): every MeshClient a test file opens must be closed by the file's
end; a reporter thread left running fails the file's last test, naming the test that started it.

A MeshClient left open keeps its delivery and activity reporters' threads, and with them what they have
not reported yet: a delivery reporter resends its tokens until a tracker answers (a tracker restart must
lose no charge), so once the test's tracker stops they go to whichever tracker listens on its port next,
in this process or the other worker's. A full suite saw a stray client charged on another test's ledger.
The file rather than the test is the unit, so that a module fixture's client may live until the file ends.
"""

from __future__ import annotations

import threading
import time

import pytest

# The names of the reporters' threads (meshnet.ledger.reporting, meshnet.client.activity).
REPORTER_THREADS = ("meshnet-deliveries", "meshnet-activity")
# How long a reporter closed at the test's end may take to stop, seconds: an activity report in flight
# when it closed has 2 s.
STOP_WAIT_S = 3.0


def reporter_threads() -> set[threading.Thread]:
    """The reporter threads running now."""
    return {t for t in threading.enumerate() if t.name in REPORTER_THREADS}


def still_running(threads, wait_s: float = STOP_WAIT_S) -> list[threading.Thread]:
    """Those of ``threads`` that have not ended within ``wait_s`` seconds (together)."""
    deadline = time.monotonic() + wait_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


class LeakWatch:
    """Which test started each reporter thread, until the end of its file."""

    def __init__(self, wait_s: float = STOP_WAIT_S) -> None:
        self.wait_s = wait_s
        self.started_by: dict[threading.Thread, str] = {}

    def after_test(self, test_id: str, before: set[threading.Thread], file_ends: bool) -> str | None:
        """Note the reporter threads started since ``before`` (taken as the test's setup began); at the
        end of a file, what its tests left running, or None when nothing."""
        for t in reporter_threads() - before:
            self.started_by.setdefault(t, test_id)
        if not file_ends:
            return None
        started, self.started_by = self.started_by, {}
        if not (left := still_running(started, self.wait_s)):
            return None
        return ("left running (close each MeshClient, or reporter, in a finally): "
                + "; ".join(sorted(f"{t.name} thread started by {started[t]}" for t in left)))


_BEFORE = pytest.StashKey[set]()
_watch = LeakWatch()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_BEFORE] = reporter_threads()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        file_ends = nextitem is None or nextitem.path != item.path
        if problem := _watch.after_test(item.nodeid, item.stash.get(_BEFORE, set()), file_ends):
            pytest.fail(problem, pytrace=False)
