"""The lane table: how each build lane of ggml-python is made and what it needs.

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
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.backends import LANE_NAMES


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
