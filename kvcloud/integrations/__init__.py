"""Helpers that connect kvcloud to inference frameworks.

Each integration lives in its own submodule (``kvcloud.integrations.transformers``) and imports
its framework only when used, so ``import kvcloud`` and ``import kvcloud.integrations`` stay
free of torch and transformers: kvcloud itself works on numpy arrays only.
"""

from __future__ import annotations

__all__: list[str] = []
