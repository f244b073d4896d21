"""Test configuration shared by every test module.

* 8 virtual CPU devices (``--xla_force_host_platform_device_count=8``) so sharding tests can build meshes;
  set before jax initialises its backends.
* ``gpu``-marked tests are skipped unless JAX sees a CUDA GPU.
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def is_sm90() -> bool:
    """Whether JAX's first device is an sm_90 (Hopper) GPU."""
    return HAS_GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def needs_sm90_prefill():
    """Skip marker: the optional package the sm90 prefill backend (FlashAttention-4's forward) lacks here, named as
    ``mla_prefill(backend="sm90")`` names it when it refuses."""
    from tokenspeed_jax.backends.sm90_prefill import _missing_packages

    missing = _missing_packages()
    return pytest.mark.skipif(missing is not None, reason=f"the sm90 prefill backend needs {missing} (not installed)")


@pytest.fixture(scope="module")
def sm90_arch():
    """Skip the module's tests unless on an sm_90 GPU; CuTe DSL compiles for ``sm_90a`` there."""
    if not is_sm90():
        pytest.skip("needs an sm_90 GPU")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh, logged seed per test: inputs differ every run, a failure prints the seed to replay."""
    seed = int(os.environ.get("TOKENSPEED_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
