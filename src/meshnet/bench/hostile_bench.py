"""``meshnet bench hostile``: what 1000 hostile connections to a node cost a generation running beside them.

A tracker in this process and one ``meshnet node`` process serving every layer (``--threads`` threads).
Each round measures greedy decode tokens/s of one session through
:class:`~meshnet.client.mesh_client.MeshClient` twice, alone and under attack, in alternating order. The
attack opens ``--connections`` connections to the node's data-plane port, a third each sending garbage,
announcing a frame of 8 MiB (and sending 64 KiB of it) or staying silent, and keeps them open during the
measured generation, opening a new one for each the node closes. Reported: medians, the under-attack /
alone ratio, and the node process's resident memory (``VmRSS``, MB) before and during the attack. Speed
is only measured and written here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
from contextlib import ExitStack
from pathlib import Path


from meshnet.arg_types import positive_int, results_file, thread_count
from meshnet.bench.engine_bench import bench_prompt_ids
from meshnet.bench.node_procs import NodeSpec, decode_concurrently, start_mesh
from meshnet.client.mesh_client import MeshClient
from meshnet.contract import LayerRange
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane import AUTH, HEADER
from meshnet.wire.security import open_channel

# The bound: a generation beside the attack keeps at least 0.8x its speed alone.
GOAL_UNDER_ATTACK_VS_ALONE = 0.8


def add_hostile_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("hostile", help="decode tokens/s of a generation alone and beside 1000 "
                                                    "hostile connections to its node; the node's memory")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--connections", type=positive_int, default=1000)
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--out", type=results_file, default="bench-results/hostile.json")
    p.set_defaults(func=run_hostile_bench)


def hostile_connection(address: str, i: int) -> socket.socket | None:
    """Connection ``i`` to ``address`` (``host:port``): garbage, a huge announced frame with a little of
    it, or silence; None when the node refused or reset it."""
    host, port = address.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=5)
        if i % 3 == 0:
            s.sendall(os.urandom(64))
        elif i % 3 == 1:
            s.sendall(HEADER.pack(8 << 20, AUTH) + b"\0" * 65536)
        return s
    except OSError:  # refused or reset by the node: that is its right
        return None


class Attack:
    """Keeps ``n`` hostile connections open to ``address`` (``host:port``) from a background thread."""

    def __init__(self, address: str, n: int) -> None:
        self.address, self.n = address, n
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hostile")
        self._socks: list[socket.socket | None] = []

    def __enter__(self) -> "Attack":
        self._socks = [self._open(i) for i in range(self.n)]
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self._socks:
            if s is not None:
                s.close()

    def _open(self, i: int) -> socket.socket | None:
        s = hostile_connection(self.address, i)
        self.opened += s is not None
        return s

    def _run(self) -> None:
        # Replace the connections the node closed (idle timeouts, the cap evicting unauthenticated ones).
        while not self._stop.wait(0.2):
            for i, s in enumerate(self._socks):
                if self._stop.is_set():
                    return
                if s is None or _closed(s):
                    if s is not None:
                        s.close()
                    self._socks[i] = self._open(i)


def _closed(s: socket.socket) -> bool:
    try:
        s.setblocking(False)
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _data_address(tracker: str) -> str:
    with open_channel(tracker, None, None) as ch:
        route = pb_grpc.TrackerStub(ch).GetRoute(pb.RouteRequest(), timeout=10)
    if not route.hops or not route.hops[0].data_address:
        raise RuntimeError("the node advertises no data-plane address")
    return route.hops[0].data_address


def run_hostile_bench(args: argparse.Namespace) -> int:
    """Run the rounds, write ``args.out`` (JSON) and print a table. Returns 0."""
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.hparams import ModelConfig

    model = str(resolve_model(args.model))
    n_layer = ModelConfig.from_reader(open_gguf(model)).n_layer
    prompt_ids = bench_prompt_ids(model, args.prompt_tokens)
    runs: dict[str, list[float]] = {"alone": [], "under_attack": []}
    memory: list[dict] = []
    with ExitStack() as stack:
        tracker, nodes = start_mesh(stack, model, 512, [NodeSpec("bench-target", LayerRange(0, n_layer), args.threads)])
        node_pid = nodes[0].proc.pid
        address = _data_address(tracker)
        client = MeshClient(tracker, report_deliveries=False)
        stack.callback(client.close)
        decode_concurrently([client], prompt_ids, 4)  # warm-up
        for r in range(args.rounds):
            for mode in (("alone", "under_attack") if r % 2 == 0 else ("under_attack", "alone")):
                if mode == "alone":
                    rate = decode_concurrently([client], prompt_ids, args.decode_tokens)[0]
                else:
                    before = _rss_mb(node_pid)
                    with Attack(address, args.connections) as attack:
                        rate = decode_concurrently([client], prompt_ids, args.decode_tokens)[0]
                        memory.append({"rss_mb_before": round(before, 1), "rss_mb_during": round(_rss_mb(node_pid), 1),
                                       "connections_opened": attack.opened})
                runs[mode].append(round(rate, 2))
                print(f"[bench hostile] round {r + 1}: {mode}: {rate:.1f} tok/s", file=sys.stderr)
    medians = {m: round(statistics.median(v), 2) for m, v in runs.items()}
    ratio = round(medians["under_attack"] / medians["alone"], 3)
    growth = max(m["rss_mb_during"] - m["rss_mb_before"] for m in memory)
    result = {
        "benchmark": "hostile", "model": args.model, "threads": args.threads, "connections": args.connections,
        "decode_tokens": args.decode_tokens, "rounds": args.rounds, "runs": runs, "medians_tokens_per_s": medians,
        "under_attack_vs_alone": ratio, "goal_under_attack_vs_alone": GOAL_UNDER_ATTACK_VS_ALONE,
        "node_memory": memory, "max_rss_growth_mb": round(growth, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "notes": ["decode tokens/s of one greedy session on a node serving every layer, alone and while "
                  "--connections hostile connections (garbage, an 8 MiB frame announced, silence) stay open to "
                  "its data-plane port; node RSS of the node process (its engine worker is another process)."],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'alone tok/s':>12} {'under attack tok/s':>19} {'ratio':>6} {'node RSS growth MB':>19}")
    print(f"{medians['alone']:>12} {medians['under_attack']:>19} {ratio:>6} {growth:>19.1f}")
    print(f"[bench hostile] wrote {out}", file=sys.stderr)
    return 0
