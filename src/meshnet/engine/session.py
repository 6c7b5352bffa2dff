"""A session's record on a stage: one per open session, kept by :class:`~meshnet.engine.base.ShardEngine`
(which owns its lifecycle: opened at its first step, retired at release, cancel or the idle sweep)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Session:
    """One session's bookkeeping on this stage; ``state`` is the engine's own (its KV cache)."""

    session_id: str
    epoch: int
    state: Any
    n_past: int = 0
    token_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0  # steps it ran, and the longest time from one's end to the next's (its first: from opening)
    longest_gap_s: float = 0.0
    busy: bool = False  # a step of it is queued or running; the next one waits, release waits too
    grammar: Any = None  # on the tail, its SessionGrammar while its steps carry a grammar

    def stepped(self, now: float, ok: bool) -> None:
        """A step of it ended at ``now`` (monotonic seconds); ``ok``: it ran, and counts with its gap."""
        if ok:
            self.steps += 1
            self.longest_gap_s = max(self.longest_gap_s, now - self.last_used)
        self.last_used = now

    def idle_past(self, now: float, idle_s: float, gap_factor: float = 0.0) -> bool:
        """Whether it is unused (no step running) for over ``idle_s`` seconds and, with ``gap_factor`` > 0,
        ran 2 steps or more and is unused for over ``gap_factor`` times its longest gap between them."""
        idle = now - self.last_used
        if self.busy or idle <= idle_s:
            return False
        return not gap_factor or (self.steps >= 2 and idle > gap_factor * self.longest_gap_s)
