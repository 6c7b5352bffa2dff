"""How much of a step is new work: pure functions over plain integers, no database.

A step a node completed covers a rectangle of (token positions) x (layers) of one session: positions
``[position, position + n_tokens)`` through layers ``[layer_start, layer_end)``. Its credit is the part of
that rectangle no earlier step of the session covered, in *token-layers* (one token through one layer).
So a step replayed after a failover (on the same node or on a replacement for the same range), resent
after a tracker outage, or repeated by a retrying client earns nothing the second time; and a replacement
serving a different range than the node it replaces is credited only for the layers nobody ran yet.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class Rect(NamedTuple):
    """Positions ``[p0, p1)`` x layers ``[l0, l1)``; empty when ``p0 >= p1`` or ``l0 >= l1``."""

    p0: int
    p1: int
    l0: int
    l1: int

    @property
    def area(self) -> int:
        return max(self.p1 - self.p0, 0) * max(self.l1 - self.l0, 0)


def new_area(rect: Rect, covered: Iterable[Rect]) -> int:
    """Token-layers of ``rect`` outside the union of ``covered``.

    Sweeps the layer boundaries (few: routes split a model at a handful of layers) and, in each layer
    band, merges the covered position intervals; O(B * k log k) for k overlapping rectangles and B
    distinct layer boundaries.
    """
    if rect.area <= 0:
        return 0
    p0, p1, l0, l1 = rect
    # Only the rectangles that overlap are clipped: a session's decode steps mostly do not (a tracker
    # credits every node's steps of every session, once per heartbeat).
    clipped = [Rect(max(c.p0, p0), min(c.p1, p1), max(c.l0, l0), min(c.l1, l1))
               for c in covered if c.p0 < p1 and c.p1 > p0 and c.l0 < l1 and c.l1 > l0]
    if not clipped:
        return rect.area
    bounds = sorted({rect.l0, rect.l1, *(c.l0 for c in clipped), *(c.l1 for c in clipped)})
    uncovered = 0
    for lo, hi in zip(bounds, bounds[1:]):
        spans = sorted((c.p0, c.p1) for c in clipped if c.l0 <= lo and c.l1 >= hi)
        covered_len, end = 0, rect.p0
        for a, b in spans:
            a = max(a, end)
            if b > a:
                covered_len += b - a
                end = b
        uncovered += (rect.p1 - rect.p0 - covered_len) * (hi - lo)
    return uncovered
