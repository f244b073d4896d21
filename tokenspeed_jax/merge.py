"""``merge_attn_states``: exact combination of two partial attentions over disjoint key sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenspeed_jax import _checks as C


def merge_attn_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge two normalised partial attentions (prefill layout).

    ``out_* [T, H, D]`` are softmax-normalised outputs over two disjoint key sets and ``lse_* [T, H]``
    float32 their natural-log LSEs.  Returns ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} +
    e^{lse_b})`` in ``out_a``'s dtype (computed in fp32) and ``lse = log(e^{lse_a} + e^{lse_b})``.  A side
    with LSE ``-inf`` contributes nothing (its output is not read, so it may be NaN); both ``-inf`` gives 0
    and ``-inf``.  A NaN LSE on either side (a row that saw a NaN score) gives NaN output and a NaN LSE, so a
    NaN survives any chain of merges (a ``-inf`` there would mark the row as seeing no key, and the next
    merge would drop it).
    """
    for x, n in ((out_a, "out_a"), (lse_a, "lse_a"), (out_b, "out_b"), (lse_b, "lse_b")):
        C.array(x, n)
    C.rank(out_a, "out_a", 3, "[T, H, D]")
    C.rank(lse_a, "lse_a", 2, "[T, H]")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: expected the shape of out_a {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
    for lse, n in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        if lse.shape != out_a.shape[:2]:
            raise ValueError(f"{n}: expected shape [T, H] = {tuple(out_a.shape[:2])}, got {tuple(lse.shape)}")
        if jnp.dtype(lse.dtype) != jnp.float32:
            raise TypeError(f"{n}: expected dtype float32, got {jnp.dtype(lse.dtype).name}")
    C.float_dtype(out_a, "out_a")
    C.same_dtype(out_a, "out_a", out_b, "out_b")
    with jax.named_scope("tokenspeed_merge_attn_states"):
        m = jnp.maximum(lse_a, lse_b)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        wa = jnp.exp(lse_a - m_safe)  # exactly 0 where lse_a == -inf
        wb = jnp.exp(lse_b - m_safe)
        total = wa + wb
        inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
        fa = (wa * inv)[..., None]
        fb = (wb * inv)[..., None]
        oa = jnp.where(fa > 0, out_a.astype(jnp.float32), 0.0)
        ob = jnp.where(fb > 0, out_b.astype(jnp.float32), 0.0)
        out = (oa * fa + ob * fb).astype(out_a.dtype)
        dead = jnp.where(jnp.isnan(total), jnp.nan, -jnp.inf)  # NaN total: an input LSE is NaN
        lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), dead)
    return out, lse.astype(jnp.float32)
