"""Fixtures of the model tests: one small random transformers DeepseekV3 per session, written to disk in
the published layout (plus a random DeepSeek-V3-layout MTP layer), and our model loaded from it."""

import os

import numpy as np
import pytest

from tests.models import hf_util


@pytest.fixture(scope="session")
def model_seed():
    seed = int(os.environ.get("TOKENSPEED_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
    print(f"model seed={seed}")
    return seed


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, model_seed):
    """``(hf_model, config dict, tensors, checkpoint dir)``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model, cfg = hf_util.make_hf_model(model_seed)
    tensors = hf_util.hf_state(model)
    tensors.update(hf_util.mtp_tensors(tensors, cfg, model_seed + 1))
    path = tmp_path_factory.mktemp("hf_ckpt")
    hf_util.write_checkpoint(path, tensors, cfg)
    return model, cfg, tensors, path


@pytest.fixture(scope="session")
def model(hf_checkpoint):
    import jax.numpy as jnp
    from tokenspeed_jax.models.deepseek import load_checkpoint

    return load_checkpoint(hf_checkpoint[3], dtype=jnp.float32, progress=False)


@pytest.fixture(scope="session")
def prompts(model_seed):
    rng = np.random.default_rng(model_seed + 2)
    return [rng.integers(0, 256, n).tolist() for n in (13, 5, 9)]


@pytest.fixture(scope="session")
def greedy_ref(model, prompts):
    """Plain greedy generations of the engine (xla backend), shared by several tests."""
    from tokenspeed_jax.models.deepseek import Engine

    return Engine(model, backend="xla", cache_fill=float("nan")).generate(prompts, 10).tokens
