"""Meshnet: run one GGUF language model across several machines, one layer range per node."""

__version__ = "0.1.0"
