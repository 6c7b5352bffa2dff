"""A layer range, its KV caches and its compute on an accelerator device.

:class:`AcceleratorStage` is :class:`~meshnet.engine.ggml_stage.GgmlStage` with two differences: its
backend is the lane's device (``accelerator_backend``), and its weights are copied into device memory
(a GPU cannot compute on the host's memory map of the GGUF file). KV caches and graph buffers are
allocated by that backend, so they live on the device too. The graphs are the CPU engine's own
(:class:`~meshnet.engine.ggml_graph.StepGraph`), built from ops every accelerator backend of ggml
implements; the certification self-test is what proves a given build runs them correctly.

:class:`AcceleratorEngine` serves such a stage through the shard-engine contract and reports the lane
as its backend, the device and its free memory.

This path needs a built accelerator lane and its device: on a machine without one it is never
entered (``accelerator_backend`` raises ``BackendUnavailable`` first), so CPU-only test runs cannot
exercise it; the certification self-test and ``tests/test_accelerator_lane.py`` exercise it where a device
exists (a GPU, or Mesa's llvmpipe through the vulkan lane).
"""

from __future__ import annotations

import dataclasses

from meshnet.contract import Capabilities, LayerRange, Status

from meshnet.load_spec import LoadSpec
from meshnet.engine.base import EngineError
from meshnet.engine.ggml_backend import BackendUnavailable, accelerator_backend, accelerator_devices, device_memory
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.engine.ggml_stage import GgmlStage
from meshnet.engine.numerics import numerics_key
from meshnet.model.gguf_file import GGUFError


class AcceleratorStage(GgmlStage):
    """Layers ``[start, end)`` of a GGUF model with weights, KV caches and compute on one device.

    Args:
        lane: cuda, rocm, vulkan or metal.
        device_index: which of the lane's devices (in ggml's registry order).
    Raises (constructor):
        BackendUnavailable: no such backend or device here.
        FileNotFoundError, GGUFError: as for GgmlStage.
        MemoryError: the weights do not fit in the device's memory.
    """

    def __init__(self, path: str, layers: LayerRange, lane: str, device_index: int = 0, n_ctx: int = 0,
                 n_ubatch: int = 512) -> None:
        # The backend first: a lane or device that is not here fails before the file is read.
        backend = accelerator_backend(lane, device_index)
        self.lane = lane
        self.device_index = device_index
        self.device = accelerator_devices(lane)[device_index]
        # Weights copied into device memory, then the file pages read to copy them dropped; the KV pool
        # (inherited) is allocated with this backend too, sized by half the device memory free now.
        super().__init__(path, layers, n_ctx=n_ctx, n_ubatch=n_ubatch, use_mmap=False, backend=backend,
                         kv_budget_bytes=device_memory(lane, device_index)[0] // 2)

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of this stage's device now."""
        return device_memory(self.lane, self.device_index)


class AcceleratorEngine(GgmlEngine):
    """The ggml shard engine with the stage on an accelerator device; ``capabilities().backend`` is the
    lane. Only to be built for a certified lane (the node checks before it gets here)."""

    def __init__(self, lane: str, device_index: int = 0) -> None:
        super().__init__()
        self.lane = lane
        self.device_index = device_index

    def _load(self, spec: LoadSpec) -> Capabilities:
        # The CPU engine validates the file, its hash and the range; with the memory map that costs no
        # copy, and the CPU stage is dropped as soon as the device stage exists.
        caps = super()._load(dataclasses.replace(spec, use_mmap=True))
        cpu_stage = self.stage
        try:
            stage = AcceleratorStage(spec.path, spec.artifact.layers, self.lane, self.device_index,
                                     spec.n_ctx, spec.n_ubatch)
        except BackendUnavailable as e:
            failure = EngineError(Status.FAILED_PRECONDITION, str(e))
        except MemoryError as e:
            failure = EngineError(Status.RESOURCE_EXHAUSTED, f"{self.lane} device {self.device_index}: {e}")
        except (GGUFError, FileNotFoundError) as e:
            failure = EngineError(Status.INVALID_ARGUMENT, str(e))
        else:
            failure = None
        if failure is not None:
            # Never fall back to computing on the CPU under an accelerator's name.
            cpu_stage.close()
            self.stage = None
            raise failure
        self.stage = stage
        cpu_stage.close()
        dev = stage.device or {}
        name = dev.get("description") or dev.get("name") or f"device {self.device_index}"
        return dataclasses.replace(caps, backend=self.lane, n_ctx=stage.session_tokens,
                                   numerics=numerics_key(self.lane, name, spec.n_threads, spec.repack, spec.n_ubatch))

    @property
    def device(self) -> dict | None:
        """The device the stage runs on (name, description, memory in bytes), None before load."""
        return getattr(self.stage, "device", None)

    def device_free_bytes(self) -> int:
        """Free bytes of the device now (what the node registers as its free memory)."""
        if not isinstance(self.stage, AcceleratorStage):
            return 0
        return self.stage.device_memory()[0]
