"""The FP8 ``Linear``'s two matmul forms (``models/deepseek/layers.py``): the block-partial product of decode-sized
calls equals dequantise-then-multiply within float32 rounding (float32) or bf16 rounding (bf16), for full, partial
and oversized blocks, and the form is chosen by the call's row count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.models.deepseek.layers import (
    FP8,
    KBLOCK_MAX_ROWS,
    Linear,
    dequantize,
    fp8_block_matmul,
    fp8_scale_shape,
)


def _weights(rng, din, dout, block):
    w = jnp.asarray(rng.standard_normal((din, dout)) * 0.5, jnp.float32).astype(FP8)
    s = jnp.asarray(np.exp(rng.standard_normal(fp8_scale_shape(din, dout, block))), jnp.float32)
    return w, s


@pytest.mark.parametrize("din, dout, block", [(256, 384, (128, 128)), (96, 40, (32, 64)), (200, 72, (128, 128)),
                                              (64, 64, (128, 128))])
@pytest.mark.parametrize("lead", [(1,), (3, 5), (2, 1, 4)])
def test_block_partials_equal_dequantised_product_float32(din, dout, block, lead):
    rng = np.random.default_rng(din * 7 + dout + len(lead))
    w, s = _weights(rng, din, dout, block)
    x = jnp.asarray(rng.standard_normal(lead + (din,)), jnp.float32)
    got = fp8_block_matmul(x, w, s, jnp.float32, block)
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(w, s, jnp.float32, block), np.float64)
    assert got.shape == lead + (dout,) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_block_partials_bf16_within_bf16_rounding():
    rng = np.random.default_rng(3)
    w, s = _weights(rng, 512, 256, (128, 128))
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    got = np.asarray(fp8_block_matmul(x, w, s, jnp.bfloat16), np.float64)
    exact = np.asarray(x, np.float64) @ (np.asarray(w, np.float64) * np.repeat(np.repeat(np.asarray(s), 128, 0), 128, 1))
    # one bf16 rounding of the result (2^-8 relative) plus float32 accumulation
    np.testing.assert_allclose(got, exact, rtol=2 ** -8, atol=1e-5 * np.abs(exact).max())


def test_linear_chooses_the_form_by_rows():
    lin = Linear(256, 128, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), fp8_block=(128, 128))
    rng = np.random.default_rng(5)
    lin.kernel[...], lin.kernel_scale_inv[...] = _weights(rng, 256, 128, (128, 128))

    def dots(rows):  # products in the traced call, nested ones (the platform branches) included
        return str(jax.make_jaxpr(lambda x: lin(x))(jnp.zeros((rows, 256), jnp.float32))).count("dot_general[")

    # the block-partial form: the blocks' products (one per platform branch), then the scaled sum
    assert dots(KBLOCK_MAX_ROWS) == 3 and dots(1) == 3
    assert dots(KBLOCK_MAX_ROWS + 1) == 1  # dequantise, then one product
    for rows in (1, KBLOCK_MAX_ROWS, KBLOCK_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
        ref = np.asarray(x, np.float64) @ np.asarray(lin.weight(), np.float64)
        np.testing.assert_allclose(np.asarray(lin(x)), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
