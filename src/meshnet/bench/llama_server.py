"""llama.cpp's tools our benchmarks are measured against: ``llama-server`` (``meshnet bench serve``),
``llama-bench``, ``ggml-rpc-server`` (llama.cpp's own layer split over the network, for ``meshnet bench
wan``) and ``llama-gguf-split`` (split GGUF sets).

Found on ``PATH``, else in the cache folder, else built there once from the ``llama-cpp-python==0.3.36``
sdist's ``vendor/llama.cpp`` (the llama.cpp that made the goldens) with CMake: about 10 minutes on two
cores. The binaries are linked statically, so they never load a ggml from ``LD_LIBRARY_PATH`` and never
share a process with ggml-python's.

usage: python -m meshnet.bench.llama_server   (finds or builds; prints the llama-server path)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_VERSION = "0.3.36"
# Every binary the cache holds; a cache missing one (built by an older meshnet) is built again.
TOOLS = ("llama-server", "llama-bench", "ggml-rpc-server", "llama-gguf-split")


def cache_dir() -> Path:
    """``$MESHNET_LLAMA_CPP_CACHE``, else ``$XDG_CACHE_HOME/meshnet/llama.cpp-0.3.36`` (``~/.cache``)."""
    env = os.environ.get("MESHNET_LLAMA_CPP_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "meshnet" / f"llama.cpp-{SDIST_VERSION}"


def find_tool(name: str = "llama-server") -> Path | None:
    """One of :data:`TOOLS` in the cache folder, else on PATH; None when neither has it."""
    cached = cache_dir() / "bin" / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    on_path = shutil.which(name)
    return Path(on_path) if on_path else None


def find_llama_server() -> Path | None:
    """``llama-server`` in the cache folder or on PATH, when the cache also holds every other tool of
    :data:`TOOLS` (else it is built again); None when not."""
    cached_all = all(find_tool(t) is not None and find_tool(t).parent == cache_dir() / "bin" for t in TOOLS)
    if cached_all:
        return cache_dir() / "bin" / "llama-server"
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def build_llama_server(log=sys.stderr) -> Path:
    """Build ``llama-server`` and ``llama-bench`` into the cache folder; returns llama-server's path.

    Raises:
        RuntimeError: cmake or a compiler is missing, or the download or build failed (the message says
            which step).
    """
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool!r} on PATH")
    out = cache_dir()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def step(what: str, cmd: list[str]) -> None:
            print(f"[llama-server] {what}", file=log, flush=True)
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{what} failed (exit {r.returncode}): {r.stdout[-2000:]}")

        step(f"downloading the llama-cpp-python=={SDIST_VERSION} sdist",
             [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
              "--no-binary", ":all:", "-d", str(work), f"llama-cpp-python=={SDIST_VERSION}"])
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = work / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
        build = work / "build"
        step("configuring (cmake)", ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                                     "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
                                     "-DGGML_RPC=ON"])
        step(f"building {', '.join(TOOLS)} (about 10 minutes on 2 cores)",
             ["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(os.cpu_count() or 2)])
        tmp_bin = out / "bin.tmp"
        shutil.rmtree(tmp_bin, ignore_errors=True)
        tmp_bin.mkdir(parents=True)
        for name in TOOLS:
            shutil.copy2(build / "bin" / name, tmp_bin / name)
        (tmp_bin / "SOURCE").write_text(f"vendor/llama.cpp of llama-cpp-python {SDIST_VERSION}\n")
        shutil.rmtree(out / "bin", ignore_errors=True)
        tmp_bin.rename(out / "bin")
    return out / "bin" / "llama-server"


def find_or_build(log=sys.stderr) -> tuple[Path | None, str]:
    """``(path, "")``, or ``(None, why)`` when llama-server is neither here nor buildable."""
    found = find_llama_server()
    if found is not None:
        return found, ""
    try:
        return build_llama_server(log), ""
    except (RuntimeError, OSError, StopIteration) as e:
        return None, f"llama-server is not on PATH nor in {cache_dir()}, and building it failed: {e}"


if __name__ == "__main__":
    path, why = find_or_build()
    if path is None:
        print(why, file=sys.stderr)
        sys.exit(1)
    print(path)
