"""The decode speed a node reports: the best of its recent probes, probed again while idle (plain data)."""

from __future__ import annotations

from meshnet.node.speed_probe import IdleSpeed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_low_start_up_figure_is_replaced_by_an_idle_probe_and_the_best_recent_one_is_reported():
    """A node that measured 32 tokens/s at start-up under load (its replica busy beside it) reported 32
    for good and got no session while the replica was not full; idle, it is measured again."""
    clock, measured = Clock(), iter([120.0, 0.0, 90.0, 95.0, 80.0, 85.0, 70.0])
    speed = IdleSpeed(32.0, lambda: next(measured), every_s=60, keep=5, clock=clock, start=lambda f: f())
    assert speed.report(0) == 32.0  # not due yet
    clock.now += 60
    assert speed.report(3) == 32.0  # busy: no probe
    assert speed.report(0) == 120.0  # idle and due: probed (inline here)
    clock.now += 30
    assert speed.report(0) == 120.0  # not due again before every_s
    # A failed probe (0) adds nothing; 120 leaves the last 5 (with the start-up 32) at the fifth after it.
    for expected in (120.0, 120.0, 120.0, 120.0, 120.0, 95.0):
        clock.now += 60
        assert speed.report(0) == expected
    assert speed.tokens_per_s == 95.0


def test_a_probe_runs_off_the_heartbeat_thread_one_at_a_time():
    started = []
    clock = Clock()
    speed = IdleSpeed(0.0, lambda: 50.0, every_s=1, clock=clock, start=started.append)
    assert speed.report(0) == 0.0  # no start-up figure
    clock.now += 1
    speed.report(0)
    clock.now += 5
    speed.report(0)
    assert len(started) == 1  # the first has not finished: no second
    started[0]()
    assert speed.report(0) == 50.0 and len(started) == 2  # due again (5 s since the first began)


def test_a_probe_that_raises_keeps_the_last_figures():
    def broken() -> float:
        raise RuntimeError("the engine worker is restarting")

    clock = Clock()
    speed = IdleSpeed(40.0, broken, every_s=1, clock=clock, start=lambda f: f())
    clock.now += 1
    assert speed.report(0) == 40.0
    clock.now += 1
    assert speed.report(0) == 40.0
