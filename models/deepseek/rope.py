"""YaRN rotary position embedding with DeepSeek's interleaved pair layout.

Frequencies follow transformers' ``_compute_yarn_parameters`` (itself DeepSeek-V3's reference): the
correction range is ``floor/ceil`` of the YaRN dims for ``beta_fast``/``beta_slow`` (unrounded with
``truncate: false``), inverse frequencies blend interpolation (``/ factor``) and extrapolation with a linear
ramp, and cos/sin are multiplied by the attention factor: ``attention_factor`` when the config gives it,
else ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`` when both are set (1.0
for R1), else ``yarn_get_mscale(factor)``.

Layout (documented decision): with ``rope_interleave`` the rotary dims are pairs ``(x0, x1), (x2, x3), ...``
and the rotated output is written de-interleaved, ``[even' | odd']``, exactly as transformers'
``apply_rotary_pos_emb_interleave``.  The same permutation is applied to q and k, so scores equal those
of DeepSeek's complex-number formulation; the latent cache stores ``k_pe`` in this output layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config, yarn_get_mscale


def rope_frequencies(config: DeepseekV3Config) -> tuple[np.ndarray, float]:
    """``(inv_freq [rope_dim / 2] float32, attention_factor)`` for the config's RoPE."""
    dim = config.qk_rope_head_dim
    base = float(config.rope_theta)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_extra, 1.0
    factor = float(rs.factor)
    if rs.attention_factor is not None:
        attention_factor = float(rs.attention_factor)
    elif rs.mscale and rs.mscale_all_dim:
        attention_factor = float(
            yarn_get_mscale(factor, rs.mscale) / yarn_get_mscale(factor, rs.mscale_all_dim)
        )
    else:
        attention_factor = yarn_get_mscale(factor)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)

    def correction_dim(num_rot):
        return (dim * math.log(rs.original_max_position_embeddings / (num_rot * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rs.beta_fast or 32), correction_dim(rs.beta_slow or 1)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra_factor = np.float32(1) - ramp
    inv = inv_inter * (np.float32(1) - extra_factor) + inv_extra * extra_factor
    return inv.astype(np.float32), attention_factor


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float):
    """``cos, sin [..., rope_dim / 2]`` float32 for integer ``positions [...]``."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(ang) * attention_factor, jnp.sin(ang) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleave: bool = True) -> jax.Array:
    """Rotate ``x [T, ..., R]`` by ``cos/sin [T, R/2]`` (broadcast over middle axes); output layout in the
    module docstring.  Computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    extra = x.ndim - cos.ndim
    shape = cos.shape[:-1] + (1,) * extra + cos.shape[-1:]
    c, s = cos.reshape(shape), sin.reshape(shape)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
