"""torch ↔ kvcloud at the integrations' edge (torch is imported by the caller's module, never
by ``import kvcloud``): dtype names and zero-copy numpy views of a tensor's bits."""

from __future__ import annotations

from typing import Any

import numpy as np


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` → ``bfloat16`` (kvcloud's names are torch's)."""
    return str(dtype).removeprefix("torch.")


def to_numpy(t: Any) -> np.ndarray:
    """A CPU tensor's bits as numpy in kvcloud's storage dtype (numpy has no bfloat16 or fp8:
    those travel as raw integers of the same width, as kvcloud stores them)."""
    import torch

    name = dtype_name(t.dtype)
    if name == "bfloat16":
        return t.view(torch.int16).numpy().view("<u2")
    if name.startswith("float8"):
        return t.view(torch.uint8).numpy()
    return t.numpy()
