"""The client's record of nodes found down (plain data, the clock passed in)."""

from __future__ import annotations

from types import SimpleNamespace

from meshnet.client.node_failures import AVOID_S, KEEP_S, NodeFailures


def _hop(node_id: str, address: str) -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id, address=address)


def test_a_step_is_doomed_only_by_a_failure_recorded_after_it_was_sent():
    f = NodeFailures()
    f.record("b", "10.0.0.2:7000", "UNAVAILABLE: refused", now=100.0)
    hops = [_hop("a", "10.0.0.1:7000"), _hop("b", "10.0.0.2:7000")]
    assert f.since(99.0, hops) == (hops[1], "UNAVAILABLE: refused")
    assert f.since(100.5, hops) is None  # sent after the failure: its session found the node back
    assert f.since(99.0, [_hop("b", "10.0.0.9:7000")]) is None  # the same id restarted elsewhere


def test_new_sessions_avoid_a_node_for_avoid_s_and_the_record_goes_after_keep_s():
    f = NodeFailures()
    f.record("b", "10.0.0.2:7000", "UNAVAILABLE", now=100.0)
    f.record("c", "10.0.0.3:7000", "DEADLINE_EXCEEDED", now=100.0 + AVOID_S - 1)
    assert f.recent(100.0 + AVOID_S) == {"b", "c"}
    assert f.recent(100.0 + AVOID_S + 0.5) == {"c"}
    assert f.recent(100.0 + 2 * AVOID_S) == set()
    f.record("d", "10.0.0.4:7000", "UNAVAILABLE", now=100.0 + AVOID_S + KEEP_S)  # recording prunes the old ones
    assert f.since(0.0, [_hop("b", "10.0.0.2:7000"), _hop("c", "10.0.0.3:7000")]) is None
