"""Whether this machine can build a lane, and whether it has a device to run it, before ggml is built.

Checks the platform, the build tools on PATH, the headers and libraries the lane's CMake needs, and asks
the vendor's own device tool (``nvidia-smi -L``, ``rocminfo``, ``vulkaninfo --summary``). Every problem
is an exact sentence, e.g. ``nvcc is not on PATH``. Nothing here imports ggml, so
``scripts/build_ggml_lane.sh`` can run it with a bare ``python3``.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from meshnet.backends.lane_table import LANES, Lane

_TOOL_TIMEOUT_S = 15
# ggml-vulkan's own device filter (like CUDA_VISIBLE_DEVICES): indices into vkEnumeratePhysicalDevices.
VK_VISIBLE_DEVICES_ENV = "GGML_VK_VISIBLE_DEVICES"


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


def lane_versions(lane: Lane) -> dict[str, str | None]:
    """The C++ compiler's and the lane's own tools' versions (None when absent); for vulkan also the
    headers' version."""
    cxx = _cxx_compiler()
    out = {"c++": tool_version(cxx) if cxx else None}
    for t in (*lane.build_tools, lane.device_tool):
        if t:
            out[t] = tool_version(t)
    if lane.name == "vulkan":
        found = _vulkan_headers_dir()
        out["vulkan-headers"] = vulkan_headers_version(found) if found else None
    return out

