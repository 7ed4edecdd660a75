"""The paged KV cache: a pool of fixed pages and a prefix cache over them.

One page holds one chunk (``chunk_tokens`` tokens) of every layer's K and V in the cache
dtype, laid out exactly like a kvcloud segment ``[layers, 2, chunk, kv_heads, head_dim]``,
so pushing a page is one encode of its bytes and pulling writes straight into it.

Full pages are shared through the prefix cache (fingerprint → page, reference counted);
unreferenced ones stay cached and are evicted least-recently-used when the pool runs dry.
Partial pages (a sequence's tail) are private to their holder.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .model import ModelConfig

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class PagePool:
    def __init__(
        self, n_pages: int, cfg: ModelConfig, chunk_tokens: int, dtype: str, device: torch.device
    ) -> None:
        self.n_pages = n_pages
        self.chunk_tokens = chunk_tokens
        self.dtype_name = dtype
        self.device = device
        self.data = torch.zeros(
            (n_pages, cfg.n_layers, 2, chunk_tokens, cfg.n_kv_heads, cfg.head_dim),
            dtype=TORCH_DTYPES[dtype],
            device=device,
        )
        # LIFO keeps recently freed (cache-warm) pages in use first
        self._free = list(range(n_pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, page: int) -> None:
        self._free.append(page)

    @property
    def page_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def host_view(self, page: int) -> np.ndarray:
        """The page as a numpy array kvcloud can read from and pull into.

        On CPU it shares memory with the pool (zero copy). bfloat16 has no numpy dtype, so
        its bits travel as uint16, which is what kvcloud stores for that dtype.
        """
        if self.device.type != "cpu":
            raise RuntimeError("host_view is for CPU pools; use to_host/from_host on GPUs")
        t = self.data[page]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def to_host(self, page: int, n_tokens: int | None = None) -> np.ndarray:
        """A host copy of the page (or of its first n_tokens), safe to hand to another thread."""
        t = self.data[page] if n_tokens is None else self.data[page][:, :, :n_tokens]
        t = t.detach().to("cpu", copy=True).contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def from_host(self, page: int, arr: np.ndarray) -> None:
        src = torch.from_numpy(np.ascontiguousarray(arr))
        if self.data.dtype == torch.bfloat16:
            src = src.view(torch.int16).view(torch.bfloat16)
        self.data[page][:, :, : arr.shape[2]].copy_(src)


@dataclass
class CachedPage:
    page: int
    fp: bytes
    parent: bytes
    refs: int = 0
    stored: bool = False  # known to be in kvcloud: never pushed again
    tenant: str | None = None  # whose fingerprints: decides its encryption when pushed
    key: str | None = None  # its object key, when known stored (a session record may name it)
    uploading: bool = False  # queued for the uploader: not offered twice


class PrefixCache:
    """fingerprint → full page, with reference counts and an LRU of unreferenced pages."""

    def __init__(self) -> None:
        self._by_fp: dict[bytes, CachedPage] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # refs == 0, oldest first

    def __len__(self) -> int:
        return len(self._by_fp)

    def __contains__(self, fp: bytes) -> bool:
        return fp in self._by_fp

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def get(self, fp: bytes) -> CachedPage | None:
        return self._by_fp.get(fp)

    def acquire(self, fp: bytes) -> CachedPage | None:
        cp = self._by_fp.get(fp)
        if cp is None:
            return None
        if cp.refs == 0:
            self._lru.pop(fp, None)
        cp.refs += 1
        return cp

    def release(self, fp: bytes) -> None:
        cp = self._by_fp[fp]
        if cp.refs <= 0:
            raise RuntimeError("page released more often than acquired")
        cp.refs -= 1
        if cp.refs == 0:
            self._lru[fp] = None  # most recently used end

    def insert(
        self,
        fp: bytes,
        parent: bytes,
        page: int,
        stored: bool = False,
        tenant: str | None = None,
        key: str | None = None,
    ) -> CachedPage:
        """Register a full page, held once by the caller."""
        if fp in self._by_fp:
            raise KeyError("fingerprint already cached")
        cp = CachedPage(
            page=page, fp=fp, parent=parent, refs=1, stored=stored, tenant=tenant, key=key
        )
        self._by_fp[fp] = cp
        return cp

    def pop_lru(self) -> CachedPage | None:
        """Remove and return the least recently used unreferenced page."""
        if not self._lru:
            return None
        fp, _ = self._lru.popitem(last=False)
        return self._by_fp.pop(fp)

    def pages(self) -> list[CachedPage]:
        return list(self._by_fp.values())


class SeqPages:
    """A sequence's page table, as the model sees it (implements model.KVPages)."""

    def __init__(self, pool: PagePool, pages: list[int]) -> None:
        self.pool = pool
        self.pages = pages
        self.c = pool.chunk_tokens

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        data = self.pool.data
        n = k.shape[0]
        i = 0
        while i < n:
            pos = start + i
            page, off = self.pages[pos // self.c], pos % self.c
            m = min(self.c - off, n - i)
            data[page, layer, 0, off : off + m] = k[i : i + m]
            data[page, layer, 1, off : off + m] = v[i : i + m]
            i += m

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_pages = -(-length // self.c)
        if n_pages == 1:
            kv = self.pool.data[self.pages[0], layer]
            return kv[0, :length], kv[1, :length]
        idx = torch.tensor(self.pages[:n_pages], device=self.pool.device)
        kv = self.pool.data[idx, layer]  # [pages, 2, c, kvh, hd]
        k = kv[:, 0].reshape(-1, *kv.shape[-2:])[:length]
        v = kv[:, 1].reshape(-1, *kv.shape[-2:])[:length]
        return k, v
