"""TOKENSPEED_MLA through the vLLM-style adapter vs a float64 per-request SDPA reference.

Structure of vLLM's tests/v1/attention/test_mla_backends.py: its batch specs (sequence lengths trimmed
for CPU, see ``utils.BATCH_SPECS``), DeepSeek-R1's 128 heads split over TP 1/4/8/16 (128/32/16/8 heads
per rank), KV-cache dtypes ``auto`` and ``fp8`` with ``(q_scale, k_scale)`` in ``{(1, 1), (2, 3)}``,
context written through ``do_kv_cache_update`` and its blocks randomly permuted, the new tokens written
by the layer call itself.  Tolerances: rtol 1e-2, atol 1e-2 (auto) / 1.5e-1 (fp8).

Trimmed for the 2-core CPU CI (each case is one XLA compile of ~2-8 s): every spec runs at 16 heads
(TP 8) with the auto cache; the other head splits run on ``mixed_small``; fp8 runs on one mixed, one
spec-decode spec (both scale pairs) and the chunked-context spec ((2, 3)).  The GPU module reuses ``check_case`` with the sm90 backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.vllm.utils import (
    BATCH_SPECS,
    BLOCK,
    CHUNKED_WORKSPACE,
    L,
    Layer,
    R,
    make_batch,
    reference,
    spec_tokens,
)
from tokenspeed_jax.vllm import mla_attention

TOL = {"auto": 1e-2, "fp8": 1.5e-1}


def check_case(rng, name: str, *, heads: int, kv_cache_dtype: str = "auto", scales=(1.0, 1.0),
               pad_tokens: int = 0, tokenspeed_backend: str = "xla"):
    q_scale, k_scale = scales
    b = make_batch(rng, BATCH_SPECS[name], heads=heads, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                   num_speculative_tokens=spec_tokens(name), workspace=CHUNKED_WORKSPACE.get(name),
                   pad_tokens=pad_tokens, tokenspeed_backend=tokenspeed_backend)
    T = b.q.shape[0]
    new_c = np.concatenate([b.new_kv_c, np.zeros((pad_tokens, L), b.new_kv_c.dtype)])
    new_pe = np.concatenate([b.new_k_pe, np.zeros((pad_tokens, R), b.new_k_pe.dtype)])

    @jax.jit
    def step(q, kv_c, k_pe, cache, md, qs, ks):
        return mla_attention(q, kv_c, k_pe, cache, md, impl=b.impl, layer=Layer(qs, ks))

    new_cache, out = step(jnp.asarray(b.q), jnp.asarray(new_c), jnp.asarray(new_pe), b.kv_cache, b.md,
                          jnp.float32(q_scale), jnp.float32(k_scale))
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref, _ = reference(b)
    n = ref.shape[0]
    assert out.shape == (T, heads, 128)
    assert not np.isnan(out).any()
    tol = TOL["fp8" if kv_cache_dtype != "auto" else "auto"]
    np.testing.assert_allclose(out[:n], ref, rtol=1e-2, atol=tol)
    np.testing.assert_array_equal(out[n:], 0.0)  # padding rows

    # The layer call wrote every new token at its slot (vLLM's concat_and_cache_mla layout).
    slots = np.asarray(b.md.mla.slot_mapping)
    assert (slots[n:] == -1).all()
    flat = np.asarray(new_cache.astype(jnp.float32)).reshape(-1, L + R)
    rows = flat[slots[:n]].astype(np.float64)
    want = np.concatenate([b.new_kv_c, b.new_k_pe], axis=1).astype(np.float64)
    if kv_cache_dtype == "auto":
        np.testing.assert_array_equal(rows, want)
    else:  # e4m3 of x / k_scale: relative rounding <= 2^-4 (plus the subnormal step)
        np.testing.assert_allclose(rows * k_scale, want, rtol=2**-4, atol=k_scale * 2**-9)
    # Nothing else changed: rows outside the new slots still hold the context / NaN.
    keep = np.ones(flat.shape[0], bool)
    keep[slots[:n]] = False
    before = np.asarray(b.kv_cache.astype(jnp.float32)).reshape(-1, L + R)
    np.testing.assert_array_equal(flat[keep], before[keep])
    assert b.md.mla.num_actual_tokens == T
    np.testing.assert_array_equal(np.asarray(b.md.request_distribution),
                                  [b.md.mla.num_decodes, b.md.mla.num_decodes, len(BATCH_SPECS[name].seq_lens)])
    return b


@pytest.mark.parametrize("name", list(BATCH_SPECS))
def test_backend_correctness(rng, name):
    check_case(rng, name, heads=16)


@pytest.mark.parametrize("heads", [128, 32, 8])  # TP 1 / 4 / 16 of 128 heads (16 = TP 8 runs above)
def test_tp_head_splits(rng, heads):
    check_case(rng, "mixed_small", heads=heads, pad_tokens=3)


@pytest.mark.parametrize(("name", "scales"), [
    ("mixed_small", (1.0, 1.0)), ("mixed_small", (2.0, 3.0)),
    ("spec_decode_small", (1.0, 1.0)), ("spec_decode_small", (2.0, 3.0)),
    ("chunked_context_prefill", (2.0, 3.0)),  # context dequantized with k_scale in every chunk
])
def test_fp8_kv_cache(rng, name, scales):
    check_case(rng, name, heads=16, kv_cache_dtype="fp8", scales=scales)


def test_chunked_context_uses_several_chunks(rng):
    b = make_batch(rng, BATCH_SPECS["chunked_context_prefill"], heads=8,
                   workspace=CHUNKED_WORKSPACE["chunked_context_prefill"])
    pre = b.md.mla.prefill
    assert len(pre.chunked_context) >= 2
    assert all(ch.seq_tot <= pre.workspace_size for ch in pre.chunked_context)
    assert BLOCK <= pre.workspace_size
