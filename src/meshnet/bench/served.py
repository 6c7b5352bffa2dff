"""Server processes a benchmark measures over HTTP: :class:`Server` starts one on a free port (or attaches
to one already running) and waits until its OpenAI API answers; :class:`KvSampler` reads an in-process
meshnet API's KV pool figures from ``/metrics`` while a load runs; :func:`tree_cpu_seconds` counts the CPU
time a server and the processes it started (a mesh's nodes and their engine workers) have used."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from meshnet.secret_args import API_KEY_ENV
from meshnet.openmp import competitor_env
from meshnet.supervisor import signals_deferred


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> tuple[float, int] | None:
    """CPU seconds (user + system) that process ``pid`` and every live process below it have used so far,
    and how many processes that is; None where ``/proc`` cannot be read (not Linux) or ``pid`` is gone.

    Unlike throughput, CPU time per token hardly moves when the host takes cycles from a virtual machine,
    and it adds up what each process of a mesh costs (a benchmark reads it before and after a load)."""
    clk = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for e in entries:
        try:
            # fields after the command name's closing parenthesis: state ppid ... utime(11) stime(12)
            fields = Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(e))
        cpu[int(e)] = (int(fields[11]) + int(fields[12])) / clk
    if pid not in cpu:
        return None
    total, n, todo = 0.0, 0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        n += 1
        todo.extend(children.get(p, ()))
    return total, n


class Server:
    """One server process, started on a free port, ready once ``/v1/models`` answers 200."""

    def __init__(self, name: str, argv_for_port, log_dir: Path, competitor: bool = False) -> None:
        self.name, self.port = name, free_port()
        self.competitor = competitor  # llama.cpp: runs with its own OpenMP defaults, not meshnet's
        self._argv_for_port = argv_for_port
        self.argv = argv_for_port(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers: dict[str, str] = {}  # sent with every request (an attached server's API key)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @classmethod
    def attach(cls, name: str, url: str, api_key: str | None = None) -> "Server":
        """A server someone else runs at ``url``: ``start`` only asks it for its model id, the first time;
        ``api_key`` goes with every request as ``Authorization: Bearer``."""
        srv = cls.__new__(cls)
        srv.name, srv.url, srv.argv, srv.proc, srv.port = name, url.rstrip("/"), None, None, 0
        srv.competitor, srv._model_id = False, None
        srv.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return srv

    def start(self, timeout_s: float = 600.0) -> str:
        """Start and wait until ready; returns the model id it lists. Raises RuntimeError on failure."""
        import httpx

        if self.argv is None:
            # Asked once: the benchmark checks the URL before it writes anything, then "starts" it for
            # every load, and each of those asked again.
            if self._model_id is None:
                try:
                    answer = httpx.get(self.url + "/v1/models", headers=self.headers, timeout=30)
                    if answer.status_code == 401:
                        raise RuntimeError(f"{self.url} asks for an API key: pass the one it was started with "
                                           f"(--api-key, or ${API_KEY_ENV})")
                    self._model_id = answer.json()["data"][0]["id"]
                except (httpx.HTTPError, ValueError, LookupError, TypeError) as e:  # nothing there, or no OpenAI API
                    raise RuntimeError(f"{self.url} answered no OpenAI model list at /v1/models "
                                       f"({type(e).__name__}: {e})") from None
            return self._model_id
        if self.proc is not None:  # started before: fresh ports, so nothing of the last run can answer
            self.port = free_port()
            self.argv, self.url = self._argv_for_port(self.port), f"http://127.0.0.1:{self.port}"
        env = competitor_env() if self.competitor else dict(os.environ)
        # A key in the bench's environment would make the servers it starts ask its own requests for it.
        env = {k: v for k, v in env.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", API_KEY_ENV)}
        log = open(self.log_path, "a")  # each start appends: a server is started once per C
        try:
            with signals_deferred():  # a signal inside Popen left the server with nothing to stop it
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    r = httpx.get(self.url + "/v1/models", timeout=5)
                    if r.status_code == 200:
                        return r.json()["data"][0]["id"]
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            raise RuntimeError(f"{self.name} was not ready in {timeout_s:.0f}s; see {self.log_path}")
        except BaseException:
            # Its own session: no signal to the benchmark's process group reaches it, and the caller
            # gets no server to stop (a Ctrl-C or SIGTERM while it loaded left `meshnet up` running).
            self.stop()
            raise

    def rss_bytes(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the server process in bytes; (0, 0) where /proc is not readable."""
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
        except (OSError, AttributeError):
            return 0, 0
        vals = {k: int(v.split()[0]) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.*)$", text, re.M)}
        return vals.get("VmRSS", 0), vals.get("VmHWM", 0)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the server's processes have used so far (:func:`tree_cpu_seconds`); None for an
        attached server or where ``/proc`` is not readable."""
        found = tree_cpu_seconds(self.proc.pid) if self.proc is not None else None
        return None if found is None else found[0]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class KvSampler:
    """Polls an in-process meshnet API's ``/metrics`` during a load: the KV pool's resident bytes and the
    tokens its sessions hold, summed over stages; keeps the sample holding the most tokens."""

    def __init__(self, url: str, period_s: float = 0.2) -> None:
        self.url, self.period_s = url, period_s
        self.best = (0, 0)  # (held tokens, resident bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "KvSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        while not self._stop.wait(self.period_s):
            try:
                text = httpx.get(self.url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            held = sum(float(v) for v in re.findall(r"^meshnet_stage_kv_tokens_held\{[^}]*\} (\S+)$", text, re.M))
            kv = sum(float(v) for v in re.findall(r"^meshnet_stage_kv_bytes\{[^}]*\} (\S+)$", text, re.M))
            if held > self.best[0]:
                self.best = (int(held), int(kv))
