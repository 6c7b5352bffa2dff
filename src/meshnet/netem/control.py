"""The emulator as a process, driven over its stdin and stdout in JSON lines.

``python -m meshnet.netem CONFIG.json`` binds every listener of the config, prints
``MESHNET_NETEM_READY [PORT, ...]`` (the port each listener bound, in order: a config may ask for 0) and then answers one JSON line per command line until stdin closes:

- ``{"op": "set", "a": HOST, "b": HOST, "delay_s": 0.025, "rate_bps": 1.25e6, "burst_bytes": null,
  "blackhole": false}``: what the link between the two hosts does from now on (omitted fields take
  :class:`~meshnet.netem.link.LinkSpec`'s defaults) -> ``{"ok": true}``
- ``{"op": "reset", "a": HOST, "b": HOST}``: drop every connection open across the link (both ends get
  a TCP reset) -> ``{"ok": true, "reset": N}``
- ``{"op": "stats"}`` -> ``{"ok": true, "links": {"A-B": {...}}}`` (see ``Emulator.stats``)

A refused command answers ``{"ok": false, "error": "..."}``. The config::

    {"hosts": {"10.77.2.2": "client", ...},          # source IP -> host name
     "listeners": [{"owner": "mid", "listen": ["10.78.0.4", 7701], "target": ["10.77.4.2", 7701]}, ...],
     "default": {"delay_s": 0.0125, "rate_bps": 12.5e6},                # optional: every link's spec
     "links": [{"a": "client", "b": "mid", "delay_s": 0.01}, ...]}      # optional: specs per link

:class:`NetemProcess` starts one (in a namespace, through any argv prefix) and speaks this protocol.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from meshnet.netem.link import LinkSpec
from meshnet.netem.proxy import EmulatorThread, Listener
from meshnet.supervisor import signals_deferred

READY = "MESHNET_NETEM_READY"
_SPEC_FIELDS = ("delay_s", "rate_bps", "burst_bytes", "blackhole")


def _spec(cmd: dict) -> LinkSpec:
    return LinkSpec(**{k: cmd[k] for k in _SPEC_FIELDS if k in cmd})


def serve(config: dict, lines=sys.stdin, out=sys.stdout) -> None:
    """Run the emulator of ``config`` until ``lines`` ends. Raises OSError when a listener cannot bind."""
    emu = EmulatorThread(config.get("hosts", {}), _spec(config.get("default", {})))
    try:
        ports = [emu.listen(Listener(lst["owner"], tuple(lst["listen"]), tuple(lst["target"])))
                 for lst in config.get("listeners", [])]
        for link in config.get("links", []):
            emu.set_link(link["a"], link["b"], _spec(link))
        print(READY, json.dumps(ports), flush=True, file=out)
        for line in lines:
            if not line.strip():
                continue
            try:
                cmd = json.loads(line)
                if cmd.get("op") == "set":
                    emu.set_link(cmd["a"], cmd["b"], _spec(cmd))
                    reply = {"ok": True}
                elif cmd.get("op") == "reset":
                    reply = {"ok": True, "reset": emu.reset(cmd["a"], cmd["b"])}
                elif cmd.get("op") == "stats":
                    reply = {"ok": True, "links": emu.stats()}
                else:
                    reply = {"ok": False, "error": f"unknown op {cmd.get('op')!r}"}
            except (ValueError, KeyError, TypeError) as e:
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), flush=True, file=out)
    finally:
        emu.close()


class NetemProcess:
    """An emulator process for ``config``, started with ``prefix`` before its argv (e.g. ``ip netns
    exec HUB``); ``ports``: the port each listener bound. Raises RuntimeError when it does not come up
    (its stderr in the message)."""

    def __init__(self, config: dict, workdir: Path, prefix: list[str] = ()) -> None:
        path = workdir / "netem.json"
        path.write_text(json.dumps(config))
        self._stderr = open(workdir / "netem.stderr", "w+")
        self.proc: subprocess.Popen | None = None
        try:  # the caller holds no emulator to close until this returns
            with signals_deferred():  # a signal inside Popen left the emulator with nothing to stop it
                self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "meshnet.netem", str(path)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                             text=True)
            line = self.proc.stdout.readline().strip()
        except BaseException:
            self.close()
            raise
        if not line.startswith(READY + " "):
            self.close()
            with open(workdir / "netem.stderr") as f:
                raise RuntimeError(f"link emulator did not start ({line!r}): {f.read()[-2000:]}")
        self.ports: list[int] = json.loads(line[len(READY):])

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if not reply["ok"]:
            raise ValueError(reply["error"])
        return reply

    def set_link(self, a: str, b: str, **spec) -> None:
        """See the "set" command; ``spec``: LinkSpec fields. Raises ValueError when refused."""
        self._ask({"op": "set", "a": a, "b": b, **spec})

    def reset(self, a: str, b: str) -> int:
        """Drop the connections open across the link (see the "reset" command); returns how many."""
        return self._ask({"op": "reset", "a": a, "b": b})["reset"]

    def stats(self) -> dict[str, dict]:
        return self._ask({"op": "stats"})["links"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._stderr.close()
