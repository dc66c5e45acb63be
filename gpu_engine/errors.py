"""The engine's typed errors, its own: none of them is a store error.

Each class is a caller mistake or a limit of this engine. The engine's gRPC service maps
them to status codes in one table (`gpu_engine.service`); configs keep the store's
`InvalidArgumentError`, since they are parsed by the shared `kvstore.config` machinery.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses: an empty prompt, a token outside the vocabulary, bad
    sampling parameters, or more tokens than the model's positions or the page pool hold.
    Nothing was queued."""


class BlockSizeError(EngineError, ValueError):
    """A block handed to the KV cache is not one block of the cache's dtype and layout;
    nothing was written."""


class OutOfPagesError(EngineError):
    """The page pool has no free or evictable page left for an allocation; nothing changed."""


class EngineFailedError(EngineError):
    """A step of the engine raised (a bug, or a device error): the engine stopped, every
    unfinished request ended with this error, and new ones are refused."""


class RequestAbortedError(EngineError):
    """The request's caller went away (its stream was cancelled); the engine stopped
    computing it and released its pages."""


class PublishError(EngineError):
    """A prefill engine could not commit all full blocks of a finished request's prompt in
    the store within its bound; `num_published_tokens` leading tokens are committed (a
    decode engine recomputes the rest)."""

    def __init__(self, message: str, num_published_tokens: int) -> None:
        super().__init__(message)
        self.num_published_tokens = num_published_tokens
