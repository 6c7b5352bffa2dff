"""Meshnet: run one GGUF language model across several machines, one layer range per node."""

from meshnet import openmp as _openmp  # noqa: F401  (before anything loads ggml: sets its OpenMP spin)

__version__ = "0.1.0"
