"""How the Redis index retries: connection errors only, briefly, never a refused password."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from redis import exceptions as rexc
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

T = TypeVar("T")


class _Retry(Retry):
    """redis-py's Retry, minus retries of authentication failures.

    Those are ConnectionError subclasses, but a wrong password stays wrong, so retrying
    only delays the error.
    """

    def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            if isinstance(error, (rexc.AuthenticationError, rexc.AuthorizationError)):
                return False
            return is_retryable(error) if is_retryable is not None else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def default_retry() -> Retry:
    # Connection errors only: a timeout already cost socket_timeout, and repeating it would
    # multiply the wait of a caller that is about to fall back to recompute. Backoff sleeps
    # are 0.1 + 0.2 + 0.4 s, so a refused connection fails in well under a second or two.
    return _Retry(
        ExponentialBackoff(cap=0.4, base=0.05), retries=3, supported_errors=(rexc.ConnectionError,)
    )
