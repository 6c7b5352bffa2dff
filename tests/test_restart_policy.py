"""The restart backoff of ``meshnet up``'s supervisor, as plain data."""

from __future__ import annotations

import math

import pytest

from meshnet.restart_policy import RestartDecision, RestartPolicy, next_restart


def _delays(policy: RestartPolicy, runs_s: list[float]) -> list[float]:
    quick, out = 0, []
    for ran in runs_s:
        d = next_restart(policy, ran, quick)
        quick = d.quick_exits
        out.append(d.delay_s)
    return out


def test_quick_exits_double_the_delay_up_to_the_cap():
    assert _delays(RestartPolicy(), [0.1] * 8) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert next_restart(RestartPolicy(), 1.0, 0) == RestartDecision(0.5, 1)
    assert next_restart(RestartPolicy(), 1.0, 4) == RestartDecision(8.0, 5)
    # Far past the cap the delay stays at the cap (no overflow).
    assert next_restart(RestartPolicy(), 0.0, 10_000) == RestartDecision(10.0, 10_001)


def test_a_healthy_run_resets_the_backoff():
    policy = RestartPolicy(initial_delay_s=0.5, max_delay_s=10.0, healthy_after_s=30.0)
    # Three quick exits, a run of exactly 30 s, then quick exits again.
    assert _delays(policy, [1, 1, 1, 30.0, 29.9, 1]) == [0.5, 1.0, 2.0, 0.5, 1.0, 2.0]
    assert next_restart(policy, 3600.0, 7) == RestartDecision(0.5, 1)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"initial_delay_s": 0}, "initial_delay_s must be > 0"),
    ({"initial_delay_s": 2, "max_delay_s": 1}, "max_delay_s (1) must be at least initial_delay_s (2)"),
    ({"healthy_after_s": -1}, "healthy_after_s must be >= 0"),
    ({"max_delay_s": math.inf}, "max_delay_s must be a finite number"),
    ({"initial_delay_s": "1"}, "initial_delay_s must be a finite number"),
])
def test_bad_policy_is_a_clear_error(kwargs, fragment):
    with pytest.raises(ValueError) as ei:
        RestartPolicy(**kwargs)
    assert fragment in str(ei.value)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="ran_s must be >= 0"):
        next_restart(RestartPolicy(), -1.0, 0)
    with pytest.raises(ValueError, match="ran_s must be >= 0"):
        next_restart(RestartPolicy(), math.nan, 0)
    with pytest.raises(ValueError, match="quick_exits must be >= 0"):
        next_restart(RestartPolicy(), 1.0, -1)
