"""Token sampling: temperature / top-k / top-p filtering, per-request keys, and the rejection-sampling
acceptance rule of speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

Everything here is a pure jnp function of static :class:`SamplingParams`, traced inside the engine's
jitted steps.

* **Filtering order** (as transformers' logits processors): divide by ``temperature``, keep the
  ``top_k`` largest logits (ties at the k-th value are kept), then keep the smallest set of most likely
  tokens whose probability reaches ``top_p`` (the most likely token is always kept).  ``temperature = 0``
  is greedy (argmax, no key used).
* **Keys are per request and per position**: the token at position ``p + 1`` sampled from the logits at
  position ``p`` uses ``fold_in(fold_in(request_key, p), tag)``, with ``request_key =
  fold_in(PRNGKey(seed), request_index)``.  A request's sampled tokens therefore do not depend on which
  other requests share its batch, its slot, or when it was admitted.
* **Speculative sampling**: draft ``d_j`` drawn from the draft distribution ``q_j`` is accepted with
  probability ``min(1, p_j(d_j) / q_j(d_j))`` where ``p_j`` is the target distribution at that position
  (both after the same filtering); at the first rejection the token is drawn from
  ``normalise(max(p_j - q_j, 0))``; when all ``k`` drafts are accepted a bonus token is drawn from
  ``p_{k+1}``.  The emitted tokens are distributed exactly as plain sampling from ``p``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Tags folded into a (request, position) key: one independent stream per use.
TAG_SAMPLE = 0  # plain sampling of the next token
TAG_DRAFT = 16  # + j: draft j of a speculative round
TAG_ACCEPT = 32  # + j: acceptance uniform of draft j
TAG_RESIDUAL = 48  # residual / bonus token of a speculative round


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling configuration (part of the jit key: each distinct value compiles once).

    Args:
      temperature: ``0`` greedy; otherwise logits are divided by it (negative or non-finite: ``ValueError``).
      top_k: keep the k most likely tokens (``None`` or 0: all).
      top_p: nucleus filtering with this cumulative probability (``None`` or 1.0: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0):
            raise ValueError(f"top_k: expected None or an int >= 0, got {k!r}")
        if k is not None:
            object.__setattr__(self, "top_k", int(k))  # a NumPy int hashes as the same jit key
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: expected None or a number in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled float32 logits ``[..., V]`` with filtered-out tokens set to ``-inf``."""
    x = logits.astype(jnp.float32) / jnp.float32(params.temperature if params.temperature > 0 else 1.0)
    V = x.shape[-1]
    if params.top_k and params.top_k < V:
        kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if params.top_p is not None and params.top_p < 1.0:
        s = jnp.sort(x, axis=-1)[..., ::-1]  # descending
        ps = jax.nn.softmax(s, axis=-1)
        before = jnp.cumsum(ps, axis=-1) - ps  # probability of the strictly more likely tokens
        keep = before < params.top_p
        keep = keep.at[..., 0].set(True)
        thresh = jnp.min(jnp.where(keep, s, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < thresh, -jnp.inf, x)
    return x


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The sampling distribution ``[..., V]`` (float32) of ``logits`` under ``params`` (one-hot argmax
    when greedy)."""
    if params.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filter_logits(logits, params), axis=-1)


def request_keys(seed: int, request_ids: jax.Array) -> jax.Array:
    """Raw ``uint32 [B, 2]`` keys of the given request indices under ``seed``."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.asarray(request_ids, jnp.uint32))


def position_keys(keys: jax.Array, pos: jax.Array, tag: int | jax.Array) -> jax.Array:
    """Per-row keys ``[B, 2]`` for ``(request key [B, 2], position [B], tag)``."""
    tag = jnp.broadcast_to(jnp.asarray(tag, jnp.uint32), pos.shape)
    return jax.vmap(lambda k, p, t: jax.random.fold_in(jax.random.fold_in(k, p), t))(
        keys, pos.astype(jnp.uint32), tag
    )


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams) -> jax.Array:
    """One token per row of ``logits [B, V]`` with per-row ``keys [B, 2]`` -> int32 ``[B]``."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filter_logits(logits, params)
    return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, x).astype(jnp.int32)


def sample_from_probs(p: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row of a distribution ``p [B, V]`` (rows need not be normalised)."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, logp).astype(jnp.int32)


def speculative_accept(
    drafts: jax.Array,
    q: jax.Array,
    p: jax.Array,
    u: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of one speculative round.

    Args:
      drafts: int32 ``[B, k]`` draft tokens, ``drafts[:, j]`` drawn from ``q[:, j]``.
      q: ``[B, k, V]`` draft distributions.
      p: ``[B, k + 1, V]`` target distributions at the k draft positions and the bonus position.
      u: ``[B, k]`` uniforms in ``[0, 1)`` (acceptance tests).
      keys: ``[B, 2]`` keys of the residual / bonus draw.

    Returns:
      ``(a [B], tokens [B, k + 1])``: ``a`` accepted drafts; ``tokens[:, :a]`` are the accepted drafts and
      ``tokens[:, a]`` the residual (or bonus) token; entries past ``a`` are unspecified.
    """
    B, k = drafts.shape
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    acc = u * qd < pd  # u < p/q without dividing (q(d) > 0: d was drawn from q)
    a = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(B)
    p_a = p[rows, a]
    q_a = jnp.where((a < k)[:, None], q[rows, jnp.minimum(a, k - 1)], 0.0)
    res = jnp.maximum(p_a - q_a, 0.0)
    # p == q at the rejected row cannot reject (u < 1); the fallback only guards rounding.
    res = jnp.where(jnp.sum(res, axis=-1, keepdims=True) > 0, res, p_a)
    t = sample_from_probs(res, keys)
    ar = jnp.arange(k + 1)
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    return a.astype(jnp.int32), jnp.where(ar[None] < a[:, None], padded, t[:, None])
