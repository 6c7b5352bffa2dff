"""What a stage loads: a GGUF, the identity expected of it, and the execution settings (threads, context,
KV cells, prefix cache, decode groups), with their bounds, and the one line a failed load is reported by.

Shared by every way a stage starts: a node process, its engine worker, ``meshnet up``, the in-process
API and the benchmarks.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from meshnet.contract import ArtifactId


@dataclass(frozen=True)
class MultiTokenPrediction:
    """Next-token-prediction (MTP) drafts: with ``enabled`` (the default) a tail stage whose GGUF
    carries an MTP block (``nextn`` tensors) loads it and keeps its KV cells, so that steps asking for
    ``StepRequest.mtp_drafts`` get them; False leaves the block's weights and cells out."""

    enabled: bool = True


@dataclass(frozen=True)
class AuxiliaryState:
    """Reserved hook: architecture-local per-session state besides the KV cache (recurrent state,
    convolution state). Not implemented: enabling it is refused at construction."""

    enabled: bool = False
    kind: str = ""

    def __post_init__(self) -> None:
        if self.enabled:
            raise NotImplementedError(f"auxiliary state {self.kind!r} is reserved and not implemented")


# The least value of each of LoadSpec's integer execution settings (the flags that set them refuse values
# outside these bounds as they parse: meshnet.arg_types.load_setting).
LOAD_SETTING_LEAST = {"n_threads": 1, "n_ctx": 0, "n_ubatch": 1, "max_sessions": 1, "memory_budget_bytes": 0,
                      "kv_tokens": 0, "prefix_cache": 0, "decode_groups": 0}
# ... and the most: ggml's compute plans hold at most GGML_MAX_N_THREADS (512) threads (beyond, OpenMP
# fails to start them and the process exits); sessions are counted in 32-bit fields on the wire. A context
# of 2**24 tokens is past any model's training (KV cells are handed out as used, so a large one costs
# nothing until filled); an n_ctx of 2**55 overflowed ggml's tensor sizes (an abort), 1e20 Python's. The
# prefix cache's slots are made at load: 10**9 of them grew memory by 1.4 GB/s without a word.
LOAD_SETTING_MOST = {"n_threads": 512, "max_sessions": 65536, "n_ctx": 1 << 24, "prefix_cache": 65536}


@dataclass(frozen=True)
class LoadSpec:
    """What to load: a GGUF path, its expected identity and execution settings.

    Attributes:
        path: the GGUF file.
        artifact: expected sha256 and layer range; ``sha256=""`` accepts whatever model the file holds.
        n_threads: CPU threads for compute.
        n_ctx: context length in tokens per session (0 = the model's trained length, capped at 4096).
        n_ubatch: prefill micro-batch size in tokens.
        max_sessions: concurrent sessions before RESOURCE_EXHAUSTED.
        memory_budget_bytes: KV bytes across sessions before RESOURCE_EXHAUSTED (0 = unlimited).
        kv_tokens: KV cells the stage's pool lets sessions reserve at once (0 = derived from
            ``memory_budget_bytes``, else from half the memory available; at most
            ``(max_sessions + prefix_cache) * n_ctx``: kept sessions have slots of their own).
        use_mmap: map the weights from the file instead of copying them (llama.cpp's default).
        repack: on the CPU, keep mat-mul weights in ggml's repacked layouts where those kernels give each
            row the bits it gets alone (llama.cpp repacks by default; see :mod:`meshnet.engine.cpu_repack`).
        huge_pages: on the CPU, where the kernel offers transparent huge pages and the weights take at most
            half the memory available, copy them out of the file's map into memory backed by huge pages,
            which the kernels stream faster (the token embedding of a stage that only looks rows up in it
            stays mapped; see :mod:`meshnet.engine.huge_pages`).
        prefix_cache: finished sessions whose KV cells a stage keeps for new prompts that start with the
            same tokens (exact reuse: :mod:`meshnet.engine.prefix_cache`); 0 keeps none.
        decode_groups: groups the open sessions' decode steps are split into, taking turns (see
            :mod:`meshnet.engine.scheduler`): 1 batches every waiting decode together (one stage, or stages
            in one process); 0 = one group per pipeline stage, estimated as the model's decode cost over
            the range's (:func:`meshnet.layer_split.pipeline_depth`; a node process in a mesh).
    """

    path: str
    artifact: ArtifactId
    n_threads: int = 2
    n_ctx: int = 0
    n_ubatch: int = 512
    max_sessions: int = 16
    memory_budget_bytes: int = 0
    kv_tokens: int = 0
    use_mmap: bool = True
    repack: bool = True
    huge_pages: bool = True
    prefix_cache: int = 4
    decode_groups: int = 1
    mtp: MultiTokenPrediction = MultiTokenPrediction()
    aux_state: AuxiliaryState = AuxiliaryState()

    def validate(self) -> str | None:
        """What is wrong with the execution settings (one line naming each bad value), or None."""
        bad = [f"{name}={getattr(self, name)} (>= {low})" for name, low in LOAD_SETTING_LEAST.items()
               if getattr(self, name) < low]
        bad += [f"{name}={getattr(self, name)} (<= {high})" for name, high in LOAD_SETTING_MOST.items()
                if getattr(self, name) > high]
        return f"bad load settings: {', '.join(bad)}" if bad else None


def load_failure(e: Exception, what: str) -> str:
    """One line saying why loading ``what`` (e.g. "layers 0:12 of smollm2 with n_ctx=4096") failed with
    ``e``: a ValueError's message already says it (a bad model, range or setting), and so does an OSError's
    (a missing or unreadable file); memory running out names ``what``, whose settings size the memory."""
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM):
        return f"not enough memory to load {what} ({e or 'MemoryError'}); lower them"
    if isinstance(e, (ValueError, OSError)):
        return str(e)
    return f"{type(e).__name__}: {e}"


# The help of ``--no-huge-pages`` (``LoadSpec.huge_pages``), the same on every command that loads stages.
NO_HUGE_PAGES_HELP = ("leave the weights in the file's memory map (by default, on the CPU where the kernel offers "
                      "transparent huge pages and they take at most half the memory available, they are copied "
                      "into memory backed by huge pages, which decodes faster; a head's token embedding stays "
                      "mapped)")
# The help of ``--prefix-cache`` (``LoadSpec.prefix_cache``), the same on every command that loads stages.
PREFIX_CACHE_HELP = ("finished sessions kept for prompts that start the same way (exact prefix reuse; 0 = none; "
                     "default %(default)s)")
