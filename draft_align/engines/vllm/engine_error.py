"""The vLLM adapter's one error type (its own module: the worker functions and the engine starter both raise it)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """vLLM is missing, refused to start, or an engine is left in a state that cannot serve."""
