"""The paged latent KV cache (data passed in and returned) and the host-side page allocator.

``KVCache.kv`` is one array ``[num_pages, num_layers, page_size, kv_lora_rank + qk_rope_head_dim]`` for
every main layer (first) and MTP layer (after them); row layout: :mod:`tokenspeed_jax.decode`.  All layers
share one page table: a request owns the same page ids in every layer.  ``k_scale`` is the FP8 scale (a
float32 scalar, 1.0 and unused for 16/32-bit caches).

Layout (documented decision): page-major with the layers inside a page.  Reshaped (a bitcast) to
``[num_pages * num_layers, page_size, D]`` it is an ordinary paged cache in which layer ``l``'s copy of page
``p`` is page ``p * num_layers + l`` (:func:`layer_pages`, :func:`layer_slots`), so a scanned layer reads
and writes the one cache the scan carries, with no per-layer slice copied, and the MLA custom calls see a
plain ``[num_pages, page_size, D]`` operand.  Sharding the page axis over the mesh's data axis gives each
data rank its own pages of every layer (DP attention) with shard-local page ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config


def layer_pages(block_table: jax.Array, layer, num_layers: int) -> jax.Array:
    """Page ids of ``layer`` in the flattened ``[num_pages * num_layers, page_size, D]`` cache."""
    return block_table * num_layers + layer


def layer_slots(slot_mapping: jax.Array, layer, num_layers: int, page_size: int) -> jax.Array:
    """Slots of ``layer`` in the flattened cache; negative slots (write nothing) stay negative."""
    s = (slot_mapping // page_size * num_layers + layer) * page_size + slot_mapping % page_size
    return jnp.where(slot_mapping < 0, -1, s)


@struct.dataclass
class KVCache:
    kv: jax.Array
    k_scale: jax.Array

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    @property
    def dtype(self):
        return self.kv.dtype

    def layer(self, i: int) -> jax.Array:
        """Layer ``i``'s ``[num_pages, page_size, D]`` cache (a copy; for tests and inspection)."""
        return self.kv[:, i]

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
        mesh=None,
    ) -> KVCache:
        """Zero-filled (or ``fill``-ed, e.g. NaN in tests) caches for every main and MTP layer; on a
        ``mesh`` created in place with its NamedSharding (pages over ``data``)."""
        n = config.num_hidden_layers + config.num_nextn_predict_layers
        shape = (num_pages, n, page_size, config.kv_cache_dim)
        if mesh is None:
            kv = jnp.full(shape, fill, dtype)
        else:
            from jax.sharding import NamedSharding
            from tokenspeed_jax.models.deepseek.parallel import cache_spec

            sharding = NamedSharding(mesh, cache_spec(mesh))
            kv = jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=sharding)()
        return cls(kv=kv, k_scale=jnp.asarray(k_scale, jnp.float32))


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
