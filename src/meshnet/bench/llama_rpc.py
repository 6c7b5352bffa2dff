"""llama.cpp's own network split: for ``meshnet bench wan``, one ``ggml-rpc-server`` in each stage host's
namespace and ``llama-bench --rpc`` in the client's, every connection through the same emulated links
as the mesh; for ``meshnet bench serve``, ``llama-server --rpc`` over one ``ggml-rpc-server`` per stage on
loopback (:func:`rpc_split_server_argv`), the competitor of a 3-node mesh.

The RPC devices are named ``RPC0..`` in ``--rpc`` order and, with ``-ngl 99`` (llama-bench's default),
hold every repeating layer and the output layer; the token embedding stays on the client's CPU (llama.cpp
never offloads the input layer: a row lookup). ``-ts`` (:func:`meshnet.bench.wan_model.tensor_split`)
gives each server the layer range the matching meshnet stage serves. The binaries are static and run
only as subprocesses (see :mod:`meshnet.bench.llama_server`), with llama.cpp's own OpenMP defaults.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from meshnet.bench.llama_server import cache_dir, find_tool
from meshnet.netem.netns_mesh import NetMesh
from meshnet.openmp import competitor_env

RPC_PORT = 50052


def rpc_tools() -> tuple[Path, Path] | str:
    """``(ggml-rpc-server, llama-bench)``, or why they are missing (the mode is then skipped)."""
    server, bench = find_tool("ggml-rpc-server"), find_tool("llama-bench")
    if server is None or bench is None:
        return (f"ggml-rpc-server and llama-bench are neither on PATH nor in {cache_dir() / 'bin'}: build them "
                "with `python -m meshnet.bench.llama_server`")
    return server, bench


def _env() -> dict[str, str]:
    return {k: v for k, v in competitor_env().items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}


def start_rpc_servers(mesh: NetMesh, server: Path, hosts: list[str], threads: int, timeout_s: float = 30.0) -> list[str]:
    """Start ``ggml-rpc-server`` (``threads`` threads) on :data:`RPC_PORT` of each host's private address;
    returns the endpoints the client dials (``PUBLIC_IP:PORT``, in ``hosts`` order) once each listens.

    Raises RuntimeError when one exits or does not listen within ``timeout_s``."""
    procs = []
    for h in hosts:
        ip = mesh.topo.hosts[h].private_ip
        procs.append((h, *mesh.spawn(h, [str(server), "-H", ip, "-p", str(RPC_PORT), "-t", str(threads)],
                                     env=_env(), log=f"{h}-rpc")))
    deadline = time.monotonic() + timeout_s
    for h, proc, log in procs:
        while not _listening(mesh, h, RPC_PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ggml-rpc-server on {h} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
    return [f"{mesh.topo.hosts[h].public_ip}:{RPC_PORT}" for h in hosts]


def _listening(mesh: NetMesh, host: str, port: int) -> bool:
    r = subprocess.run(mesh.topo.argv(host, ["ss", "-ltnH", f"sport = :{port}"]), capture_output=True, text=True)
    return bool(r.stdout.strip())


def llama_bench_argvs(bench: Path, model: str, endpoints: list[str], split: str, prompt_lens: list[int],
                      n_gen: int, depth: int, repeats: int, threads: int) -> list[list[str]]:
    """Two llama-bench runs through the RPC servers at ``endpoints``: a prompt test for each of
    ``prompt_lens`` (tokens, at depth 0: the TTFT), then one generation test of ``n_gen`` tokens after
    ``depth`` cached tokens (a depth applies to every test of a run, hence two runs); ``repeats`` runs
    of each test after a warm-up, JSON on stdout. ``-fa on``: meshnet's kernels use flash attention
    too; ``-ngl 99``: every layer on the RPC devices."""
    common = [str(bench), "-m", model, "--rpc", ",".join(endpoints), "-ts", split, "-ngl", "99",
              "-t", str(threads), "-fa", "on", "-r", str(repeats), "-o", "json"]
    return [[*common, "-p", ",".join(str(n) for n in prompt_lens), "-n", "0"],
            [*common, "-p", "0", "-n", str(n_gen), "-d", str(depth)]]


def run_llama_bench(mesh: NetMesh, argvs: list[list[str]], timeout_s: float) -> list[dict]:
    """Run each llama-bench argv in the client's namespace, one after the other; returns their tests
    (llama-bench's JSON objects: ``n_prompt``, ``n_gen``, ``n_depth``, ``avg_ns``, ``avg_ts``,
    ``samples_ts``...).

    Raises RuntimeError when one fails or outlives ``timeout_s`` (its log's tail in the message)."""
    tests: list[dict] = []
    for part in argvs:
        proc, log = mesh.spawn("client", part, stdout=subprocess.PIPE, env=_env(), log="llama-bench")
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"llama-bench ran over {timeout_s:.0f} s: {log.read_text()[-1500:]}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench exited with {proc.returncode}: {log.read_text()[-1500:]}")
        tests += json.loads(out)
    return tests


def summarize(tests: list[dict], prompt_lens: list[int], n_gen: int) -> dict:
    """``{"ttft_s": {prompt_len: seconds}, "decode_tokens_per_s": ..., "decode_runs": [...]}`` from
    llama-bench's tests (a prompt test's time is its TTFT: one ``llama_decode`` of the prompt, the
    first token's logits included). Several generation tests (one a round, see ``meshnet bench wan``)
    give the median of their tokens/s, and their runs in order. Raises ValueError when a test is missing."""
    ttft = {}
    for n in prompt_lens:
        t = next((t for t in tests if t["n_prompt"] == n and t["n_gen"] == 0), None)
        if t is None:
            raise ValueError(f"llama-bench reported no {n}-token prompt test")
        ttft[n] = t["avg_ns"] / 1e9
    gens = [t for t in tests if t["n_gen"] == n_gen and t["n_prompt"] == 0]
    if not gens:
        raise ValueError(f"llama-bench reported no {n_gen}-token generation test")
    return {"ttft_s": ttft, "decode_tokens_per_s": statistics.median(t["avg_ts"] for t in gens),
            "decode_runs": [x for t in gens for x in t.get("samples_ts", [])], "depth": gens[0].get("n_depth", 0)}


def rpc_split_server_argv(server: Path, rpc_server: Path, model: str, split: str, rpc_ports: list[int],
                          port: int, n_parallel: int, slot_ctx: int, threads: int = 1,
                          wait_s: float = 30.0) -> list[str]:
    """The argv of llama.cpp's split served over HTTP on 127.0.0.1:``port``: a bash script that starts one
    ``ggml-rpc-server`` (``threads`` threads) on each of ``rpc_ports`` of 127.0.0.1, waits until each
    accepts connections (at most ``wait_s`` seconds, else stops them and exits 1), then becomes
    ``llama-server --rpc`` over them: ``-ts split`` gives each server its layer range
    (:func:`meshnet.bench.wan_model.tensor_split` of the mesh's ranges), ``-ngl 99`` puts every repeating
    layer and the output layer on the RPC devices (the token embedding stays with llama-server), ``-np
    n_parallel`` slots of ``slot_ctx`` tokens, ``-fa on`` and ``threads`` threads, as ``meshnet up
    --stages 3 --threads 1`` is measured. Run in a session of its own, the servers are stopped with the
    process group."""
    q = shlex.quote
    rpcs = " ".join(f"{q(str(rpc_server))} -H 127.0.0.1 -p {p} -t {threads} &" for p in rpc_ports)
    ports = " ".join(str(p) for p in rpc_ports)
    llama = [str(server), "-m", model, "--rpc", ",".join(f"127.0.0.1:{p}" for p in rpc_ports), "-ts", split,
             "-ngl", "99", "-t", str(threads), "-tb", str(threads), "-fa", "on", "-np", str(n_parallel),
             "-c", str(slot_ctx * n_parallel), "--host", "127.0.0.1", "--port", str(port)]
    tries = max(1, int(wait_s * 10))
    script = (f"{rpcs}\n"
              f"for p in {ports}; do n=0\n"
              # bash's /dev/tcp connects; a server that accepts is ready (it serves one client at a time,
              # and this probe closes at once)
              f"  until (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; do\n"
              f"    n=$((n + 1)); if [ $n -ge {tries} ]; then echo \"ggml-rpc-server on port $p did not "
              f"listen within {wait_s:g} s\" >&2; kill $(jobs -p) 2>/dev/null; exit 1; fi; sleep 0.1\n"
              f"  done\ndone\n"
              f"exec {' '.join(q(a) for a in llama)}\n")
    return ["bash", "-c", script]
