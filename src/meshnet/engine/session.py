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
