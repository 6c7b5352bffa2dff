"""The build lanes of the ggml engine and what this machine can do with each.

Each lane is ggml-python built with at most one backend switch on top of the default (CPU) build:

======  ======================  ==========================  ===========================  ========
lane    CMake switch            tools needed to build        device check                 platform
======  ======================  ==========================  ===========================  ========
cpu     (none)                  a C++ compiler               --                           any
cuda    ``-DGGML_CUDA=on``      ``nvcc``, cuBLAS headers     ``nvidia-smi -L``            any
rocm    ``-DGGML_HIP=on``       ``hipcc``, ``hipconfig``     ``rocminfo``                 any
vulkan  ``-DGGML_VULKAN=on``    ``glslc``, Vulkan headers,   ``vulkaninfo --summary``     any
                                the Vulkan loader
metal   ``-DGGML_METAL=on``     ``xcrun``                    --                           darwin
======  ======================  ==========================  ===========================  ========

:func:`probe_lane` reports one lane in exactly one state:

* ``certified``: the installed ggml-python has the backend and its self-test
  (:mod:`meshnet.backends.certify`) passed on this machine for these very libraries.
* ``built``: the installed ggml-python has the backend, but it has not passed a self-test here (the
  reason says what is missing). Such a backend stays dark: nodes do not advertise it.
* ``available``: the tools to build the lane and a device to run it are here, but the installed
  ggml-python was not built with it (``scripts/build_ggml_lane.sh LANE``).
* ``skipped``: the lane cannot be built or run here; the reason is exact, e.g. ``nvcc is not on PATH``
  or ``platform linux is not darwin``.

A lane that is not built lists every obstacle in ``problems`` (toolchain first, then device); its
``reason`` is the first. Building cuda also needs the GPU (:func:`build_problem`).

Nothing here imports ggml at module import time, so the build script can check a toolchain with a bare
``python3`` (``python -m meshnet.backends.lanes toolchain LANE``).
"""

from __future__ import annotations

import ctypes.util
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshnet.backends import LANE_NAMES
from meshnet.backends.errors import BackendUnavailable

STATES = ("available", "built", "certified", "skipped")
CERT_FILE = "certifications.json"
# Where scripts/build_ggml_lane.sh records how it built the environment's ggml-python.
BUILD_RECORD = Path("share") / "meshnet" / "ggml-lane.json"
_TOOL_TIMEOUT_S = 15
# ggml-vulkan's own device filter (like CUDA_VISIBLE_DEVICES): indices into vkEnumeratePhysicalDevices.
VK_VISIBLE_DEVICES_ENV = "GGML_VK_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Lane:
    """One row of the lane table.

    Attributes:
        name: cpu, cuda, rocm, vulkan or metal.
        cmake_switch: the one CMake option the lane adds to the default build; None for cpu.
        library: base name of the shared library the backend adds to ggml's lib dir (``ggml-cuda``
            is ``libggml-cuda.so`` / ``.dylib`` / ``ggml-cuda.dll``).
        registry_names: names ggml's backend registry gives the backend (GGML_CUDA_NAME, ...).
        build_tools: programs that must be on PATH to build the lane, checked in this order.
        device_tool: the program whose output shows a device exists; None when none is needed.
        platform: the ``sys.platform`` the lane needs; None for any.
    """

    name: str
    cmake_switch: str | None
    library: str
    registry_names: tuple[str, ...]
    build_tools: tuple[str, ...] = ()
    device_tool: str | None = None
    platform: str | None = None


LANES: dict[str, Lane] = {
    "cpu": Lane("cpu", None, "ggml-cpu", ("CPU",)),
    "cuda": Lane("cuda", "-DGGML_CUDA=on", "ggml-cuda", ("CUDA",), ("nvcc",), "nvidia-smi"),
    # A HIP build registers under GGML_CUDA_NAME, which ggml-cuda.h defines as "ROCm" with GGML_USE_HIP.
    "rocm": Lane("rocm", "-DGGML_HIP=on", "ggml-hip", ("ROCm",), ("hipcc", "hipconfig"), "rocminfo"),
    "vulkan": Lane("vulkan", "-DGGML_VULKAN=on", "ggml-vulkan", ("Vulkan",), ("glslc",), "vulkaninfo"),
    # ggml-metal registers as GGML_METAL_NAME ("MTL"); some builds spell it "Metal".
    "metal": Lane("metal", "-DGGML_METAL=on", "ggml-metal", ("MTL", "Metal"), ("xcrun",), None, "darwin"),
}
assert tuple(LANES) == LANE_NAMES


@dataclass(frozen=True)
class LaneReport:
    """What :func:`probe_lane` found for one lane (see the module docstring for the states).

    Attributes:
        lane: the lane's name.
        state: one of :data:`STATES`.
        reason: why the lane is in that state, exact and stable (e.g. ``nvcc is not on PATH``).
        cmake_switch: the lane's one CMake switch (None for cpu).
        buildable: the tools to build the lane are on this machine (a device is not needed to build).
        versions: tool name -> version string, None when the tool is not on PATH.
        ggml_version: ggml's own version (``ggml_version()``), None when ggml-python cannot be loaded.
        ggml_python_version: the installed ggml-python distribution's version.
        build_options: how the installed libraries were built, as far as can be known (see
            :func:`build_options`).
        devices: the lane's devices in ggml's registry (name, description, memory in bytes).
        certification: the passed or failed self-test on record for these libraries here, or None.
        problems: for a lane that is not built, everything in the way (toolchain, then device); the
            reason is the first.
    """

    lane: str
    state: str
    reason: str
    cmake_switch: str | None
    buildable: bool
    versions: dict = field(default_factory=dict)
    ggml_version: str | None = None
    ggml_python_version: str | None = None
    build_options: dict = field(default_factory=dict)
    devices: tuple = ()
    certification: dict | None = None
    problems: tuple = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["devices"] = list(self.devices)
        d["problems"] = list(self.problems)
        return d


# ---- toolchain and device checks ---------------------------------------------------------------------

def _run(cmd: list[str]) -> tuple[int, str]:
    """Run a probe command; (exit status, stdout+stderr). 127 when it cannot start, 124 on timeout."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S)
    except FileNotFoundError:
        return 127, ""
    except subprocess.TimeoutExpired:
        return 124, ""
    except OSError as e:
        return 126, str(e)
    return p.returncode, (p.stdout or "") + (p.stderr or "")


def _vulkan_include_dirs() -> list[str]:
    dirs = []
    if os.environ.get("VULKAN_SDK"):
        dirs.append(str(Path(os.environ["VULKAN_SDK"]) / "include"))
    dirs += ["/usr/include", "/usr/local/include"]
    if sys.platform == "darwin":
        dirs.append("/opt/homebrew/include")
    return dirs


# ggml-vulkan (ggml 0.15.3, as vendored by ggml-python 0.0.45) uses VK_EXT_layer_settings, which the
# Vulkan headers carry from 1.3.272 on; Debian 12 ships 1.3.239.
VULKAN_HEADERS_NEED = ("VK_EXT_layer_settings", "1.3.272")


def _vulkan_core_h(include_dir: Path) -> str:
    """The text of ``include_dir/vulkan/vulkan_core.h``. Raises OSError when it cannot be read."""
    return (include_dir / "vulkan" / "vulkan_core.h").read_text(errors="replace")


def _headers_version(core_h: str) -> str | None:
    complete = re.search(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(\d+,\s*(\d+),\s*(\d+),", core_h)
    patch = re.search(r"#define VK_HEADER_VERSION (\d+)", core_h)
    if not (complete and patch):
        return None
    return f"{complete.group(1)}.{complete.group(2)}.{patch.group(1)}"


def vulkan_headers_version(include_dir: Path) -> str | None:
    """``1.MINOR.PATCH`` of the Vulkan headers under ``include_dir`` (from VK_HEADER_VERSION_COMPLETE and
    VK_HEADER_VERSION in vulkan/vulkan_core.h), None when they cannot be read."""
    try:
        return _headers_version(_vulkan_core_h(include_dir))
    except OSError:
        return None


def vulkan_headers_problem(include_dir: Path) -> str | None:
    """Why the Vulkan headers CMake will use (the first of :func:`_vulkan_include_dirs` that has them)
    cannot build ggml-vulkan, or None."""
    ext, first = VULKAN_HEADERS_NEED
    try:
        text = _vulkan_core_h(include_dir)
    except OSError as e:
        return f"cannot read {include_dir / 'vulkan' / 'vulkan_core.h'}: {e.strerror}"
    if f"#define {ext} 1" in text:
        return None
    version = _headers_version(text) or "of unknown version"
    return (f"the Vulkan headers under {include_dir} ({version}) lack {ext}, which ggml-vulkan needs: "
            f"set VULKAN_SDK to a Vulkan SDK with headers {first} or newer")


def _vulkan_headers_dir() -> Path | None:
    """The include directory CMake's FindVulkan will take the headers from (VULKAN_SDK first)."""
    return next((Path(d) for d in _vulkan_include_dirs() if (Path(d) / "vulkan" / "vulkan.h").is_file()), None)


def _cuda_include_dirs() -> list[str]:
    """Where CMake's FindCUDAToolkit would look for the toolkit's headers, in order."""
    roots = [os.environ[v] for v in ("CUDAToolkit_ROOT", "CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    roots.append("/usr/local/cuda")
    dirs = []
    for r in roots:
        for d in [Path(r) / "include", *sorted((Path(r) / "targets").glob("*/include"))]:
            if str(d) not in dirs:
                dirs.append(str(d))
    return dirs + ["/usr/include"]


def _cxx_compiler() -> str | None:
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def toolchain_problems(name: str) -> list[str]:
    """Everything that stops lane ``name`` from being built here, in check order; empty when it can be.

    Order: the platform (alone when it is wrong); each of the lane's tools on PATH; the headers and
    libraries its CMake needs (cuBLAS for cuda, the Vulkan headers and loader for vulkan); a C++
    compiler. Each entry is exact, e.g. ``nvcc is not on PATH``.

    Raises:
        KeyError: unknown lane.
    """
    lane = LANES[name]
    if lane.platform and sys.platform != lane.platform:
        return [f"platform {sys.platform} is not {lane.platform}"]
    problems = [f"{tool} is not on PATH" for tool in lane.build_tools if shutil.which(tool) is None]
    if name == "cuda" and not problems:
        # ggml-cuda links cuBLAS; a toolkit without it fails only after configuring.
        dirs = _cuda_include_dirs()
        if not any((Path(d) / "cublas_v2.h").is_file() for d in dirs):
            problems.append(f"cublas_v2.h (cuBLAS) is not under {', '.join(dirs)}")
    if name == "vulkan":
        found = _vulkan_headers_dir()
        if found is None:
            problems.append(f"vulkan/vulkan.h is not under {', '.join(_vulkan_include_dirs())}")
        else:
            problem = vulkan_headers_problem(found)
            if problem:
                problems.append(problem)
        if ctypes.util.find_library("vulkan") is None:
            problems.append("the Vulkan loader libvulkan is not installed")
    if _cxx_compiler() is None:
        problems.append("no C++ compiler (c++, g++ or clang++) is on PATH")
    return problems


def toolchain_problem(name: str) -> str | None:
    """The first of :func:`toolchain_problems`, or None when lane ``name`` can be built here."""
    problems = toolchain_problems(name)
    return problems[0] if problems else None


def build_problem(name: str) -> str | None:
    """Why ``scripts/build_ggml_lane.sh NAME`` would fail here, or None.

    The toolchain, and for cuda also a GPU: with only the one switch, ggml builds CUDA kernels for the
    GPUs it detects (CMAKE_CUDA_ARCHITECTURES=native), and CMake stops when there is none.
    """
    problem = toolchain_problem(name)
    if problem is None and name == "cuda":
        problem = device_problem(name)
    return problem


def device_problem(name: str) -> str | None:
    """Why this machine has no device for lane ``name`` (before ggml is built with it), or None.

    Asks the vendor's own tool, since ggml cannot be asked until it is built with the backend. cpu and
    metal need no check (every machine has a CPU; every Mac that builds Metal has a Metal device).
    """
    lane = LANES[name]
    tool = lane.device_tool
    if tool is None:
        return None
    if shutil.which(tool) is None:
        return f"{tool} is not on PATH"
    if name == "cuda":
        rc, out = _run([tool, "-L"])
        if rc != 0 or not re.search(r"^GPU \d+:", out, re.M):
            return "nvidia-smi lists no GPU"
    elif name == "rocm":
        rc, out = _run([tool])
        if rc != 0 or not re.search(r"Name:\s+gfx\w+", out):
            return "rocminfo lists no GPU agent"
    elif name == "vulkan":
        rc, out = _run([tool, "--summary"])
        types = re.findall(r"deviceType\s*=\s*(\w+)", out)
        if rc != 0 or not types:
            return "vulkaninfo lists no device"
        # A software rasteriser (llvmpipe) is a Vulkan device too, but not an accelerator worth a lane;
        # ggml-vulkan skips such devices unless GGML_VK_VISIBLE_DEVICES names them, and so do we.
        if all(t.endswith("TYPE_CPU") for t in types) and not os.environ.get(VK_VISIBLE_DEVICES_ENV):
            return (f"vulkaninfo lists only CPU (software) devices; set {VK_VISIBLE_DEVICES_ENV}=0 "
                    "to use one anyway")
    return None


@functools.lru_cache(maxsize=None)
def tool_version(tool: str) -> str | None:
    """A short version string for a build or device tool, None when it is not on PATH.

    ``unknown`` when the tool is there but did not say (its output format changed or it failed).
    """
    if shutil.which(tool) is None:
        return None
    cmds = {
        "nvcc": [tool, "--version"],
        "nvidia-smi": [tool, "--query-gpu=driver_version", "--format=csv,noheader"],
        "hipcc": [tool, "--version"],
        "hipconfig": [tool, "--version"],
        "glslc": [tool, "--version"],
        "vulkaninfo": [tool, "--summary"],
        "xcrun": [tool, "--show-sdk-version"],
        "rocminfo": None,  # has no version flag; being on PATH is what matters
    }
    cmd = cmds.get(tool, [tool, "--version"])
    if cmd is None:
        return "present"
    rc, out = _run(cmd)
    if rc != 0 or not out.strip():
        return "unknown"
    patterns = {
        "nvcc": r"release ([\d.]+), V([\d.]+)",
        "hipcc": r"HIP version:\s*(\S+)",
        "vulkaninfo": r"Vulkan Instance Version:\s*(\S+)",
        "cmake": r"cmake version\s+(\S+)",
    }
    pat = patterns.get(tool)
    if pat:
        m = re.search(pat, out)
        if not m:
            return "unknown"
        return f"{m.group(1)} (V{m.group(2)})" if tool == "nvcc" else m.group(1)
    if tool == "nvidia-smi":
        return "driver " + out.strip().splitlines()[0].strip()
    return out.strip().splitlines()[0].strip()


def toolchain_versions() -> dict[str, str | None]:
    """Every tool a lane may use -> its version (None when absent), for the JSON report."""
    tools = ["gcc", "c++", "clang", "cmake"]
    for lane in LANES.values():
        tools += [t for t in (*lane.build_tools, lane.device_tool) if t and t not in tools]
    return {t: tool_version(t) for t in tools}


def _lane_versions(lane: Lane) -> dict[str, str | None]:
    cxx = _cxx_compiler()
    out = {"c++": tool_version(cxx) if cxx else None}
    for t in (*lane.build_tools, lane.device_tool):
        if t:
            out[t] = tool_version(t)
    if lane.name == "vulkan":
        found = _vulkan_headers_dir()
        out["vulkan-headers"] = vulkan_headers_version(found) if found else None
    return out


# ---- what is installed -------------------------------------------------------------------------------

def ggml_lib_dir() -> Path | None:
    """ggml-python's ``lib`` directory (where its shared libraries live), found without importing ggml."""
    spec = importlib.util.find_spec("ggml")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _lib_names(base: str) -> tuple[str, ...]:
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
def _ggml_runtime() -> tuple[dict | None, str | None]:
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
    runtime, _ = _ggml_runtime()
    rec = build_record()
    opts = {
        "cmake_switch": lane.cmake_switch,
        "build_command": f"scripts/build_ggml_lane.sh {name}",
        "library": _lib_names(lane.library)[0 if sys.platform != "darwin" else 1],
        "installed_libraries": installed_libraries(),
        "registry_backends": runtime["backends"] if runtime else None,
        "recorded_build": rec,
    }
    if name == "cpu" and runtime:
        opts["cpu_features"] = runtime["cpu_features"]
    return opts


def _has_library(name: str) -> bool:
    d = ggml_lib_dir()
    return d is not None and any((d / n).is_file() for n in _lib_names(LANES[name].library))


# ---- certification records ---------------------------------------------------------------------------

def cache_dir() -> Path:
    """``$MESHNET_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshnet``, else ``~/.cache/meshnet``."""
    if os.environ.get("MESHNET_CACHE_DIR"):
        return Path(os.environ["MESHNET_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshnet"


def certification_key(name: str, device_description: str) -> str:
    """What a certification is valid for: the lane, these exact libraries, this host, this device."""
    return "|".join([name, lib_sha256() or "no-ggml", platform.node(), device_description])


def load_certifications() -> dict[str, dict]:
    """key -> recorded self-test (a ``CertResult`` as a dict); empty when there is no readable file."""
    try:
        data = json.loads((cache_dir() / CERT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def save_certification(key: str, record: dict) -> Path:
    """Store one self-test result under ``key`` (replacing an older one); returns the file written.
    Written to a temporary file and renamed, so a reader never sees half a file."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    entries = load_certifications()
    entries[key] = record
    path = d / CERT_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": 1, "entries": entries}, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def _device_description(name: str, runtime: dict, device_index: int = 0) -> str | None:
    names = LANES[name].registry_names
    devs = [d for d in runtime["devices"] if d["backend"] in names]
    if device_index >= len(devs):
        return None
    return devs[device_index]["description"] or devs[device_index]["name"]


def recorded_certification(name: str, device_index: int = 0) -> dict | None:
    """The self-test on record for lane ``name`` with the libraries, host and ``device_index``-th device
    of the lane here now."""
    runtime, _ = _ggml_runtime()
    if runtime is None:
        return None
    desc = _device_description(name, runtime, device_index)
    if desc is None:
        return None
    return load_certifications().get(certification_key(name, desc))


# ---- the probe ---------------------------------------------------------------------------------------

def probe_lane(name: str, device_index: int = 0) -> LaneReport:
    """Report lane ``name`` on this machine (see the module docstring for the states); certification is
    looked up for the lane's ``device_index``-th device (0 = the first ggml lists).

    Cheap apart from the vendor tools it runs (each at most a few seconds) and hashing ggml's libraries
    once per process. Never builds or certifies anything.

    Raises:
        KeyError: ``name`` is not a lane.
    """
    lane = LANES[name]
    runtime, load_error = _ggml_runtime()
    tool_problems = toolchain_problems(name)
    common = dict(lane=name, cmake_switch=lane.cmake_switch, buildable=not tool_problems,
                  versions=_lane_versions(lane), ggml_version=runtime["version"] if runtime else None,
                  ggml_python_version=ggml_python_version(), build_options=build_options(name))

    def report(state: str, reason: str, devices=(), cert=None, problems=()) -> LaneReport:
        return LaneReport(state=state, reason=reason, devices=tuple(devices), certification=cert,
                          problems=tuple(problems), **common)

    if lane.platform and sys.platform != lane.platform:
        return report("skipped", tool_problems[0], problems=tool_problems)
    in_registry = runtime is not None and any(n in runtime["backends"] for n in lane.registry_names)
    if name == "cpu" or in_registry or _has_library(name):
        if runtime is None:
            reason = f"ggml-python cannot be loaded: {load_error}"
            return report("skipped" if name == "cpu" else "built", reason, problems=[reason])
        if not in_registry:
            return report("built", f"{_lib_names(lane.library)[0]} is installed but ggml's registry has no "
                                   f"{lane.registry_names[0]} backend")
        devices = [d for d in runtime["devices"] if d["backend"] in lane.registry_names]
        if not devices:
            # The vendor tool may see a device ggml skips (llvmpipe without GGML_VK_VISIBLE_DEVICES).
            hint = device_problem(name)
            return report("built", f"ggml's {lane.registry_names[0]} backend finds no device"
                                   + (f" ({hint})" if hint else ""))
        if device_index >= len(devices):
            return report("built", f"ggml's {lane.registry_names[0]} backend lists {len(devices)} device(s), "
                                   f"no device {device_index}", devices)
        cert = recorded_certification(name, device_index)
        if cert is None:
            return report("built", "not certified on this machine: run `meshnet backends --certify`",
                          devices)
        if not cert.get("passed"):
            return report("built", f"self-test failed: {cert.get('reason', 'no reason recorded')}", devices, cert)
        return report("certified", cert.get("reason", "self-test passed"), devices, cert)

    dev_problem = device_problem(name)
    problems = tool_problems + ([dev_problem] if dev_problem else [])
    if problems:
        return report("skipped", problems[0], problems=problems)
    return report("available", f"toolchain and device present; ggml-python is not built with it: run "
                               f"scripts/build_ggml_lane.sh {name}")


def probe_all(device_index: int = 0) -> list[LaneReport]:
    """:func:`probe_lane` for every lane, in table order (accelerators for their ``device_index``-th
    device)."""
    return [probe_lane(n, 0 if n == "cpu" else device_index) for n in LANE_NAMES]


def require_certified(name: str, device_index: int = 0) -> LaneReport:
    """The lane's report when a node may compute on it (its ``device_index``-th device) and advertise
    it; cpu is always allowed (it is the engine's default path, proved by the golden tests).

    Raises:
        ValueError: unknown lane.
        BackendUnavailable: an accelerator lane that is not certified here; ``reason`` is the probe's.
    """
    if name not in LANES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(LANE_NAMES)}")
    rep = probe_lane(name, device_index)
    if name != "cpu" and rep.state != "certified":
        raise BackendUnavailable(name, rep.reason)
    return rep


def environment() -> dict:
    """Platform, Python, ggml and toolchain facts for the JSON report."""
    runtime, load_error = _ggml_runtime()
    return {
        "platform": {"system": sys.platform, "machine": platform.machine(), "release": platform.release(),
                     "host": platform.node(), "python": platform.python_version()},
        "ggml": {
            "ggml_python": ggml_python_version(),
            "ggml": runtime["version"] if runtime else None,
            "commit": runtime["commit"] if runtime else None,
            "lib_dir": str(ggml_lib_dir()) if ggml_lib_dir() else None,
            "lib_sha256": lib_sha256(),
            "libraries": installed_libraries(),
            "registry_backends": runtime["backends"] if runtime else None,
            "devices": runtime["devices"] if runtime else [],
            "cpu_features": runtime["cpu_features"] if runtime else None,
            "load_error": load_error,
        },
        "toolchain": toolchain_versions(),
        "certifications_file": str(cache_dir() / CERT_FILE),
    }


# ---- entry points for scripts/build_ggml_lane.sh -------------------------------------------------------

def _record_build(name: str, cmake_args: str, command: str) -> int:
    """After a build: check the backend really is in the new libraries, then write the build record.
    Returns 0, or 4 when the lane's backend is missing (a build that silently fell back to CPU)."""
    _ggml_runtime.cache_clear()
    runtime, err = _ggml_runtime()
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
           "versions": _lane_versions(lane)}
    path = Path(sys.prefix) / BUILD_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"recorded the {name} build in {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``toolchain LANE``: print why LANE cannot be built here (:func:`build_problem`) and exit 3, or exit 0.
    ``record LANE --cmake-args S --command S``: see :func:`_record_build`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m meshnet.backends.lanes")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("toolchain")
    t.add_argument("lane", choices=LANE_NAMES)
    r = sub.add_parser("record")
    r.add_argument("lane", choices=LANE_NAMES)
    r.add_argument("--cmake-args", default="")
    r.add_argument("--command", default="")
    args = p.parse_args(argv)
    if args.cmd == "toolchain":
        problem = build_problem(args.lane)
        if problem:
            print(problem)
            return 3
        return 0
    return _record_build(args.lane, args.cmake_args, args.command)


if __name__ == "__main__":
    sys.exit(main())
