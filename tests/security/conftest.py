"""Fixtures for the security tests: the e2e suite's worker processes, reused as they are."""

from tests.e2e.conftest import servers_urls, spawn

__all__ = ["servers_urls", "spawn"]
