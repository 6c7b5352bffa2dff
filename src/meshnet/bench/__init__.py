"""Benchmarks: each writes its figures as JSON (speed and memory are measured here, never asserted in tests)."""
