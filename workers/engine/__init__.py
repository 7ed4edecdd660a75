"""The worker's inference engine: one model, its KV pages and prefix cache, restores from and
pushes to kvcloud, sessions, the cost model that decides restore vs recompute, the uploader
and the engine's metrics. It imports neither the HTTP layer (``workers.http``) nor the
benchmarks (``workers.bench``); both drive it.

``Engine`` and the request/result types it takes and returns are its public face."""

from .engine import Engine
from .types import CompletionRequest, CompletionResult

__all__ = ["CompletionRequest", "CompletionResult", "Engine"]
