"""The model on a device mesh: axes ``data`` / ``tensor`` / ``expert``, parameter and cache shardings.

* ``tensor``: attention is tensor-parallel over heads.  ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are
  split along their output (head-major, so by heads), ``o_proj`` along its input (by heads): each tensor
  rank computes its heads end to end and ``o_proj`` ends in an all-reduce XLA inserts.  ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and the norms are replicated, so the latent cache row of a token is computed (and
  stored) by every tensor rank: the latent cache is replicated per tensor rank, as vLLM does.  The dense
  MLPs and the shared experts are split Megatron-style (gate / up by columns, down by rows).
* ``data``: DP attention (DeepSeek's / SGLang's layout).  Each data rank serves its own requests: the
  cache's page axis is split over ``data`` (each rank holds its own pages of every layer, :func:`cache_spec`),
  a request's pages all live on its rank and block tables / slots hold shard-local page ids
  (:class:`ShardedPages`, one allocator per rank); a batch's requests are in per-rank groups (decode: rows
  ``d * B/n ..``; prefill: per-rank slabs of packed rows), so attention and the cache writes run under
  ``shard_map`` over ``data`` on local data only.  The engine assigns its decode slots to ranks
  (:mod:`.engine`).  Weights other than the experts are replicated over ``data``; the dense layers and the
  MoE see the whole batch (the MoE all-gathers the tokens over ``data``, :mod:`.moe`).
* ``expert``: the routed experts are split over all three axes together (``E / (data * tensor * expert)``
  experts per device; :mod:`.moe` has the dispatch / combine).
* Embedding, lm_head / shared_head.head: split along the vocabulary over ``tensor``.

Everything is placed with ``NamedSharding`` at creation (:func:`param_sharding`, used by the loader and by
``DeepseekV3.random(mesh=...)``) and XLA's SPMD partitioner propagates the layouts through the jitted
steps; only the MLA custom calls (:mod:`tokenspeed_jax.sharding`) and the experts run under ``shard_map``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "tensor", "expert")
EXPERT_AXES = ("data", "tensor", "expert")


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=1,tensor=2,expert=4"`` -> ``{"data": 1, "tensor": 2, "expert": 4}`` (missing axes are 1)."""
    out = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise ValueError(
                f"mesh: expected 'axis=size' items separated by commas, got {part!r} in {spec!r}"
            )
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in AXES:
            raise ValueError(f"mesh: expected axes among {AXES}, got {k!r} in {spec!r}")
        if k in seen:
            raise ValueError(f"mesh: axis {k!r} given twice in {spec!r}")
        seen.add(k)
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"mesh: expected an integer size for {k!r}, got {v!r}") from None
        if n < 1:
            raise ValueError(f"mesh: expected a positive size for {k!r}, got {n}")
        out[k] = n
    return out


def make_mesh(shape: dict[str, int] | str, devices=None) -> Mesh:
    """A ``Mesh`` with axes (data, tensor, expert) over the first ``prod(shape)`` devices."""
    if isinstance(shape, str):
        shape = parse_mesh(shape)
    sizes = tuple(int(shape.get(a, 1)) for a in AXES)
    n = int(np.prod(sizes))
    devices = jax.devices() if devices is None else list(devices)
    if n > len(devices):
        raise ValueError(f"mesh: {dict(zip(AXES, sizes))} needs {n} devices, {len(devices)} are available")
    return Mesh(np.array(devices[:n]).reshape(sizes), AXES)


def check_mesh(config, mesh_shape) -> None:
    """Raise ``ValueError`` (``"mesh: ..."``) when the model cannot run on a mesh of this shape (a ``Mesh`` or
    a ``{axis: size}`` dict): ``tensor`` must divide the attention heads (attention is split by heads) and
    ``data x tensor x expert`` the routed experts (every device holds its own experts)."""
    shape = dict(getattr(mesh_shape, "shape", mesh_shape))
    t = int(shape.get("tensor", 1))
    if config.num_attention_heads % t:
        raise ValueError(
            f"mesh: tensor = {t} must divide num_attention_heads = {config.num_attention_heads} (attention "
            "is split by heads over tensor)"
        )
    n = int(np.prod([shape.get(a, 1) for a in EXPERT_AXES]))
    if config.n_routed_experts and config.n_routed_experts % n:
        raise ValueError(
            f"mesh: data x tensor x expert = {n} devices must divide n_routed_experts = "
            f"{config.n_routed_experts} (the routed experts are split over all {n} devices)"
        )


def param_spec(path: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of a parameter (module docstring); axes that do not divide stay replicated."""
    names = [str(x) for x in path]
    leaf = names[-1]
    nd = len(shape)
    spec: list = [None] * nd
    t = "tensor" if mesh.shape.get("tensor", 1) > 1 else None

    def put(axis, name):
        if name is None:
            return
        size = int(np.prod([mesh.shape[a] for a in (name if isinstance(name, tuple) else (name,))]))
        if shape[axis] % size == 0:
            spec[axis] = name

    if "experts" in names and leaf in (
        "gate_proj", "up_proj", "down_proj", "gate_proj_scale_inv", "up_proj_scale_inv", "down_proj_scale_inv"
    ):
        put(nd - 3, EXPERT_AXES)  # [(layers,) E, in, out]
        return P(*spec)
    owner = names[-2] if leaf in ("kernel", "kernel_scale_inv") else None
    if owner in ("q_b_proj", "q_proj", "kv_b_proj", "gate_proj", "up_proj"):
        put(nd - 1, t)  # output split (heads / intermediate)
    elif owner in ("o_proj", "down_proj"):
        put(nd - 2, t)  # input split
    elif owner in ("lm_head", "head"):
        put(nd - 1, t)  # vocabulary
    elif leaf == "embedding":
        put(nd - 2, t)
    return P(*spec)


def param_sharding(path: tuple, shape: tuple[int, ...], mesh: Mesh | None):
    """NamedSharding of a parameter on ``mesh``; the default device without a mesh."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, param_spec(path, shape, mesh))


def cache_spec(mesh: Mesh) -> P:
    """The cache ``[num_pages, num_layers, page_size, D]``: pages over ``data`` (replicated otherwise)."""
    return P("data" if mesh.shape.get("data", 1) > 1 else None)


def shard_model(model, mesh: Mesh):
    """Place every parameter of ``model`` with its NamedSharding (in place); returns ``model``."""
    from flax import nnx

    check_mesh(model.config, mesh)
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v.set_value(jax.device_put(v.get_value(), param_sharding(p, tuple(v.shape), mesh)))
    return model


def data_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape.get("data", 1))


class ShardedPages:
    """DP attention's page allocator: one :class:`~.cache.PageAllocator` of ``local_pages`` pages per data
    rank.  Rank ``d`` owns pages ``[d * local_pages, (d+1) * local_pages)`` of the cache (the cache's page
    axis split over ``data``, :func:`cache_spec`); a request is placed on one rank when it is first
    allocated and all its pages come from that rank.  Block tables and slots hold **shard-local** page ids
    in ``[0, local_pages)``: the layout of :func:`tokenspeed_jax.sharding.sharded_mla_decode` with
    ``cache_sharding="pages"`` and of ``concat_and_cache_mla`` run per rank.  With ``n = 1`` it is the
    ordinary allocator (rank 0, seed ``seed``).

    The engine decides the rank (the rank of the decode slot a request takes); ``shuffle`` hands out each
    rank's pages in a random order (seed ``seed + d``), as tests do to check placement does not matter.
    """

    def __init__(
        self, local_pages: int, page_size: int, n: int = 1, *, shuffle: bool = False, seed: int = 0
    ):
        from tokenspeed_jax.models.deepseek.cache import PageAllocator

        if not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"n: expected a positive number of data ranks, got {n!r}")
        if not isinstance(local_pages, int | np.integer) or local_pages < 1:
            raise ValueError(
                f"local_pages: expected a positive number of pages per data rank, got {local_pages!r}"
            )
        self.n = int(n)
        self.local_pages = int(local_pages)
        self.num_pages = self.n * self.local_pages
        self.page_size = page_size
        self.shards = [
            PageAllocator(self.local_pages, page_size, shuffle=shuffle, seed=seed + d) for d in range(self.n)
        ]
        self._rank: dict[int, int] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def free_pages(self, rank: int) -> int:
        """Pages rank ``rank`` can still hand out."""
        return len(self.shards[rank]._free)

    def rank(self, request: int) -> int:
        """The data rank holding ``request``'s pages."""
        if request not in self._rank:
            raise ValueError(f"request: {request} holds no pages (allocate it first)")
        return self._rank[request]

    def allocate(self, request: int, num_tokens: int, rank: int | None = None) -> list[int]:
        """Grow ``request``'s pages on its rank to hold ``num_tokens`` tokens (shard-local page ids).
        ``rank`` is required when the request is new (except with one rank) and must match afterwards."""
        have = self._rank.get(request)
        if rank is None:
            if have is None and self.n > 1:
                raise ValueError(f"rank: request {request} is new, expected its data rank in [0, {self.n})")
            rank = 0 if have is None else have
        if not 0 <= rank < self.n:
            raise ValueError(f"rank: expected a data rank in [0, {self.n}), got {rank}")
        if have is not None and have != rank:
            raise ValueError(f"rank: request {request} lives on data rank {have}, got {rank}")
        pages = self.shards[rank].allocate(request, num_tokens)
        self._rank[request] = rank
        return pages

    def free(self, request: int) -> None:
        rank = self._rank.pop(request, None)
        if rank is not None:
            self.shards[rank].free(request)

    def slots(self, request: int, positions) -> np.ndarray:
        """Shard-local cache slots ``page * page_size + row`` of ``request``'s token positions."""
        return self.shards[self.rank(request)].slots(request, positions)

    def block_table(self, requests: list, max_pages: int) -> np.ndarray:
        """int32 ``[len(requests), max_pages]`` of shard-local page ids; a ``None`` request (padding) and
        unused entries are 0 (never read: lengths bound reads)."""
        bt = np.zeros((len(requests), max_pages), np.int32)
        for i, r in enumerate(requests):
            if r is not None and r in self._rank:
                bt[i] = self.shards[self._rank[r]].block_table([r], max_pages)[0]
        return bt
