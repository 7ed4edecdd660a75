"""``kvcloud bench store``: kvcloud's push, pull and lookup next to a plain client, in one run.

Every figure is measured against a baseline that moves the same bytes to the same store with
the same concurrency, in the same process and the same run (ratios, never absolute
times alone):

- push: ``KVCloud.push_chunks`` of N fresh chunks vs plain ``put_object`` (or ``open().write``
  for ``file://``) of the very bytes kvcloud stores, to fresh keys;
- pull: ``lookup`` + ``pull_into`` (verification included) of those N chunks into
  preallocated pages, the worker's restore path, and ``lookup`` + ``pull(out=…)`` into one
  preallocated ``[layers, 2, tokens, …]`` array (each chunk lands strided), vs plain parallel
  ``get_object()['Body'].read()`` (or ``open().read``) of the same objects;
- lookup: latency of a ``lookup_chunks``-chunk prompt (all hits) vs one ``index.ping()``;
- with ``encrypt``: the same push and pulls for a tenant that encrypts at rest (AES-256-GCM),
  in the same rounds, next to the unencrypted kvcloud figures — the overhead ratio.

The bench writes only under a namespace of its own (``model="kvcloud-bench"``, a random
revision per run), so it can run against a production deployment and clean up exactly what it
wrote. ``run_store_bench`` is the entry point for Python callers (the worker bench, the docs
generator); ``kvcloud bench store`` (:mod:`kvcloud.tools.cli.bench`) is a thin wrapper around it.
"""

from .layout import BENCH_ENC_TENANT, BENCH_MODEL, BenchError, BenchLayout
from .servers import find_server_binaries, local_servers
from .store import JSON_VERSION, run_store_bench

__all__ = [
    "BENCH_ENC_TENANT",
    "BENCH_MODEL",
    "JSON_VERSION",
    "BenchError",
    "BenchLayout",
    "find_server_binaries",
    "local_servers",
    "run_store_bench",
]
