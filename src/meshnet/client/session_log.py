"""What the mesh client keeps of each session so that a failover can rebuild it: the route it is on and
every step it has run, with each hop's input, and which hops hold that whole history.

Speculative steps are recorded like any other: a verification step with all its rows, and the step after
it with its ``rollback`` flag, so a replay computes the rejected rows again and drops them again at the
same point, leaving the same cells as the original run."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet.client.remote import RemoteStage
from meshnet.contract import NamedTensor, StepRequest


@dataclass
class RecordedStep:
    """One successful step of a session: the request (without hidden) and each hop's input."""

    req: StepRequest
    decode: bool
    inputs: list[NamedTensor | None]  # inputs[i] = what hop i received (None on the head)
    # How many leading hops' inputs ``inputs`` holds: all for a client-orchestrated step, the head's only
    # (its token ids) for a forwarded one, whose hidden states the client never saw.
    through: int = 1 << 30


@dataclass
class SessionLog:
    """One session as this client runs it: its route (``hops``, at route ``epoch``) and history."""

    session_id: str
    epoch: int
    hops: list[RemoteStage]
    steps: list[RecordedStep] = field(default_factory=list)
    # Leading hops whose KV caches hold every recorded step; fewer while a replay is under way (a node
    # failing in the middle of one leaves the hops from `intact` to `kept_from` with part of the history;
    # the hops from `kept_from` on, which the replay does not reach, keep all of it).
    intact: int = 1 << 30
    kept_from: int = 1 << 30
    # Node id -> the steps in a row, up to the last one, that found the node had lost the session.
    lost_in_a_row: dict[str, int] = field(default_factory=dict)
    cancelled: bool = False  # its consumer cancelled it: a replay waiting for room gives up
    last_failure: str = ""  # the last node failure its steps met: named when no route replaces the node

    @property
    def tokens_needed(self) -> int:
        """Tokens the session must be able to hold on every hop of a new route: what its first step
        reserved (its prompt and every token it may generate), at least what its steps hold so far."""
        held = max((r.req.position + len(r.req.token_ids) for r in self.steps), default=0)
        return max(held, self.steps[0].req.reserve_tokens if self.steps else 0)


def same_ranges(old: list[RemoteStage], new: list[RemoteStage]) -> bool:
    """Whether ``new`` serves the same layer ranges in the same order as ``old`` (so each new hop takes
    the inputs recorded for the old one)."""
    ranges = [[getattr(h, "layers", None) for h in hops] for hops in (old, new)]
    return ranges[0] == ranges[1] and None not in ranges[0]
