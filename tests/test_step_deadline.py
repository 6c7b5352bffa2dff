"""Step deadlines from measured step times: plain data, no nodes."""

from __future__ import annotations

import pytest

from meshnet.client.deadline import DeadlinePolicy, HopClock, HopClocks

POLICY = DeadlinePolicy(floor_s=1.5, factor=10.0, ceiling_s=60.0, smoothing=0.3)


def measured(decode_s: float | None = None, prefill: tuple[int, float] | None = None) -> HopClock:
    """A clock that has seen one prefill of (tokens, seconds) and/or one decode of ``decode_s``."""
    clock = HopClock(POLICY)
    if prefill is not None:
        t, _ = clock.begin(False, prefill[0])
        clock.end(t, prefill[1])
    if decode_s is not None:
        t, _ = clock.begin(True, 1)
        clock.end(t, decode_s)
    return clock


def test_unmeasured_hop_gets_a_few_seconds_before_its_health_is_asked():
    """It got the ceiling: a node hung in a client's first step there held it 60 s, a spare ready. A slow
    first step is not failed over for it: past its deadline the node's Health is asked, and one that
    answers is waited for on (RemoteStage)."""
    assert HopClock(POLICY).deadline_s(True, 1) == 5.0
    assert HopClock(POLICY).deadline_s(False, 500) == 5.0
    assert HopClock(DeadlinePolicy(floor_s=1.5, ceiling_s=3.0)).deadline_s(True, 1) == 3.0  # within the ceiling
    assert HopClock(DeadlinePolicy(floor_s=8.0, ceiling_s=30.0)).deadline_s(True, 1) == 8.0  # and the floor
    # Where the wait past the deadline cannot ask Health (a relayed node, a gRPC stream) it is final: the
    # ceiling, or a slow first prefill there would be failed over, and its replacement too.
    assert HopClock(POLICY).deadline_s(False, 500, asks_health=False) == 60.0
    assert measured(decode_s=0.5).deadline_s(True, 1, asks_health=False) == pytest.approx(5.0)  # measured: as ever


def test_a_verification_step_expects_a_decode_step_a_row_and_leaves_the_decode_time_alone():
    """A decode of 17 rows (token and drafts) got one decode's deadline, and its time went into the
    decode average, lengthening the next plain decodes' deadlines."""
    clock = measured(decode_s=0.5)
    assert clock.deadline_s(True, 17) == pytest.approx(60.0)  # 10 x 17 x 0.5 s, capped
    assert clock.deadline_s(True, 4) == pytest.approx(20.0)
    t, _ = clock.begin(True, 17)
    clock.end(t, 3.0)
    assert clock.decode_s == 0.5


def test_fast_decodes_give_the_floor_so_a_hung_node_is_detected_in_seconds():
    clock = measured(decode_s=0.02, prefill=(38, 0.15))
    assert clock.deadline_s(True, 1) == 1.5  # 10 x 20 ms is under the floor


def test_slow_decodes_scale_the_deadline():
    clock = measured(decode_s=0.4)
    assert clock.deadline_s(True, 1) == pytest.approx(4.0)


def test_prefill_deadline_scales_with_its_tokens():
    clock = measured(prefill=(100, 1.0))  # 10 ms per token
    assert clock.deadline_s(False, 100) == pytest.approx(10.0)
    assert clock.deadline_s(False, 400) == pytest.approx(40.0)
    assert clock.deadline_s(False, 10_000) == 60.0  # capped at the ceiling
    assert clock.deadline_s(False, 10) == 1.5


def test_unmeasured_kind_is_bounded_by_the_measured_one():
    # Only a prefill seen: a decode (one token) is bounded by that whole prefill.
    assert measured(prefill=(40, 0.4)).deadline_s(True, 1) == pytest.approx(4.0)
    # Only decodes seen: a prefill of n tokens by n decodes.
    assert measured(decode_s=0.05).deadline_s(False, 20) == pytest.approx(10.0)


def test_a_node_five_times_slower_than_measured_stays_within_its_deadline():
    clock = measured(decode_s=0.3, prefill=(50, 1.0))
    slowed = 5 * 0.3
    assert slowed < clock.deadline_s(True, 1) == pytest.approx(3.0)
    # It keeps up as it stays slow: the average follows, the deadline with it.
    for _ in range(10):
        t, deadline = clock.begin(True, 1)
        assert slowed < deadline
        clock.end(t, slowed)
    assert clock.decode_s == pytest.approx(slowed, rel=0.05)
    assert clock.deadline_s(True, 1) == pytest.approx(10 * slowed, rel=0.05)
    assert 5 * 1.0 < clock.deadline_s(False, 50)


def test_steps_in_flight_on_the_hop_lengthen_the_deadline():
    clock = measured(decode_s=0.2, prefill=(100, 1.0))
    prefill_ticket, prefill_deadline = clock.begin(False, 300)  # 3 s expected
    assert prefill_deadline == pytest.approx(30.0)
    # A decode queued behind that prefill waits for it: its deadline counts both.
    decode_ticket, decode_deadline = clock.begin(True, 1)
    assert decode_deadline == pytest.approx(10 * (3.0 + 0.2))
    clock.end(prefill_ticket, 3.0)
    clock.end(decode_ticket, 3.1)
    assert clock.deadline_s(True, 1) == pytest.approx(10 * (0.7 * 0.2 + 0.3 * 3.1))


def test_failed_steps_do_not_count_as_measurements():
    clock = measured(decode_s=0.02)
    t, _ = clock.begin(True, 1)
    clock.end(t)  # no answer
    assert clock.decode_s == 0.02 and clock.deadline_s(True, 1) == 1.5


def test_clocks_are_per_node_and_shared():
    clocks = HopClocks(POLICY)
    t, _ = clocks["a"].begin(True, 1)
    clocks["a"].end(t, 0.5)
    assert clocks["a"].deadline_s(True, 1) == pytest.approx(5.0)
    assert clocks["b"].deadline_s(True, 1) == 5.0


@pytest.mark.parametrize("kw", [dict(floor_s=0), dict(floor_s=70), dict(factor=0.5), dict(smoothing=0),
                                dict(unmeasured_s=0), dict(probe_s=0)])
def test_policy_refuses_nonsense(kw):
    with pytest.raises(ValueError):
        DeadlinePolicy(**kw)
