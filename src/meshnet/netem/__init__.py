"""A user-space network link emulator for tests and benchmarks (the kernel's ``netem`` is not needed).

- :mod:`meshnet.netem.link`: the link model, pure: per-link one-way delay, token-bucket bandwidth per
  direction, a switchable blackhole (partition).
- :mod:`meshnet.netem.proxy`: an asyncio TCP proxy that makes connections cross those links (and can
  reset every connection open across one).
- :mod:`meshnet.netem.control`: the proxy as a process driven by JSON lines (``python -m meshnet.netem``).
- :mod:`meshnet.netem.namespaces`: hosts in network namespaces around a hub, so that the proxy
  sees every connection's source host and no host can bypass it.
- :mod:`meshnet.netem.netns_mesh`: a tracker, nodes and a client agent on those hosts, through one
  emulator process (the netns tests, ``meshnet bench wan``).
"""
