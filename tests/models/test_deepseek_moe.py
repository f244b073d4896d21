"""The FP8 experts' decode path (``Experts._gathered``: the routed pairs' expert weights gathered, then
dequantised) against the grouped-matmul path on the same pairs (CPU, float32)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.models.deepseek.config import DeepseekV3Config, QuantizationConfig
from tokenspeed_jax.models.deepseek.moe import Experts


@pytest.mark.parametrize("T", [1, 3])
def test_gathered_fp8_experts_equal_the_grouped_matmul(T):
    base = DeepseekV3Config.preset("tiny")
    cfg = dataclasses.replace(
        base, hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, n_group=2, topk_group=2,
        num_experts_per_tok=4, quantization_config=QuantizationConfig(weight_block_size=[128, 128]),
    )
    ex = Experts(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(T)
    for name in ("gate_proj", "up_proj", "down_proj"):
        p = getattr(ex, name)
        p.set_value(jnp.asarray(rng.standard_normal(p.shape) * 0.5, jnp.float8_e4m3fn))
        sc = getattr(ex, name + "_scale_inv")
        sc.set_value(jnp.asarray(rng.uniform(0.01, 0.05, sc.shape), jnp.float32))
    x = jnp.asarray(rng.standard_normal((T, 256)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(16, 4, replace=False) for _ in range(T)]), jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (T, 4)), jnp.float32)
    w, s = ex._params()
    assert T * 4 < 16  # the gathered path
    got = ex._local(x, wts, idx, w, s, 0)
    ref = Experts._local(_Grouped(ex), x, wts, idx, w, s, 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # under expert parallelism the same pairs split over two halves of the experts sum to the whole
    halves = sum(ex._local(x, wts, idx, [a[h * 8:(h + 1) * 8] for a in w], [b[h * 8:(h + 1) * 8] for b in s], h * 8)
                 for h in (0, 1))
    np.testing.assert_allclose(np.asarray(halves), np.asarray(ref), rtol=2e-5, atol=2e-5)


class _Grouped:
    """``ex`` with the gathered path off: :meth:`Experts._local` runs the grouped matmul."""

    def __init__(self, ex):
        self.fp8, self.fp8_block, self.dtype = False, ex.fp8_block, ex.dtype
        self._gathered = None
