"""GPU checks of the model (skipped without a CUDA GPU): the kernel backends (``backend="auto"``) agree
with the xla reference on logits, and MTP speculative decoding runs with S = k+1 through the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine
from tokenspeed_jax.models.deepseek.cli import attention_backends


@pytest.mark.gpu
def test_kernel_backends_match_xla_reference(rng):
    cfg = DeepseekV3Config.preset("small")
    model = DeepseekV3.random(cfg, dtype=jnp.bfloat16, seed=int(rng.integers(1 << 30)), std=0.05)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 33, 5)]
    cont = rng.integers(0, cfg.vocab_size, (3, 3))
    res = {}
    for backend in ("auto", "xla"):
        eng = Engine(model, backend=backend, page_size=64, cache_fill=float("nan"), prefill_chunk=32)
        eng.reset([100] * 3)
        last, _, _ = eng.prefill(prompts)
        pos = np.array([len(p) for p in prompts])[:, None] + np.arange(3)
        res[backend] = (np.asarray(last), np.asarray(eng.decode(cont, pos)))
        if backend == "auto":
            chosen = attention_backends(eng, 3, 70, 3)
            assert chosen["decode"].startswith("sm90") and chosen["prefill"].startswith("sm90"), chosen
    for a, b in zip(res["auto"], res["xla"]):
        assert np.all(np.isfinite(a))
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b)


@pytest.mark.gpu
def test_speculative_decode_runs_on_kernels(rng):
    cfg = DeepseekV3Config.preset("small")
    model = DeepseekV3.random(cfg, dtype=jnp.bfloat16, seed=int(rng.integers(1 << 30)))
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 17)]
    out = Engine(model, backend="auto", page_size=64).generate(prompts, 12, num_speculative_tokens=3, eos_token_id=[])
    assert [len(t) for t in out.tokens] == [12, 12]
    assert all(0 <= x < cfg.vocab_size for t in out.tokens for x in t)
    assert jax.default_backend() == "gpu"


@pytest.mark.gpu
def test_speculative_sampling_runs_on_kernels(rng):
    cfg = DeepseekV3Config.preset("small")
    model = DeepseekV3.random(cfg, dtype=jnp.bfloat16, seed=int(rng.integers(1 << 30)))
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 17, 5)]
    eng = Engine(model, backend="auto", page_size=64, max_slots=2)
    kw = {"num_speculative_tokens": 2, "eos_token_id": [], "temperature": 0.8, "top_p": 0.95, "seed": 3}
    out = eng.generate(prompts, [12, 7, 9], **kw)
    assert [len(t) for t in out.tokens] == [12, 7, 9]
    assert out.tokens == eng.generate(prompts, [12, 7, 9], **kw).tokens  # reproducible under a seed
