"""The one error a lane, a certification or a device placement raises when a backend cannot be used."""

from __future__ import annotations


class BackendUnavailable(ValueError):
    """A backend cannot be used on this machine; ``reason`` says exactly why (e.g. ``nvcc is not on
    PATH``). The message reads ``backend LANE is not usable here: REASON``.

    A ValueError so that ``meshnet``'s command line reports it as a usage error (exit status 2).

    Attributes:
        lane: cpu, cuda, rocm, vulkan or metal.
        reason: the exact reason, without the lane prefix.
    """

    def __init__(self, lane: str, reason: str) -> None:
        super().__init__(f"backend {lane} is not usable here: {reason}")
        self.lane = lane
        self.reason = reason
