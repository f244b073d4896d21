"""Cache writes and FP8 packing for MLA.

FP8 quantisation convention (used by every op here and by the FP8 attention paths): a value ``x`` is
stored as ``e4m3(clip(x / scale, -448, 448))``: values beyond the e4m3 range saturate to +-448 (never
NaN, which is what a bare cast to float8_e4m3fn gives), NaN stays NaN, and rounding is to nearest even.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenspeed_jax import _checks as C
from tokenspeed_jax.problems import FP8_DTYPE

E4M3_MAX = 448.0


def quantize_e4m3(x: jax.Array, scale) -> jax.Array:
    """``e4m3(clip(x / scale, -448, 448))`` computed in fp32 (the module's FP8 convention)."""
    y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def concat_and_cache_mla(
    kv_c: jax.Array,
    k_pe: jax.Array,
    kv_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    scale: float | jax.Array | None = None,
) -> jax.Array:
    """Write ``[kv_c | k_pe]`` of each token into the paged latent cache and return the new cache.

    Args:
      kv_c: ``[T, kv_lora_rank]`` normalised latent.  k_pe: ``[T, rope_dim]`` (or ``[T, 1, rope_dim]``).
      kv_cache: ``[num_pages, page_size, kv_lora_rank + rope_dim]`` (row layout: see
        :mod:`tokenspeed_jax.decode`).
      slot_mapping: int ``[T]``; token t goes to page ``slot // page_size``, row ``slot % page_size``.
        A negative slot (vLLM's -1 padding) writes nothing; a slot past the cache writes nothing, whatever
        the integer dtype (uint32 / int64 values are compared in their own dtype, never wrapped).
      scale: required for a float8_e4m3fn cache (stores ``x / scale`` saturated, see module docstring);
        must be None for other caches.  May be a traced float32 scalar.

    Donate ``kv_cache`` under jit (``donate_argnums``) and the update happens in place.
    """
    for x, n in ((kv_c, "kv_c"), (k_pe, "k_pe"), (kv_cache, "kv_cache"), (slot_mapping, "slot_mapping")):
        C.array(x, n)
    if k_pe.ndim == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    C.rank(kv_c, "kv_c", 2, "[T, kv_lora_rank]")
    C.rank(k_pe, "k_pe", 2, "[T, rope_dim]")
    C.rank(kv_cache, "kv_cache", 3, "[num_pages, page_size, D]")
    C.rank(slot_mapping, "slot_mapping", 1, "[T]")
    C.int_dtype(slot_mapping, "slot_mapping")
    T = kv_c.shape[0]
    C.dim("k_pe", "tokens (axis 0) equal to kv_c's T", k_pe.shape[0], T)
    C.dim("slot_mapping", "length equal to kv_c's T", slot_mapping.shape[0], T)
    P, ps, D = kv_cache.shape
    C.dim("kv_cache", "row width (axis 2) = kv_lora_rank + rope_dim", D, kv_c.shape[1] + k_pe.shape[1])
    C.float_dtype(kv_cache, "kv_cache")
    is_fp8 = jnp.dtype(kv_cache.dtype).name == FP8_DTYPE
    if is_fp8 and scale is None:
        raise ValueError("scale: expected a float32 scale for a float8_e4m3fn kv_cache, got None")
    if not is_fp8 and scale is not None:
        raise ValueError(f"scale: expected None for a {jnp.dtype(kv_cache.dtype).name} kv_cache, got {scale!r}")
    with jax.named_scope("tokenspeed_concat_and_cache_mla"):
        rows = jnp.concatenate([kv_c.astype(jnp.float32), k_pe.astype(jnp.float32)], axis=-1)
        if is_fp8:
            rows = quantize_e4m3(rows, C.f32_scalar(scale, "scale"))
        else:
            rows = rows.astype(kv_cache.dtype)
        # Clamped to [-1, P * ps] in the slots' own dtype first (an int32 cast would wrap an int64 slot past
        # the cache, 2**32 + r, onto slot r); negative slots then map past the end and are dropped, like
        # slots beyond the cache.
        slots = C.clamp_index(slot_mapping, -1, P * ps)
        slots = jnp.where(slots < 0, P * ps, slots)
        flat = jnp.asarray(kv_cache).reshape(P * ps, D)  # asarray: a NumPy cache has no .at
        flat = flat.at[slots].set(rows, mode="drop", unique_indices=False)
        return flat.reshape(P, ps, D)


def mla_kv_pack_quantize_fp8(
    k_nope: jax.Array,
    k_pe: jax.Array,
    v: jax.Array,
    *,
    k_scale: float | jax.Array,
    v_scale: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Pack prefill K and quantize K and V to float8_e4m3fn.

    Args:
      k_nope: ``[T, H, Dn]``; k_pe: ``[T, Dr]`` or ``[T, 1, Dr]`` (shared by all heads); v: ``[T, H, Dv]``.
      k_scale, v_scale: runtime float32 scalars.

    Returns:
      ``k = e4m3(concat(k_nope, broadcast(k_pe)) / k_scale)`` ``[T, H, Dn + Dr]`` and
      ``v = e4m3(v / v_scale)`` ``[T, H, Dv]``, saturating at +-448 (see the module docstring).
    """
    for x, n in ((k_nope, "k_nope"), (k_pe, "k_pe"), (v, "v")):
        C.array(x, n)
    C.rank(k_nope, "k_nope", 3, "[T, H, Dn]")
    if k_pe.ndim == 2:
        k_pe = k_pe[:, None, :]
    C.rank(k_pe, "k_pe", 3, "[T, 1, Dr]")
    C.rank(v, "v", 3, "[T, H, Dv]")
    T, H, _ = k_nope.shape
    C.dim("k_pe", "tokens (axis 0) equal to k_nope's T", k_pe.shape[0], T)
    if k_pe.shape[1] not in (1, H):
        raise ValueError(f"k_pe: expected 1 or H = {H} heads (axis 1), got {k_pe.shape[1]}")
    C.dim("v", "tokens (axis 0) equal to k_nope's T", v.shape[0], T)
    C.dim("v", "heads (axis 1) equal to k_nope's H", v.shape[1], H)
    ks = C.f32_scalar(k_scale, "k_scale")
    vs = C.f32_scalar(v_scale, "v_scale")
    with jax.named_scope("tokenspeed_mla_kv_pack_quantize_fp8"):
        pe = jnp.broadcast_to(k_pe, (T, H, k_pe.shape[2])).astype(jnp.float32)
        k = jnp.concatenate([k_nope.astype(jnp.float32), pe], axis=-1)
        return quantize_e4m3(k, ks), quantize_e4m3(v, vs)
