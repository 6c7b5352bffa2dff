"""The tracker goes away while its nodes keep serving: a client that has had a route goes on opening
sessions through it, and one that never had a route gets a clear error."""

from __future__ import annotations

import pytest

from meshnet.client.mesh_client import MeshClient, MeshUnavailable
from meshnet.contract import GREEDY
from meshnet.generation import generate


def test_new_sessions_take_the_last_route_while_the_tracker_is_down(mesh, tok, solo):
    head, tail = mesh.start_nodes([("a-head", "0:15"), ("d-tail", "15:30")])
    client = MeshClient(mesh.tracker, report_deliveries=False)
    before = generate(client, tok, solo.prompt_ids(0), 16, GREEDY, stop_at_eog=False)
    assert before.generated_token_ids == solo.greedy(0, 16)
    mesh.server.stop(grace=0).wait()
    during = generate(client, tok, solo.prompt_ids(1), 16, GREEDY, stop_at_eog=False)
    assert during.generated_token_ids == solo.greedy(1, 16)
    assert client.failovers == 0
    assert [head.active_sessions(), tail.active_sessions()] == [0, 0]
    # A failed node in the last route leaves nothing to take without the tracker.
    with pytest.raises(MeshUnavailable, match="goes through a failed node"):
        client.route({head.node_id})
    # Nor one whose node died meanwhile: the route came back as it was (the API's /health said "ok" for
    # it, and each new session waited out a failover's deadline to learn otherwise).
    tail.kill()
    with pytest.raises(MeshUnavailable, match=f"node {tail.node_id} of its last route does not answer at "):
        client.route()
    client.close()
    fresh = MeshClient(mesh.tracker, report_deliveries=False)
    with pytest.raises(MeshUnavailable, match="no route: "):
        fresh.route()
    fresh.close()
