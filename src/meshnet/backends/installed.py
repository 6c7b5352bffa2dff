"""What ggml-python is installed in this environment: its libraries, their hash, its registry, its build.

The sha256 over ggml's lib dir (:func:`lib_sha256`) is the identity of "these libraries" that a
certification is valid for. :func:`ggml_runtime` is the only place that loads ggml itself, once per
process; everything else finds the libraries without importing it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

from meshnet.backends.lane_table import LANES
from meshnet.backends.toolchain import lane_versions

# Where scripts/build_ggml_lane.sh records how it built the environment's ggml-python.
BUILD_RECORD = Path("share") / "meshnet" / "ggml-lane.json"


def ggml_lib_dir() -> Path | None:
    """ggml-python's ``lib`` directory (where its shared libraries live), found without importing ggml."""
    spec = importlib.util.find_spec("ggml")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def lib_names(base: str) -> tuple[str, ...]:
    """The file names a ggml library ``base`` (e.g. ``ggml-cuda``) has on Linux, macOS and Windows."""
    return (f"lib{base}.so", f"lib{base}.dylib", f"{base}.dll")


def installed_libraries() -> list[str]:
    """File names in ggml's lib dir, sorted; empty when ggml-python is not installed."""
    d = ggml_lib_dir()
    if d is None or not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.is_file())


_lib_hash_cache: dict[tuple, str] = {}


def lib_sha256() -> str | None:
    """sha256 over the names and bytes of every file in ggml's lib dir: the identity of "these
    libraries" that a certification is valid for (a rebuild of any of them invalidates it)."""
    d = ggml_lib_dir()
    if d is None or not d.is_dir():
        return None
    files = sorted(p for p in d.iterdir() if p.is_file())
    key = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _lib_hash_cache:
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        _lib_hash_cache[key] = h.hexdigest()
    return _lib_hash_cache[key]


def ggml_python_version() -> str | None:
    try:
        return importlib.metadata.version("ggml-python")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def ggml_runtime() -> tuple[dict | None, str | None]:
    """Load ggml once: ({"version", "commit", "backends", "devices", "cpu_features"}, None) or
    (None, the error); ``cpu_features`` are the SIMD features the CPU backend was compiled with, named as
    llama.cpp's system_info names them. Loading fails e.g. when a GPU build's driver library is missing."""
    try:
        import ggml

        from meshnet.backends.cpu_features import ggml_cpu_features
        from meshnet.engine import ggml_backend as gb
    except Exception as e:  # noqa: BLE001 - any failure to load the C library is reported, not raised
        return None, f"{type(e).__name__}: {e}"
    return {
        "version": ggml.ggml_version().decode(),
        "commit": ggml.ggml_commit().decode(),
        "backends": gb.registry_backends(),
        "devices": gb.registry_devices(),
        "cpu_features": list(ggml_cpu_features()),
    }, None


def build_record() -> dict | None:
    """The record scripts/build_ggml_lane.sh wrote into this environment, or None.

    Only trusted while ``lib_sha256`` in it matches the libraries installed now; otherwise something
    else reinstalled ggml-python since and the record is returned with ``stale: true``.
    """
    path = Path(sys.prefix) / BUILD_RECORD
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rec["stale"] = rec.get("lib_sha256") != lib_sha256()
    return rec


def build_options(name: str) -> dict:
    """How lane ``name`` is (or would be) built here: the switch, the command that builds it, the
    libraries ggml-python installed, the backends its registry lists, the CPU features compiled in,
    and the build script's record when it built this environment."""
    lane = LANES[name]
    runtime, _ = ggml_runtime()
    rec = build_record()
    opts = {
        "cmake_switch": lane.cmake_switch,
        "build_command": f"scripts/build_ggml_lane.sh {name}",
        "library": lib_names(lane.library)[0 if sys.platform != "darwin" else 1],
        "installed_libraries": installed_libraries(),
        "registry_backends": runtime["backends"] if runtime else None,
        "recorded_build": rec,
    }
    if name == "cpu" and runtime:
        opts["cpu_features"] = runtime["cpu_features"]
    return opts


def has_library(name: str) -> bool:
    """Whether lane ``name``'s backend library is in ggml's lib dir (whether or not it loads)."""
    d = ggml_lib_dir()
    return d is not None and any((d / n).is_file() for n in lib_names(LANES[name].library))



def record_build(name: str, cmake_args: str, command: str) -> int:
    """After a build: check the backend really is in the new libraries, then write the build record.
    Returns 0, or 4 when the lane's backend is missing (a build that silently fell back to CPU)."""
    ggml_runtime.cache_clear()
    runtime, err = ggml_runtime()
    lane = LANES[name]
    if runtime is None:
        print(f"error: the {name} build finished but ggml-python cannot be loaded: {err}", file=sys.stderr)
        return 4
    if not any(n in runtime["backends"] for n in lane.registry_names):
        print(f"error: the {name} build finished but ggml's registry lists only "
              f"{', '.join(runtime['backends'])}, not {lane.registry_names[0]}", file=sys.stderr)
        return 4
    rec = {"lane": name, "cmake_args": cmake_args, "command": command,
           "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "ggml_python": ggml_python_version(), "ggml": runtime["version"], "lib_sha256": lib_sha256(),
           "libraries": installed_libraries(), "registry_backends": runtime["backends"],
           "versions": lane_versions(lane)}
    path = Path(sys.prefix) / BUILD_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"recorded the {name} build in {path}")
    return 0
