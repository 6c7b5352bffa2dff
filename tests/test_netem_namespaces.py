"""Hosts in network namespaces: the address plan, why it cannot work where it cannot, stale cleanup."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from mesh_util import wait_for
from meshnet.netem import namespaces
from meshnet.netem.namespaces import NetnsUnavailable, Topology


def test_address_plan_gives_each_host_a_private_and_a_public_address():
    topo = Topology(["tracker", "client", "mid"])
    mid = topo.hosts["mid"]
    assert (mid.private_ip, mid.public_ip) == ("10.77.3.2", "10.78.0.3")
    assert mid.ns == topo.prefix + "mid" and topo.prefix.startswith(f"mnet-{os.getpid()}-")
    assert topo.address_map() == {"10.77.1.2": "tracker", "10.77.2.2": "client", "10.77.3.2": "mid"}
    assert topo.argv("mid", ["true"]) == ["ip", "netns", "exec", topo.prefix + "mid", "true"]
    assert topo.argv(None, ["true"])[3] == topo.prefix + "hub"
    assert Topology(["a"]).prefix != Topology(["a"]).prefix  # two topologies of one process never collide


def test_probe_says_why_without_root_or_without_ip(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="need root.*uid 1000"):
        namespaces.probe()
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(NetnsUnavailable, match="`ip` command .* not installed"):
        namespaces._ip("netns", "list")


def test_namespaces_of_a_dead_process_are_removed_with_what_runs_in_them():
    try:
        namespaces.probe()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"mnet-{gone.pid}-0-x"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    left = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])  # what a killed run left behind
    mine = Topology(["live"])
    mine.create()
    try:
        assert wait_for(lambda: subprocess.run(["ip", "netns", "pids", stale], capture_output=True,
                                               text=True).stdout.strip(), 10) is not None
        assert stale in namespaces.remove_stale()
        assert left.wait(timeout=5) == -signal.SIGKILL
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listed and mine.hosts["live"].ns in listed  # a live process's stay
    finally:
        if left.poll() is None:
            left.kill()
        mine.destroy()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert mine.hub not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
