"""Accelerator lanes for the ggml engine: how each is built, what this machine has, and what is proved.

A *lane* is one way of building ggml-python: ``cpu`` (the default build) or one accelerator backend
(``cuda``, ``rocm``, ``vulkan``, ``metal``), each adding exactly one CMake switch to the default.

* :mod:`meshnet.backends.lane_table`: the lane table (switch, tools, device check, platform).
* :mod:`meshnet.backends.lanes`: ``probe_lane`` (available / built / certified / skipped, with the
  exact reason), from :mod:`~meshnet.backends.toolchain` (tools and devices before ggml is built),
  :mod:`~meshnet.backends.installed` (the ggml-python installed here) and
  :mod:`~meshnet.backends.certifications` (self-test results on record).
* :mod:`meshnet.backends.certify`: the self-test that compares a lane's logits with a reference on a
  golden model; only a passed self-test lets a node advertise an accelerator.
* :mod:`meshnet.backends.placement`: a layer range and its KV caches on an accelerator device.
* :mod:`meshnet.backends.cli`: ``meshnet backends [--json] [--certify]``.

This package imports nothing heavy on import, so ``scripts/build_ggml_lane.sh`` can run its toolchain
check with a bare ``python3`` before ggml-python exists.
"""

LANE_NAMES = ("cpu", "cuda", "rocm", "vulkan", "metal")
ACCELERATOR_LANES = LANE_NAMES[1:]

__all__ = ["ACCELERATOR_LANES", "LANE_NAMES"]
