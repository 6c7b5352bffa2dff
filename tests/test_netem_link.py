"""The link model with plain numbers: latency, token-bucket bandwidth, blackhole (no sockets, no clock)."""

from __future__ import annotations

import pytest

from meshnet.netem.link import Link, LinkSpec, TokenBucket


def test_delay_shifts_every_chunk_by_the_one_way_latency():
    link = Link("a", "b", LinkSpec(delay_s=0.025))
    p = link.pipe(True)
    p.send(b"xy", 1.0)
    p.send(b"z", 1.5)
    assert p.next_due() == pytest.approx(1.025)
    assert p.pop_due(1.024) == []
    assert p.pop_due(1.025) == [b"xy"]
    assert p.queued_bytes == 1
    assert p.pop_due(2.0) == [b"z"]
    assert (p.queued_bytes, p.delivered_bytes, p.next_due()) == (0, 3, None)


def test_token_bucket_spends_its_burst_then_paces_at_the_rate():
    b = TokenBucket(rate=1000.0, burst=500.0)
    assert b.reserve(500, 0.0) == 0.0            # the full bucket
    assert b.reserve(250, 0.0) == pytest.approx(0.25)   # 250 bytes accrue at 1000 B/s
    assert b.reserve(1000, 0.0) == pytest.approx(1.25)  # larger than the bucket: waits it out, in order
    assert b.reserve(100, 3.0) == 3.0            # idle since 1.25 s: refilled (to the 500-byte cap)
    assert b.reserve(450, 3.0) == pytest.approx(3.05)


def test_bandwidth_is_shared_by_the_connections_of_one_direction_not_by_the_two_directions():
    link = Link("a", "b", LinkSpec(delay_s=0.010, rate_bps=1000.0, burst_bytes=100))
    c1, c2, back = link.pipe(True), link.pipe(True), link.pipe(False)
    c1.send(b"x" * 100, 0.0)  # the burst: leaves at once
    c2.send(b"y" * 100, 0.0)  # behind it on the same direction: 0.1 s to accrue
    back.send(b"z" * 100, 0.0)  # the other direction has its own bucket
    assert c1.next_due() == pytest.approx(0.010)
    assert c2.next_due() == pytest.approx(0.110)
    assert back.next_due() == pytest.approx(0.010)


def test_blackhole_holds_what_is_in_flight_and_what_is_sent_then_heals_in_order():
    link = Link("a", "b", LinkSpec(delay_s=0.050))
    p = link.pipe(True)
    p.send(b"one", 0.0)  # due at 0.05
    link.update(LinkSpec(delay_s=0.050, blackhole=True), 0.01)
    p.send(b"two", 0.02)
    assert p.next_due() is None and p.pop_due(100.0) == []
    assert p.queued_bytes == 6
    link.update(LinkSpec(delay_s=0.050), 30.0)
    assert p.next_due() == pytest.approx(30.05)
    assert p.pop_due(30.05) == [b"one", b"two"]
    p.send(b"", 31.0)  # end of stream travels like data
    assert p.pop_due(31.05) == [b""]
    assert (p.queued_bytes, p.delivered_bytes) == (0, 6)


def test_a_lowered_delay_never_reorders_a_stream():
    link = Link("a", "b", LinkSpec(delay_s=1.0))
    p = link.pipe(True)
    p.send(b"first", 0.0)
    link.update(LinkSpec(delay_s=0.0), 0.1)
    p.send(b"second", 0.2)
    assert p.pop_due(0.5) == []
    assert p.pop_due(1.0) == [b"first", b"second"]


def test_rate_change_refills_and_counts_connections():
    link = Link("a", "b", LinkSpec(rate_bps=10.0, burst_bytes=10))
    p, q = link.pipe(True), link.pipe(False)
    assert link.open_connections == 1
    p.send(b"x" * 10, 0.0)
    p.send(b"x" * 10, 0.0)
    assert p._flight[-1][0] == pytest.approx(1.0)
    link.update(LinkSpec(rate_bps=100.0, burst_bytes=100), 0.0)
    p.send(b"x" * 100, 0.0)
    assert p.next_due() == 0.0 and p._flight[-1][0] == pytest.approx(1.0)  # order kept behind the old chunk
    link.drop(p)
    link.drop(q)
    assert link.open_connections == 0


@pytest.mark.parametrize("kw", [dict(delay_s=-1), dict(rate_bps=0), dict(burst_bytes=0)])
def test_spec_refuses_impossible_values(kw):
    with pytest.raises(ValueError):
        LinkSpec(**kw)
