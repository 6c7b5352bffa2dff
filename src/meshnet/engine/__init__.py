"""Shard engines: compute for one layer range behind the contract in :mod:`meshnet.contract`."""

from meshnet.engine.base import EngineError, ShardEngine

__all__ = ["EngineError", "ShardEngine"]
