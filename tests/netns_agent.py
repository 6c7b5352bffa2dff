"""A mesh client run inside a host's network namespace for the netns tests, driven over stdin/stdout.

One JSON object per line each way. Commands carry an ``id``; each gets one reply ``{"id": ..., ...}``
(``"error"`` set when it failed). ``generate`` runs in the background and emits events without an id:
``{"event": "token", "i": I, "id_": TOKEN_ID, "t": MONOTONIC_S}`` per token, then ``{"event": "done",
"ids": [...], "failovers": N, "error": null}``. Commands:

- ``{"op": "generate", "prompt_ids": [...], "n": 64, "pace_s": 0.0, "forwarding": true}``: a greedy
  generation, ``pace_s`` seconds between tokens (the reader of a slow stream), without stopping at
  end-of-generation; ``forwarding`` false: client-orchestrated steps.
- ``{"op": "route"}`` -> ``{"nodes": [node ids of a fresh route]}``
- ``{"op": "nodes"}`` -> ``{"nodes": {node id: active sessions}}`` as the tracker lists them
- ``{"op": "sessions", "address": "HOST:PORT"}`` -> ``{"active": N}`` (the node's Health)
- ``{"op": "orphans"}`` -> ``{"pending": N, "released": N}``
- ``{"op": "ledger"}`` -> ``{"nodes": {id: [prefill token-layers, decode token-layers, steps]},
  "clients": {id: [delivered tokens, sessions]}}`` (this client is "netns-client")
CLOCK_MONOTONIC is shared by every namespace of the machine, so the test compares its ``t`` with its own.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from meshnet.client.mesh_client import MeshClient
from meshnet.contract import GREEDY
from meshnet.generation import Generation
from meshnet.model.bundled import resolve_model
from meshnet.netem.netns_mesh import listed_nodes
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tokenizer import GGUFTokenizer
from meshnet.wire.security import open_channel

_out = threading.Lock()


def emit(obj: dict) -> None:
    with _out:
        print(json.dumps(obj), flush=True)


def generate(client: MeshClient, tok: GGUFTokenizer, cmd: dict) -> None:
    client.forwarding = cmd.get("forwarding", True)
    gen = Generation(client, tok, cmd["prompt_ids"], cmd["n"], GREEDY, stop_at_eog=False)
    error = None
    try:
        for i, ev in enumerate(gen):
            emit({"event": "token", "i": i, "id_": ev.token.token_id, "t": time.monotonic()})
            time.sleep(cmd.get("pace_s", 0.0))
    except Exception as e:  # noqa: BLE001 - the test reads what failed
        error = f"{type(e).__name__}: {e}"
    emit({"event": "done", "ids": gen.result.generated_token_ids, "failovers": client.failovers, "error": error})


def answer(client: MeshClient, tracker: pb_grpc.TrackerStub, cmd: dict) -> dict:
    op = cmd["op"]
    if op == "route":
        return {"nodes": [h.node_id for h in client.route()[1]]}
    if op == "nodes":
        return {"nodes": listed_nodes(tracker)}
    if op == "sessions":
        stub = pb_grpc.NodeStub(open_channel(cmd["address"], None))
        return {"active": stub.Health(pb.Empty(), timeout=5).active_sessions}
    if op == "ledger":
        reply = tracker.GetLedger(pb.Empty(), timeout=5)
        return {"nodes": {n.node_id: [n.prefill_token_layers, n.decode_token_layers, n.steps] for n in reply.nodes},
                "clients": {c.client_id: [c.delivered_tokens, c.sessions] for c in reply.clients}}
    if op == "orphans":
        return {"pending": client.orphans.pending(), "released": client.orphans.released}
    raise ValueError(f"unknown op {op!r}")


def main(tracker_address: str) -> None:
    tok = GGUFTokenizer.from_gguf(str(resolve_model("smollm2")))
    client = MeshClient(tracker_address, client_id="netns-client")
    tracker = pb_grpc.TrackerStub(open_channel(tracker_address, None))
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            threading.Thread(target=generate, args=(client, tok, cmd), daemon=True).start()
            emit({"id": cmd["id"]})
            continue
        try:
            emit({"id": cmd["id"], **answer(client, tracker, cmd)})
        except Exception as e:  # noqa: BLE001 - the test reads what failed
            emit({"id": cmd["id"], "error": f"{type(e).__name__}: {e}"})
    client.close()


if __name__ == "__main__":
    main(sys.argv[1])
