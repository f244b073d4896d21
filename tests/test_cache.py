"""concat_and_cache_mla and mla_kv_pack_quantize_fp8 against the NumPy reference: exact (bitwise)
results, slot -1 / out-of-cache slots write nothing, poisoned rows stay untouched, FP8 saturation and
rounding, buffer donation under jit (the cache is updated in place, the donated buffer is deleted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tokenspeed_jax as tj
from tests import reference as ref


def bits(x) -> np.ndarray:
    """Bit pattern view, so NaN == NaN and -0 != +0 in comparisons."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def random_slots(rng, T, P, ps):
    slots = rng.choice(P * ps, size=T, replace=False).astype(np.int32)
    slots[rng.random(T) < 0.25] = -1  # vLLM padding
    slots[0] = -1
    slots[-1] = P * ps + 3  # past the cache: also dropped
    return slots


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("kpe_3d", [False, True])
def test_concat_and_cache(rng, dtype, kpe_3d):
    T, L, R, P, ps = 23, 32, 16, 3, 16
    kv_c = ref.cast(rng.standard_normal((T, L)), dtype)
    k_pe = ref.cast(rng.standard_normal((T, 1, R) if kpe_3d else (T, R)), dtype)
    cache = ref.cast(np.full((P, ps, L + R), np.nan), dtype)  # poison: untouched rows must stay NaN
    slots = random_slots(rng, T, P, ps)
    new = jax.jit(tj.concat_and_cache_mla)(kv_c, k_pe, cache, slots)
    want = ref.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    assert new.shape == cache.shape and new.dtype == cache.dtype
    np.testing.assert_array_equal(bits(new), bits(want))
    written = (slots >= 0) & (slots < P * ps)
    assert int((~np.isnan(np.asarray(new, np.float32)[..., 0])).sum()) == int(written.sum())


def test_concat_and_cache_eager_numpy(rng):
    """Outside jit with plain NumPy operands (regression: a NumPy cache has no ``.at``)."""
    kv_c = rng.standard_normal((3, 16)).astype(np.float32)
    k_pe = rng.standard_normal((3, 8)).astype(np.float32)
    cache = np.zeros((2, 16, 24), np.float32)
    slots = np.array([4, -1, 31], np.int32)
    new = tj.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    np.testing.assert_array_equal(np.asarray(new), ref.concat_and_cache_mla(kv_c, k_pe, cache, slots))


def test_concat_and_cache_fp8_scale_and_saturation(rng):
    T, L, R, P, ps = 20, 32, 16, 2, 16
    scale = 0.37
    kv_c = (rng.standard_normal((T, L)) * 60).astype(np.float32)
    k_pe = (rng.standard_normal((T, R)) * 60).astype(np.float32)
    kv_c[1, :4] = [1e6, -1e6, np.inf, -np.inf]  # beyond e4m3 after scaling: saturate to +-448
    kv_c[2, 0] = np.nan  # NaN stays NaN
    kv_c[3, :2] = [448 * scale, 449 * scale]
    cache = ref.e4m3(np.zeros((P, ps, L + R)))
    slots = np.arange(T, dtype=np.int32)
    slots[5] = -1
    f = jax.jit(lambda a, b, c, s, sc: tj.concat_and_cache_mla(a, b, c, s, scale=sc))
    new = f(kv_c, k_pe, cache, slots, jnp.float32(scale))
    assert new.dtype == jnp.float8_e4m3fn
    want = ref.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale=scale)
    np.testing.assert_array_equal(bits(new), bits(want))
    row = ref.f64(new[0, 1])
    np.testing.assert_array_equal(row[:4], [448, -448, 448, -448])
    assert np.isnan(ref.f64(new[0, 2, 0]))
    np.testing.assert_array_equal(ref.f64(new[0, 3, :2]), [448, 448])
    assert (bits(new[0, 5]) == 0).all()  # slot -1: row 5 untouched (still zeros)
    # a second scale value runs through the same executable and scales the stored values
    new2 = f(kv_c, k_pe, cache, slots, jnp.float32(2 * scale))
    np.testing.assert_array_equal(bits(new2), bits(ref.concat_and_cache_mla(kv_c, k_pe, cache, slots,
                                                                             scale=np.float32(2 * scale))))


def test_concat_and_cache_donation_updates_in_place(rng):
    T, L, R, P, ps = 7, 32, 16, 4, 16
    f = jax.jit(tj.concat_and_cache_mla, donate_argnums=2)
    kv_c = ref.cast(rng.standard_normal((T, L)), "bfloat16")
    k_pe = ref.cast(rng.standard_normal((T, R)), "bfloat16")
    host = ref.cast(rng.standard_normal((P, ps, L + R)), "bfloat16")
    cache = jnp.asarray(host)
    ptr = cache.unsafe_buffer_pointer()
    slots = random_slots(rng, T, P, ps)
    new = f(kv_c, k_pe, cache, slots)
    assert cache.is_deleted(), "the donated cache buffer must be consumed"
    assert new.unsafe_buffer_pointer() == ptr, "XLA must write into the donated buffer (in place)"
    np.testing.assert_array_equal(bits(new), bits(ref.concat_and_cache_mla(kv_c, k_pe, host, slots)))
    lowered = f.lower(kv_c, k_pe, jnp.asarray(host), slots).as_text()
    assert "tf.aliasing_output = 0" in lowered  # the cache operand aliases the result


@pytest.mark.parametrize("kpe_shape", ["2d", "3d1", "3dH"])
def test_kv_pack_quantize_fp8(rng, kpe_shape):
    T, H, Dn, Dr, Dv = 9, 4, 32, 16, 24
    k_nope = ref.cast(rng.standard_normal((T, H, Dn)) * 40, "bfloat16")
    shape = {"2d": (T, Dr), "3d1": (T, 1, Dr), "3dH": (T, H, Dr)}[kpe_shape]
    k_pe = ref.cast(rng.standard_normal(shape) * 40, "bfloat16")
    v = ref.cast(rng.standard_normal((T, H, Dv)) * 40, "bfloat16")
    ks, vs = 0.11, 0.07
    k8, v8 = jax.jit(lambda a, b, c, x, y: tj.mla_kv_pack_quantize_fp8(a, b, c, k_scale=x, v_scale=y))(
        k_nope, k_pe, v, jnp.float32(ks), jnp.float32(vs))
    assert k8.shape == (T, H, Dn + Dr) and v8.shape == (T, H, Dv)
    assert k8.dtype == jnp.float8_e4m3fn and v8.dtype == jnp.float8_e4m3fn
    rk, rv = ref.mla_kv_pack_quantize_fp8(k_nope, k_pe, v, k_scale=np.float32(ks), v_scale=np.float32(vs))
    np.testing.assert_array_equal(bits(k8), bits(rk))
    np.testing.assert_array_equal(bits(v8), bits(rv))
    # every head got the same (shared) rope part when k_pe is shared
    if kpe_shape != "3dH":
        assert (bits(k8)[:, :, Dn:] == bits(k8)[:, :1, Dn:]).all()


def test_kv_pack_quantize_fp8_overflow_and_rounding():
    """The documented overflow behaviour: |x / scale| > 448 (inf included) saturates to +-448, never NaN;
    NaN stays NaN; values round to nearest with ties to even; tiny values flush through subnormals to 0."""
    vals = np.array([448, 449, 464, 480, 1e9, np.inf, -500, -np.inf, np.nan,
                     1.0625, 1.1875, 2.0**-9, 2.0**-10, 2.0**-11, -0.0, 0.0], np.float32)
    want = np.array([448, 448, 448, 448, 448, 448, -448, -448, np.nan,
                     1.0, 1.25, 2.0**-9, 0.0, 0.0, -0.0, 0.0])
    k_nope = vals[:, None, None]
    k_pe = np.zeros((len(vals), 1), np.float32)
    v = vals[:, None, None] * 2  # v_scale 2 gives the same quotients
    k8, v8 = tj.mla_kv_pack_quantize_fp8(k_nope, k_pe, v, k_scale=1.0, v_scale=2.0)
    for got in (ref.f64(k8)[:, 0, 0], ref.f64(v8)[:, 0, 0]):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    # a bare cast would give NaN for these (why saturation is explicit)
    assert np.isnan(np.float32(1e9).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_kv_pack_dequant_error_bound(rng):
    """Dequantised values are within half an e4m3 ulp (2^-4 relative) of the input for normal values."""
    x = (rng.standard_normal((64, 2, 16)) * 100).astype(np.float32)
    scale = 0.5
    k8, v8 = tj.mla_kv_pack_quantize_fp8(x, np.zeros((64, 1), np.float32), x, k_scale=scale, v_scale=scale)
    deq = ref.f64(v8) * scale
    normal = np.abs(x / scale) >= 2.0**-6
    normal &= np.abs(x / scale) <= 448
    err = np.abs(deq - x)[normal] / np.abs(x)[normal]
    assert err.max() <= 2.0**-4 + 1e-12
