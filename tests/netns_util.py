"""The netns tests' mesh: :class:`meshnet.netem.netns_mesh.NetMesh` with tests/netns_agent.py as the
client host's agent."""

from __future__ import annotations

import sys
from pathlib import Path

from meshnet.netem import netns_mesh

_AGENT = str(Path(__file__).with_name("netns_agent.py"))


class NetMesh(netns_mesh.NetMesh):
    def __init__(self, hosts: list[str], workdir: Path, heartbeat_s: float = 0.3, link: dict | None = None) -> None:
        super().__init__(hosts, workdir, [sys.executable, _AGENT], heartbeat_s, link)
