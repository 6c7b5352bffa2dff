"""When to restart a process that exited: exponential backoff that resets after a healthy run.

Pure: plain numbers in, a decision out, no clock and no processes (:mod:`meshnet.supervisor` applies it).
With the defaults a process that keeps exiting at once is restarted after 0.5, 1, 2, 4, 8, 10, 10, ...
seconds; one that ran for at least 30 s before exiting is restarted after 0.5 s again. How it ended, in the
words both supervisors (``meshnet up``'s and a node's engine worker's) log it: :func:`exit_reason`.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

# 2**64 times any sensible initial delay is past any cap; capping the exponent keeps the float finite.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True)
class RestartPolicy:
    """How long to wait before restarting a process that exited.

    Attributes:
        initial_delay_s: the wait, in seconds, after the first exit of a run of quick exits (> 0).
        max_delay_s: the longest wait, in seconds (>= ``initial_delay_s``).
        healthy_after_s: a process that ran at least this many seconds exited after a healthy run: the
            backoff starts again from ``initial_delay_s`` (>= 0).

    Raises:
        ValueError: a field out of its range, or not a finite number (the message names it).
    """

    initial_delay_s: float = 0.5
    max_delay_s: float = 10.0
    healthy_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("initial_delay_s", "max_delay_s", "healthy_after_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"restart policy: {name} must be a finite number of seconds, got {value!r}")
        if self.initial_delay_s <= 0:
            raise ValueError(f"restart policy: initial_delay_s must be > 0 seconds, got {self.initial_delay_s}")
        if self.max_delay_s < self.initial_delay_s:
            raise ValueError(f"restart policy: max_delay_s ({self.max_delay_s}) must be at least "
                             f"initial_delay_s ({self.initial_delay_s})")
        if self.healthy_after_s < 0:
            raise ValueError(f"restart policy: healthy_after_s must be >= 0 seconds, got {self.healthy_after_s}")


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one exit.

    Attributes:
        delay_s: seconds to wait before starting the process again.
        quick_exits: exits in a row that came before ``healthy_after_s``, this one included; pass it to
            the next :func:`next_restart` for the same process.
    """

    delay_s: float
    quick_exits: int


def next_restart(policy: RestartPolicy, ran_s: float, quick_exits: int) -> RestartDecision:
    """Decide the wait before restarting a process that just exited.

    Args:
        policy: the backoff.
        ran_s: how long, in seconds, the process ran before it exited (>= 0).
        quick_exits: ``quick_exits`` of the previous decision for this process; 0 for its first exit.

    Raises:
        ValueError: ``ran_s`` negative or not a number, or ``quick_exits`` negative.
    """
    if not ran_s >= 0:  # also catches NaN
        raise ValueError(f"ran_s must be >= 0 seconds, got {ran_s}")
    if quick_exits < 0:
        raise ValueError(f"quick_exits must be >= 0, got {quick_exits}")
    if ran_s >= policy.healthy_after_s:
        quick_exits = 0  # it had recovered: this exit starts a new run of quick exits
    delay = policy.initial_delay_s * 2.0 ** min(quick_exits, _MAX_DOUBLINGS)
    return RestartDecision(min(delay, policy.max_delay_s), quick_exits + 1)


def exit_reason(returncode: int) -> str:
    """How a process ended, as its supervisor says it: ``"exited with status 70"``, or ``"killed by SIGSEGV"``
    for the negative return code Popen gives a process a signal ended."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"
