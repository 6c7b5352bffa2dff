"""The servers ``meshnet bench serve`` measures, and how each starts (see :mod:`meshnet.bench.serve_bench`):
meshnet in process and as a 3-node loopback mesh (:func:`meshnet_targets`), llama.cpp's ``llama-server``
(:func:`start_llama_server`) and llama.cpp's own split over ``ggml-rpc-server`` s (:func:`llama_rpc_server`).
Each is a :class:`meshnet.bench.served.Server`: started on a free port, ready once its OpenAI API answers."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from meshnet.bench.served import Server, free_port

# Context tokens per slot of llama-server (``-c`` = this x ``-np``), and meshnet's n_ctx beside it.
LLAMA_SLOT_CTX = 1024


def meshnet_targets(args, log_dir: Path, max_c: int) -> dict:
    """The meshnet servers to measure (not started): in process and a 3-node loopback mesh, each holding
    ``max_c`` sessions (the sequences the largest load generates at once)."""
    py = [sys.executable, "-m", "meshnet.cli"]
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    out = {}
    if "meshnet" in wanted:
        out["meshnet"] = Server("meshnet", lambda port: py + [
            "api", "--model", args.model, "--threads", str(args.threads), "--n-ctx", str(LLAMA_SLOT_CTX),
            "--max-sessions", str(max(max_c, 1)), "--port", str(port)], log_dir)
    if "mesh" in wanted:
        out["mesh"] = Server("mesh", lambda port: py + [
            "up", "--model", args.model, "--stages", "3", "--threads", "1", "--port", str(free_port()),
            "--n-ctx", str(LLAMA_SLOT_CTX), "--max-sessions", str(max(max_c, 1)), "--api-port", str(port)],
            log_dir)
    return out


def llama_server_process(binary: Path, model_path: str, threads: int, n_parallel: int, log_dir: Path,
                         repack: bool = True) -> Server:
    """``llama-server`` (not started): ``threads`` threads, ``-fa on``, ``n_parallel`` slots of
    :data:`LLAMA_SLOT_CTX` tokens, with its weight repacking unless ``repack`` is False."""
    return Server(f"llama-server-np{n_parallel}", lambda port: [
        str(binary), "-m", model_path, "-t", str(threads), "-tb", str(threads), "-fa", "on",
        "-np", str(n_parallel), "-c", str(LLAMA_SLOT_CTX * n_parallel), "--host", "127.0.0.1",
        "--port", str(port)] + ([] if repack else ["--no-repack"]), log_dir, competitor=True)


def llama_rpc_server(binaries: tuple[Path, Path], model_path: str, n_parallel: int, log_dir: Path) -> Server:
    """llama.cpp's split of the mesh's 3 ranges (:func:`meshnet.bench.llama_rpc.rpc_split_server_argv`),
    each RPC server on a port free when the server starts."""
    from meshnet.bench.llama_rpc import rpc_split_server_argv
    from meshnet.bench.wan_model import tensor_split
    from meshnet.local_mesh import plan_ranges

    ranges = plan_ranges(model_path, 3)
    split = tensor_split([(r.start, r.end) for r in ranges], ranges[-1].end)
    return Server(f"llama-rpc-np{n_parallel}", lambda port: rpc_split_server_argv(
        *binaries, model_path, split, [free_port() for _ in ranges], port, n_parallel, LLAMA_SLOT_CTX),
        log_dir, competitor=True)


def start_llama_server(binary: Path, model_path: str, threads: int, n_parallel: int, log_dir: Path,
                       report: dict, repack: bool = True) -> tuple[Server, str, bool]:
    """Start llama-server (with its default weight repacking unless ``repack`` is False); if it dies of
    SIGILL or SIGSEGV (on some virtual machines the AMX kernels its repacking picks fault on their first
    tile instruction, or at start-up), once more with ``--no-repack``, which the report then records under
    ``llama_server_flags``. Returns the server, its model id and whether it repacks."""
    print(f"[bench serve] starting llama-server -np {n_parallel}", file=sys.stderr, flush=True)
    if not repack:
        report.setdefault("llama_server_flags", {}).setdefault(
            str(n_parallel), "--no-repack: its default repacking died earlier in this run")
    srv = llama_server_process(binary, model_path, threads, n_parallel, log_dir, repack)
    try:
        return srv, srv.start(), repack
    except RuntimeError:
        if not repack or srv.proc is None or srv.proc.returncode not in (-signal.SIGILL, -signal.SIGSEGV):
            raise
    report.setdefault("llama_server_flags", {})[str(n_parallel)] = (
        f"--no-repack: with its default repacking llama-server died of "
        f"{signal.Signals(-srv.proc.returncode).name} here")
    srv = llama_server_process(binary, model_path, threads, n_parallel, log_dir, repack=False)
    return srv, srv.start(), False
