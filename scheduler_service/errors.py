"""Failures the engine tells apart."""

from __future__ import annotations

from services.types import EngineCoreOutput


class WorkerUnavailableError(RuntimeError):
    """A worker cannot be reached (transport failure or timeout), as opposed to a step failing in it."""


class WorkerLostError(RuntimeError):
    """Raised by `EngineCore.step` when a worker is unreachable; carries every request's ERROR update."""

    def __init__(self, message: str, outputs: list[EngineCoreOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs
