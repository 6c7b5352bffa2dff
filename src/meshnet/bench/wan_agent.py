"""``python -m meshnet.bench.wan_agent TRACKER``: the client of ``meshnet bench wan``, run in the client
host's network namespace and driven over stdin/stdout in JSON lines (the protocol of
:class:`meshnet.netem.netns_mesh.Agent`: each command carries an ``id`` and gets one reply).

- ``{"op": "nodes"}`` -> ``{"nodes": {node id: active sessions}}`` as the tracker lists them
- ``{"op": "measure", "mode": M, "prompt_ids": [...], "n": N, "repeats": R[, "link": L]}`` -> ``{"runs": [{"ttft_s",
  "decode_tokens_per_s", "ids", "failovers"[, "tokens_per_round", "drafted", "accepted"]}, ...]}``: R greedy generations of N tokens through a
  MeshClient configured for mode M (one client per mode, kept across commands so that its connections
  stay open), without stopping at end-of-generation. Drafting generations of one mode over links
  ``L`` (the bench's RTT) share their step costs (:class:`DraftCosts`), as a server's do.
"""

from __future__ import annotations

import json
import sys

from meshnet.bench.wan_model import NGRAM, client_options
from meshnet.client.mesh_client import MeshClient
from meshnet.contract import GREEDY
from meshnet.generation import Generation
from meshnet.model.bundled import resolve_model
from meshnet.netem.netns_mesh import listed_nodes
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.speculative import DraftCosts, Speculation
from meshnet.tokenizer import GGUFTokenizer
from meshnet.wire.security import open_channel


class WanAgent:
    def __init__(self, tracker: str) -> None:
        self.tracker_address = tracker
        self.tracker = pb_grpc.TrackerStub(open_channel(tracker, None))
        self.tok = GGUFTokenizer.from_gguf(str(resolve_model("smollm2")))
        self.clients: dict[str, MeshClient] = {}
        self.costs: dict[tuple[str, object], DraftCosts] = {}  # (mode, links): what the drafting learnt

    def client(self, mode: str) -> MeshClient:
        if mode not in self.clients:
            opts = client_options(mode)
            self.clients[mode] = MeshClient(self.tracker_address, client_id=f"wan-{mode}",
                                            report_deliveries=False, **opts)
        return self.clients[mode]

    def measure(self, mode: str, prompt_ids: list[int], n: int, repeats: int, link: object = None) -> list[dict]:
        """``repeats`` greedy generations through :class:`Generation`, the loop the CLI and the API run;
        in the n-gram mode with drafts (:class:`Speculation`), each run then also says how many tokens
        a decode round gave on average (``tokens_per_round``: the latency model divides the legs by it).
        ``link``: which links the mesh has now (the step costs learnt are theirs)."""
        client, runs = self.client(mode), []
        speculation = Speculation() if mode == NGRAM else None
        costs = self.costs.setdefault((mode, link), DraftCosts())
        for _ in range(repeats):
            failovers = client.failovers
            gen = Generation(client, self.tok, prompt_ids, n, GREEDY, stop_at_eog=False, speculation=speculation,
                             draft_costs=costs)
            for _ in gen:
                pass
            r = gen.result
            run = {"ttft_s": r.ttft_s, "decode_tokens_per_s": r.decode_tokens_per_s,
                   "ids": r.generated_token_ids, "failovers": client.failovers - failovers}
            if speculation is not None:
                # Every decode round gives one token plus the drafts it accepted.
                decoded = len(r.generated_token_ids) - 1
                run.update(tokens_per_round=decoded / max(1, decoded - r.accepted), drafted=r.drafted,
                           accepted=r.accepted)
            runs.append(run)
        return runs

    def answer(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "nodes":
            return {"nodes": listed_nodes(self.tracker)}
        if op == "measure":
            return {"runs": self.measure(cmd["mode"], cmd["prompt_ids"], cmd["n"], cmd.get("repeats", 1),
                                         cmd.get("link"))}
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def main(tracker: str) -> None:
    agent = WanAgent(tracker)
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = agent.answer(cmd)
        except Exception as e:  # noqa: BLE001 - the bench reports what failed
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"id": cmd["id"], **reply}), flush=True)
    agent.close()


if __name__ == "__main__":
    main(sys.argv[1])
