"""A context-manager mixin for anything with a ``close()``."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self


class Closing:
    """``with obj:`` closes obj on the way out, exception or not."""

    def close(self) -> None:  # pragma: no cover - overridden
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any:
        self.close()
        return None
