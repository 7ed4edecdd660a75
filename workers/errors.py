"""Errors the engine raises for bad requests; the HTTP layer maps them to status codes."""

from __future__ import annotations


class WorkerError(Exception):
    """A request the worker cannot serve. ``status`` is the HTTP status to answer with."""

    status: int = 400
    code: str = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequestError(WorkerError):
    status = 400


class ContextLengthError(WorkerError):
    status = 400
    code = "context_length_exceeded"


class SessionUnknownError(WorkerError):
    status = 404
    code = "session_not_found"


class CacheFullError(WorkerError):
    """Every page is pinned by running requests or sessions; try again later."""

    status = 503
    code = "cache_full"


class StoreUnavailableError(WorkerError):
    """An explicit store operation (a flush) could not reach kvcloud; nothing was lost."""

    status = 503
    code = "store_unavailable"
