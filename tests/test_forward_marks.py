"""What a node's Health says of the next nodes it could not forward to, and what a client makes of it:
a link is taken as cut only for the node at the data address the client's own route names for it.

In-process fake nodes (gRPC for Health, a data plane for steps) on loopback."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc

from meshnet.client.deadline import DeadlinePolicy, HopClocks
from meshnet.client.forwarded import run_forwarded
from meshnet.client.remote import RemoteStage
from meshnet.contract import ArtifactId, LayerRange, StepRequest
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.engine.fake_faults import FakeFaults
from meshnet.load_spec import LoadSpec
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane import ConnectionPool
from meshnet.wire.data_plane_server import DataPlaneServer
from meshnet.wire.security import open_channel


class _Node:
    """A fake node serving ``layers`` of the fake model: gRPC and a data plane, and the client's stage."""

    def __init__(self, node_id: str, layers: tuple[int, int], faults: FakeFaults | None = None) -> None:
        engine = FakeEngine(FakeModel(), faults)
        assert engine.load(LoadSpec(path="", artifact=ArtifactId(FakeModel().sha256, LayerRange(*layers)))).ok
        self.service = NodeService(engine, node_id, pb.ModelIdentity())
        self.grpc = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_NodeServicer_to_server(self.service, self.grpc)
        address = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        self.grpc.start()
        self.data = DataPlaneServer("127.0.0.1", 0, self.service.run_step, run_forward=self.service.run_forward,
                                    run_await=self.service.run_await)
        self.data.start()
        self.stage = RemoteStage(node_id, address, open_channel(address), timeout_s=10.0, probe_s=0.3,
                                 data_pool=ConnectionPool(f"127.0.0.1:{self.data.port}", None, 10.0))
        self.stage.layers = layers

    def close(self) -> None:
        self.stage.data_pool.close()
        self.data.stop()
        self.grpc.stop(0).wait()
        self.service.forwarder.close()


def test_a_step_naming_a_node_at_a_dead_address_does_not_cut_the_clients_link_to_it():
    """Anyone with the join token could send the head a step naming the tail's id at a dead address: the
    head's Health then named that id as a node it could not reach, and a client whose forwarded step was
    overdue there (the head slow: it answers once it has sent its output on) took its own link to the tail
    as cut, failed the step and stepped the route itself for minutes. Health names the address too; a
    failure at the route's own address still cuts."""
    head, tail = _Node("a-head", (0, 10), FakeFaults(delay_s=1.0)), _Node("b-tail", (10, 30))
    clocks = HopClocks(DeadlinePolicy())
    try:
        with socket.socket() as s:  # nothing listens here: connecting is refused at once
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        bogus = pb.ForwardHop(node_id="b-tail", data_address=dead)
        res, failure = head.stage.step_forwarded(StepRequest("bogus", 1, 0, (1, 2, 3)), False, [bogus], 10.0)
        assert res.ok and failure.node_id == "b-tail" and failure.unreachable
        # The head takes 1 s: the hops' Health is asked every 0.3 s meanwhile, before it forwards the step.
        res, failed_at = run_forwarded([head.stage, tail.stage], StepRequest("s", 1, 0, (1, 2, 3)), False, clocks)
        assert res.ok and res.token is not None and failed_at is None
        assert head.stage.unreachable_next == {("b-tail", dead)}
        assert not head.stage.cannot_reach(tail.stage)
        # The head fails to forward to the tail at the route's address: that link is cut.
        tail.data.stop()
        res, failure = head.stage.step_forwarded(StepRequest("real", 1, 0, (1, 2, 3)), False,
                                                 [tail.stage.forward_hop()], 10.0)
        assert res.ok and failure.node_id == "b-tail" and failure.unreachable
        assert head.stage.answers() and head.stage.cannot_reach(tail.stage)
    finally:
        head.close()
        tail.close()
