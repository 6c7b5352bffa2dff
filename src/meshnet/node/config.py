"""What a node is started with: one :class:`NodeConfig`, built from ``meshnet node``'s flags, read by
the node process and (pickled) by its engine worker."""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.contract import LayerRange
from meshnet.wire.security import TlsConfig


@dataclass
class NodeConfig:
    """Everything a node needs to start (see ``meshnet node --help`` for each field)."""

    model: str
    layers: LayerRange | None
    tracker: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None  # address other processes dial; default host:port
    node_id: str | None = None
    engine: str = "ggml"  # "ggml" or "fake" (protocol tests)
    threads: int = 2
    n_ctx: int = 0
    max_sessions: int = 16
    kv_tokens: int = 0
    prefix_cache: int = 4
    repack: bool = True  # mat-mul weights in ggml's repacked CPU layouts where rows keep their bits (cpu_repack)
    huge_pages: bool = True  # weights copied into memory backed by transparent huge pages (huge_pages)
    decode_groups: int = 0  # decode groups taking turns (0 = one per pipeline stage; see LoadSpec)
    idle_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    join_token: str | None = None
    tls: TlsConfig | None = None
    tls_ca: str | None = None
    data_plane: bool = True  # serve steps over raw TCP as well as gRPC
    data_port: int = 0
    stages_hint: int = 0  # with layers None: split into this many stages and take the index below
    stage_index: int = 0
    cpu: int | None = None  # pin the process to this CPU (benchmarks: one core per node)
    backend: str = "cpu"  # ggml engine lane; anything but cpu must be certified on this machine
    device_index: int = 0  # which of the lane's devices (accelerator lanes only)
    identity: str | None = None  # Ed25519 key file; default <config>/meshnet/node-<node_id>.key, or a fresh key
    relay: bool = False  # accept no connections: serve through a Relay stream to the tracker (needs tracker)
    fault: str = ""  # fake engine only: faults to inject (meshnet.engine.fake.parse_fault_spec)
    in_process_engine: bool = False  # run the engine in the node process, unsupervised (no worker)
    worker_restarts: int = 5  # quick worker deaths in a row restarted before the node gives up
    worker_hang_timeout_s: float = 5.0  # a worker silent to pings this long is killed and restarted
