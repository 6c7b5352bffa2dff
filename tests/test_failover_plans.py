"""Failover decisions of the mesh client, with in-process fake hops instead of node processes: which hop
a step resumes at when nodes fail during the step and during its replay."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from mesh_util import wait_for
from meshnet.client.mesh_client import MeshClient
from meshnet.client.remote import RemoteStage, StageFailure
from meshnet.contract import ArtifactId, LayerRange, Outcome, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel

PROMPT = (5, 6, 7, 8)


class FakeHop:
    """A node serving ``layers`` with a fake engine; ``fail_on`` (a set of step numbers, counting every
    step this hop is sent) makes those steps fail as an unreachable node's would."""

    def __init__(self, node_id: str, layers: LayerRange, fail_on: set[int] = frozenset()) -> None:
        self.node_id, self.address = node_id, f"{node_id}:1"
        self.engine = FakeEngine(FakeModel())
        assert self.engine.load(LoadSpec(path="", artifact=ArtifactId("", layers))).ok
        self.fail_on, self.sent = set(fail_on), 0
        self.layers = (layers.start, layers.end)
        self.numerics = self.engine.capabilities().numerics  # as the route would carry it

    def step(self, req: StepRequest, decode: bool, timeout_s: float | None = None):
        self.sent += 1
        if self.sent in self.fail_on:
            raise StageFailure(self.node_id, self.address, "UNAVAILABLE", f"step {self.sent} injected")
        return self.engine.decode(req) if decode else self.engine.prefill(req)

    def replay(self, steps, timeout_s: float | None = None):
        """As a node without a data plane replays: one step after another, up to the first refusal."""
        results = []
        for req, decode in steps:
            results.append(self.step(req, decode))
            if not results[-1].ok:
                break
        return results

    def release(self, session_id: str, superseded_by: int = 0, timeout_s: float = 5.0) -> Outcome:
        if superseded_by:
            return self.engine.release_superseded(session_id, superseded_by)
        return self.engine.release(session_id)

    def cancel(self, session_id: str) -> Outcome:
        return self.engine.cancel(session_id)

    def answers(self) -> bool:
        return True

    def capabilities(self, timeout_s: float = 5.0):
        return self.engine.capabilities()


def _client(hops: list[FakeHop]) -> MeshClient:
    """A client whose tracker routes through the first hop of each range not excluded."""
    client = MeshClient("127.0.0.1:1", report_deliveries=False)
    ranges = sorted({(h.engine.capabilities().artifact.layers.start, h.engine.capabilities().artifact.layers.end)
                     for h in hops})

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        picked = [next(h for h in hops if (h.engine.capabilities().artifact.layers.start,
                                           h.engine.capabilities().artifact.layers.end) == r
                       and h.node_id not in exclude) for r in ranges]
        return previous_epoch + 1, picked

    client.router.route = route  # type: ignore[method-assign]
    return client


def _tokens(client: MeshClient, sid: str, n: int) -> list[int]:
    res = client.step(StepRequest(sid, 0, 0, PROMPT), decode=False)
    assert res.ok, res.message
    out = [res.token.token_id]
    for k in range(n - 1):
        res = client.step(StepRequest(sid, 0, len(PROMPT) + k, (out[-1],)), decode=True)
        assert res.ok, res.message
        out.append(res.token.token_id)
    return out


def _mesh(head_fail=frozenset(), tail_fail=frozenset()) -> list[FakeHop]:
    head, tail = LayerRange(0, 15), LayerRange(15, 30)
    return [FakeHop("h0a", head, head_fail), FakeHop("h0b", head), FakeHop("h1a", tail, tail_fail),
            FakeHop("h1b", tail)]


def test_a_step_resumes_no_later_than_the_first_hop_it_has_not_reached():
    """The head fails on the 6th step; during the replay onto the spare head, the tail fails too (its
    6th message is the replay's first step). The second route changes only the tail, but the spare head
    holds only part of the history (the replay stopped after its first step) and the step itself never
    got past the head: both are replayed and the step starts again at the head, instead of sending the
    tail no input or the head a position it has not reached."""
    plain = _client(_mesh())
    want = _tokens(plain, "s", 10)
    plain.close()
    hops = _mesh(head_fail={6}, tail_fail={6})
    client = _client(hops)
    assert _tokens(client, "s", 10) == want
    assert client.failovers == 2
    # The failed head and tail hold no copy once the orphan releaser reached them; the route holds one.
    assert wait_for(lambda: client.orphans.pending() == 0, 5.0) is not None
    assert [h.engine.session_ids() for h in hops] == [[], ["s"], [], ["s"]]
    client.release("s")
    assert [h.engine.session_ids() for h in hops] == [[], [], [], []]
    client.close()


def test_a_node_that_answers_health_but_fails_every_step_is_given_up_at_the_failover_deadline():
    """A node that refused this client's data-plane connections while its gRPC port answered Health was
    let back in at once, over and over: `meshnet generate` failed over 150 times a second without end."""
    from meshnet.client.mesh_client import MeshUnavailable

    head, tail = FakeHop("a", LayerRange(0, 15)), FakeHop("b", LayerRange(15, 30), fail_on=set(range(2, 10**6)))
    client = _client([head, tail])

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        if "b" in exclude:
            raise MeshUnavailable("no node serves [15, 30)")
        return previous_epoch + 1, [head, tail]

    client.router.route = route  # type: ignore[method-assign]
    client.router.route_through_recovered = lambda failed_at, previous_epoch, *_: (previous_epoch + 1, [head, tail])
    client.failover_deadline_s = 1.0
    res = client.step(StepRequest("s", 0, 0, PROMPT), decode=False)
    assert res.ok
    outcome = []

    def decode():
        try:
            client.step(StepRequest("s", 0, len(PROMPT), (res.token.token_id,)), decode=True)
        except MeshUnavailable as e:
            outcome.append(str(e))

    worker = threading.Thread(target=decode, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "still failing over after 10 s"
    [message] = outcome
    assert re.match(r"session s: still failing after 1 s of failovers \([1-9] s into the step\): node b at b:1: "
                    r"UNAVAILABLE: step ", message), message
    assert 4 <= tail.sent <= 8  # a failover every REPEAT_FAILURE_PAUSE_S, not a hot loop
    client.close()


def test_a_node_routed_around_for_the_context_length_is_not_stepped_through_and_warned_of_again(caplog):
    """A node the tracker lists at an address that refuses this client (a loopback-only node seen from
    another machine; here a closed port on 127.0.0.1): reading the route's context length routes around
    it, with one warning. The session's first step then went through it all the same, failed and failed
    over: a second warning for the same node, and a failover for nothing."""
    from mesh_util import free_port

    from meshnet.wire.security import open_channel

    address = f"127.0.0.1:{free_port()}"
    channel = open_channel(address, None, None)
    refusing = RemoteStage("b-loop", address, channel, timeout_s=5.0)
    head, spare = FakeHop("a", LayerRange(0, 15)), FakeHop("c", LayerRange(15, 30))
    client = MeshClient("127.0.0.1:1", report_deliveries=False)

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        return previous_epoch + 1, [head, spare if "b-loop" in exclude else refusing]  # as the tracker would

    client.router.route = route  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="meshnet.client"):
            _, hops, n_ctx = client.route_with_context()
            assert [h.node_id for h in hops] == ["a", "c"] and n_ctx == head.engine.capabilities().n_ctx
            assert len(_tokens(client, "s", 4)) == 4
        warnings = [r.getMessage() for r in caplog.records if "b-loop" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"node b-loop at {address}: UNAVAILABLE: ") and \
            warnings[0].endswith("; routing around it"), warnings
        assert client.failovers == 0
    finally:
        client.close()
        channel.close()


def test_the_api_looks_at_a_route_around_a_node_it_found_down_and_warns_of_it_once(caplog):
    """The API checks a route before each request and reads its context length when the route changes.
    A node the tracker still lists after it died (until its heartbeats lapse) was queried and warned of
    by every request whose route went through it; it is now recorded as found down, and the next
    requests look at the route a new session takes, around it."""
    from mesh_util import free_port

    from meshnet.api.route_watch import RouteWatch
    from meshnet.wire.security import open_channel

    address = f"127.0.0.1:{free_port()}"
    channel = open_channel(address, None, None)
    dead = RemoteStage("b-dead", address, channel, timeout_s=5.0)
    head, spare = FakeHop("a", LayerRange(0, 15)), FakeHop("c", LayerRange(15, 30))
    client = MeshClient("127.0.0.1:1", report_deliveries=False)
    asked = []

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        asked.append((set(exclude), opens_session))
        return previous_epoch + 1, [head, spare if "b-dead" in exclude else dead]  # as the tracker would

    client.router.route = route  # type: ignore[method-assign]
    watch = RouteWatch(client, 123)
    try:
        with caplog.at_level(logging.INFO, logger="meshnet.api"):
            routes = [watch.check() for _ in range(4)]
        assert routes[0] == ["a@a:1", f"b-dead@{address}"]
        assert routes[1:] == [["a@a:1", "c@c:1"]] * 3
        assert watch.n_ctx() == head.engine.capabilities().n_ctx
        warnings = [r.getMessage() for r in caplog.records if "b-dead" in r.getMessage()]
        assert len(warnings) == 1 and "could not read the route's context length" in warnings[0], warnings
        assert [opens for _, opens in asked] == [False] * 4  # looking opens no session on the nodes
        # The first route read is said once (the API said at start when there was none yet).
        n_ctx = head.engine.capabilities().n_ctx
        assert [r.getMessage() for r in caplog.records if "complete route" in r.getMessage()] == [
            f"the mesh has a complete route: a@a:1 -> c@c:1 ({n_ctx} tokens of context)"]
    finally:
        client.close()
        channel.close()


def test_the_api_says_once_when_the_mesh_loses_its_route_and_once_when_it_is_back(caplog):
    """`meshnet api --tracker` answered 503s while its mesh had no complete route and logged nothing, nor
    when the route came back: each is now said once, however many requests check meanwhile."""
    from meshnet.api.route_watch import RouteWatch
    from meshnet.client.router import MeshUnavailable

    head, tail = FakeHop("a", LayerRange(0, 15)), FakeHop("c", LayerRange(15, 30))
    client = MeshClient("127.0.0.1:1", report_deliveries=False)
    up = [True, False, False, False, True, True]

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        if not up.pop(0):
            raise MeshUnavailable("no route: no node serves layers [15, 30)")
        return previous_epoch + 1, [head, tail]

    client.router.route = route  # type: ignore[method-assign]
    watch = RouteWatch(client, 123)
    results = []
    try:
        with caplog.at_level(logging.INFO, logger="meshnet.api"):
            for _ in range(6):
                try:
                    results.append(watch.check())
                except MeshUnavailable:
                    results.append(None)
        assert results == [["a@a:1", "c@c:1"], None, None, None, ["a@a:1", "c@c:1"], ["a@a:1", "c@c:1"]]
        said = [r.getMessage() for r in caplog.records if "route" in r.getMessage()]
        assert said[1:] == ["the mesh has no complete route now (requests get 503 until it has): no node serves "
                            "layers [15, 30)", "the mesh has a complete route again: a@a:1 -> c@c:1"], said
    finally:
        client.close()


def test_health_refuses_a_route_through_a_node_found_down_that_does_not_answer_but_requests_still_try_it():
    """``/health`` said "ok" for up to three heartbeats after the only node of a range died (the tracker
    still listed it), while requests waited out the failover deadline for a 503. Now a hop this client
    found down lately must answer a health probe for ``/health``; a request's own check does not probe
    (a node restarting at its address is waited for by the request's failover)."""
    from mesh_util import free_port

    from meshnet.api.route_watch import RouteWatch
    from meshnet.client.node_failures import NodeFailures
    from meshnet.client.router import MeshUnavailable
    from meshnet.wire.security import open_channel

    address = f"127.0.0.1:{free_port()}"
    channel = open_channel(address, None, None)
    dead = RemoteStage("b-dead", address, channel, timeout_s=5.0)
    head = FakeHop("a", LayerRange(0, 15))
    client = MeshClient("127.0.0.1:1", report_deliveries=False)

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        return previous_epoch + 1, [head, dead]  # no spare: the tracker lists the dead node until it lapses

    client.router.route = route  # type: ignore[method-assign]
    watch = RouteWatch(client, 123)
    try:
        assert watch.check(probe_found_down=True) == ["a@a:1", f"b-dead@{address}"]  # nobody found it down yet
        client.node_failures.record("b-dead", address, "UNAVAILABLE: connection refused", time.monotonic())
        with pytest.raises(MeshUnavailable, match=f"node b-dead at {address} was found down and does not answer a "
                           r"health probe from this machine \(if it runs: is its port open to this machine\? a "
                           r"node behind NAT or a firewall joins with --relay\)$"):
            watch.check(probe_found_down=True)
        assert watch.check() == ["a@a:1", f"b-dead@{address}"]
        client.node_failures = NodeFailures()  # only the head found down, and it answers: ok
        client.node_failures.record("a", "a:1", "UNAVAILABLE: a step timed out", time.monotonic())
        assert watch.check(probe_found_down=True) == ["a@a:1", f"b-dead@{address}"]
    finally:
        client.close()
        channel.close()


def test_a_hop_that_never_answers_is_left_out_and_the_error_says_why_and_what_to_do():
    """A node the tracker reaches but this client cannot (NAT without --relay, a wrong --advertise: its
    packets dropped) held every new client for 5 s, and with no other node for its range the error said
    only "no node serves layers [15, 30) (excluded: ...)". Its capabilities are now waited for 2 s, and the
    error names the node, its failure and the fix."""
    import socket

    from meshnet.client.router import CAPABILITIES_TIMEOUT_S, MeshUnavailable
    from meshnet.wire.security import open_channel

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # connections complete in the backlog; nothing ever answers on them
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    channel = open_channel(address, None, None)
    silent = RemoteStage("b-silent", address, channel, timeout_s=5.0)
    head = FakeHop("a", LayerRange(0, 15))
    client = MeshClient("127.0.0.1:1", report_deliveries=False, failover_deadline_s=CAPABILITIES_TIMEOUT_S + 0.5)

    def route(exclude=frozenset(), previous_epoch=0, min_n_ctx=0, like=(), opens_session=False):
        if "b-silent" in exclude:
            raise MeshUnavailable("no route: no node serves layers [15, 30) (excluded: b-silent)")
        return previous_epoch + 1, [head, silent]

    client.router.route = route  # type: ignore[method-assign]
    try:
        with pytest.raises(MeshUnavailable) as ei:
            client.route_with_context()
        assert str(ei.value) == (
            f"no route: no node serves layers [15, 30) (excluded: b-silent); node b-silent at {address}: "
            f"DEADLINE_EXCEEDED: no answer within {CAPABILITIES_TIMEOUT_S:g} s: is its port open to this machine? (a "
            "node behind NAT or a firewall joins with --relay; one with a wrong --advertise address registers one "
            "nobody reaches)")
        assert client.node_failures.recent(time.monotonic()) == {"b-silent"}
    finally:
        client.close()
        channel.close()
        listener.close()


def test_a_busy_hop_that_answers_health_is_waited_for_to_free_its_old_copy():
    """A head busy with a long prefill chunk let a failover's release of its old copy wait past 1 s, and was
    taken for dead with the middle node that had died: a healthy head was replaced too. A hop that answers
    Health is now waited for up to its step timeout; one that does not still fails the replay."""
    from meshnet.client.replay import free_old_copies
    from meshnet.contract import Status

    class Busy:
        node_id, address, timeout_s = "a-head", "a:1", 30.0

        def __init__(self, alive: bool) -> None:
            self.alive, self.waits = alive, []

        def release(self, session_id, superseded_by=0, timeout_s=5.0):
            self.waits.append(timeout_s)
            if len(self.waits) == 1:
                return Outcome(Status.FAILED_PRECONDITION, "DEADLINE_EXCEEDED: Deadline Exceeded")
            return Outcome(Status.OK)

        def answers(self) -> bool:
            return self.alive

    busy = Busy(alive=True)
    free_old_copies([busy], "s", 2, 1.0)
    assert busy.waits == [1.0, 30.0]
    dead = Busy(alive=False)
    with pytest.raises(StageFailure, match="could not free its old copy of the session: DEADLINE_EXCEEDED"):
        free_old_copies([dead], "s", 2, 1.0)
    assert dead.waits == [1.0]
