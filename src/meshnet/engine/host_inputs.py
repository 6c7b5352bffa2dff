"""A graph's inputs written in place, through numpy views of their memory, where that memory is the host's.

After a graph has streamed a model's weights through the CPU's caches, every Python and numpy call that
follows runs cold: setting SmolLM2's four decode inputs through ``ggml_backend_tensor_set`` from freshly
built arrays took 150-250 us a step, against 9 ms of compute; written into views of the compute buffer,
they take a third of that. Device buffers (not host memory) keep going through ggml.
"""

from __future__ import annotations

import ctypes

import ggml
import numpy as np

from meshnet.engine.ggml_backend import set_tensor

NUMPY_TYPES = {ggml.GGML_TYPE_I32: np.int32, ggml.GGML_TYPE_I64: np.int64, ggml.GGML_TYPE_F32: np.float32,
               ggml.GGML_TYPE_F16: np.float16}


def host_view(t, flat: bool = True) -> np.ndarray | None:
    """A numpy view of an allocated tensor's data when it lies in host memory: flat, or ``[ne3, ne2, ne1,
    ne0]`` (numpy order); None for no tensor, one without data yet, or one in a device's memory. Valid
    while the tensor keeps its place (until its graph allocator places another graph there)."""
    if t is None or not t.contents.data or not ggml.ggml_backend_buffer_is_host(t.contents.buffer):
        return None
    ne = t.contents.ne
    raw = (ctypes.c_char * ggml.ggml_nbytes(t)).from_address(t.contents.data)
    view = np.frombuffer(raw, dtype=NUMPY_TYPES[int(t.contents.type)])
    return view if flat else view.reshape(ne[3], ne[2], ne[1], ne[0])


def put(views: dict[str, np.ndarray], name: str, t, a: np.ndarray) -> None:
    """Write ``a`` (its values in the tensor's order, of its dtype) into input ``t``: through the flat
    view ``views[name]`` when there is one, else through ggml.

    Raises:
        ValueError: ``a`` has another number of values than the tensor."""
    view = views.get(name)
    if view is None:
        set_tensor(t, a)
    elif a.size != view.size:
        raise ValueError(f"tensor size mismatch: ggml wants {view.size} values, got {a.size}")
    else:
        view[:] = a.reshape(-1)
