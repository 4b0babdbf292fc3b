"""The engine's exception tree; the gateway translates these to OpenAI error bodies."""

from __future__ import annotations

from dataclasses import dataclass


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(EngineError):
    """An engine setting out of range."""


class InvalidRequestError(EngineError):
    """A request the engine cannot accept (bad sampling parameters, too long, duplicate id)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context."""


class EngineDeadError(EngineError):
    """The engine loop stopped and takes no more work."""


class RequestErrorCode:
    """Why a request ended with finish_reason "error" (RequestOutput.error_code). The
    request's own doing, answered like a bad request (the gateway's 400), or the server's."""

    ENGINE_ERROR = "engine_error"  # a step it was in failed
    GRAMMAR_INVALID = "grammar_invalid"  # its grammar did not compile in the engine
    GRAMMAR_LIMIT_EXCEEDED = "grammar_limit_exceeded"  # the grammar library's own limits
    GRAMMAR_BUDGET_EXCEEDED = "grammar_budget_exceeded"  # its masks took more time than allowed
    GRAMMAR_INTERNAL_ERROR = "grammar_internal_error"  # the grammar library panicked on it
    ADAPTER_INVALID = "adapter_invalid"  # its LoRA adapter could not be loaded
    # A finished output failed its JSON schema's check (what the grammar could not enforce:
    # gateway.openai.schema_check)
    STRUCTURED_OUTPUT_INVALID = "structured_output_invalid"

    # The codes a request causes by what it sent (the others are the server's failures).
    CAUSED_BY_REQUEST = frozenset(
        {GRAMMAR_INVALID, GRAMMAR_LIMIT_EXCEEDED, GRAMMAR_BUDGET_EXCEEDED, ADAPTER_INVALID,
         STRUCTURED_OUTPUT_INVALID}
    )


@dataclass(frozen=True)
class RequestFault:
    """Why one request must end with an error, found while it ran."""

    code: str  # a RequestErrorCode
    message: str  # for its client: no server internals


def is_fatal(exc: BaseException) -> bool:
    """Whether exc must stop the thread it reached (an interrupt, an exit). Anything else a
    native library raises, such as a Rust panic surfacing as pyo3's PanicException (a
    BaseException, not an Exception), fails the request it was raised for, not the engine."""
    return isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit)
