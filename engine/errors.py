"""The engine's exception tree; the gateway translates these to OpenAI error bodies."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError):
    """A request the engine cannot accept (bad sampling parameters, too long, duplicate id)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context."""


class EngineDeadError(EngineError):
    """The engine loop stopped and takes no more work."""
