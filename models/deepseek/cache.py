"""The paged latent KV cache (data passed in and returned) and the host-side page allocator.

``KVCache.layers[i]`` is layer ``i``'s ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` cache
(row layout: :mod:`tokenspeed_jax.decode`); the main model's layers come first, then one cache per MTP
layer.  All layers share one page table: a request owns the same page ids in every layer.  ``k_scale`` is
the FP8 scale (a float32 scalar, 1.0 and unused for 16/32-bit caches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config


@struct.dataclass
class KVCache:
    layers: tuple[jax.Array, ...]
    k_scale: jax.Array

    @property
    def num_pages(self) -> int:
        return self.layers[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.layers[0].shape[1]

    @property
    def dtype(self):
        return self.layers[0].dtype

    @classmethod
    def create(
        cls,
        config: DeepseekV3Config,
        *,
        num_pages: int,
        page_size: int,
        dtype=jnp.bfloat16,
        k_scale: float = 1.0,
        fill: float = 0.0,
    ) -> KVCache:
        """Zero-filled (or ``fill``-ed, e.g. NaN in tests) caches for every main and MTP layer."""
        n = config.num_hidden_layers + config.num_nextn_predict_layers
        shape = (num_pages, page_size, config.kv_cache_dim)
        layers = tuple(jnp.full(shape, fill, dtype) for _ in range(n))
        return cls(layers=layers, k_scale=jnp.asarray(k_scale, jnp.float32))


class PageAllocator:
    """Hands out page ids per request from a free list.

    ``shuffle=True`` (with ``seed``) hands out pages in a random order, which tests use to check that
    results do not depend on where a request's pages are.  Freed pages return to the free list.
    """

    def __init__(self, num_pages: int, page_size: int, *, shuffle: bool = False, seed: int = 0):
        self.num_pages = num_pages
        self.page_size = page_size
        free = np.arange(num_pages)
        if shuffle:
            np.random.default_rng(seed).shuffle(free)
        self._free = list(free[::-1])  # pop() from the end returns free[0] first
        self.pages: dict[int, list[int]] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, request: int, num_tokens: int) -> list[int]:
        """Grow ``request``'s pages to hold ``num_tokens`` tokens; returns its page list."""
        pages = self.pages.setdefault(request, [])
        need = self.pages_for(num_tokens) - len(pages)
        if need > len(self._free):
            raise ValueError(
                f"num_tokens: request {request} needs {need} more pages of {self.page_size} "
                f"tokens, only {len(self._free)} of {self.num_pages} are free"
            )
        for _ in range(max(need, 0)):
            pages.append(int(self._free.pop()))
        return pages

    def free(self, request: int) -> None:
        self._free.extend(reversed(self.pages.pop(request, [])))

    def block_table(self, requests: list[int], max_pages: int) -> np.ndarray:
        """int32 ``[len(requests), max_pages]``; unused entries are 0 (never read: lengths bound reads)."""
        bt = np.zeros((len(requests), max_pages), np.int32)
        for i, r in enumerate(requests):
            p = self.pages.get(r, [])
            if len(p) > max_pages:
                raise ValueError(f"max_pages: request {r} owns {len(p)} pages, more than {max_pages}")
            bt[i, : len(p)] = p
        return bt

    def slots(self, request: int, positions) -> np.ndarray:
        """Cache slots ``page * page_size + row`` of the given token positions of ``request``."""
        pages = np.asarray(self.pages[request], np.int64)
        positions = np.asarray(positions, np.int64)
        return (pages[positions // self.page_size] * self.page_size + positions % self.page_size).astype(
            np.int32
        )
