"""The worker's HTTP layer: the FastAPI app (``server``), its request schemas, streaming
responses, API-key authentication, request logging and the ASGI middleware. It drives the
engine (``workers.engine``, ``workers.engine.sessions``) and is never imported by it."""
