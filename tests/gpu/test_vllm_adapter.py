"""The vLLM-adapter correctness cases of tests/vllm on a GPU, through a named kernel backend.

Each case first asks the adapter whether the backend can run it (the real ``supports``) and skips with
that reason otherwise, so the module tracks whatever the sm90 kernels support.
"""

from __future__ import annotations

import pytest

from tests.vllm.test_mla_backends import check_case
from tests.vllm.utils import BATCH_SPECS, BLOCK, L, R, spec_tokens
from tokenspeed_jax.vllm.backend import decode_problem, prefill_problem, resolve_kernel_backend, target_for
from tokenspeed_jax.vllm.config import MLAModelConfig

pytestmark = pytest.mark.gpu

CASES = [(n, "auto", (1.0, 1.0)) for n in BATCH_SPECS] + [
    ("mixed_small", "fp8", (2.0, 3.0)), ("spec_decode_small", "fp8", (1.0, 1.0)),
    ("spec_decode_small", "fp8", (2.0, 3.0)), ("chunked_context_prefill", "fp8", (2.0, 3.0)),
]


@pytest.mark.parametrize("backend", ["sm90"])
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize(("name", "kv", "scales"), CASES)
def test_backend_correctness_gpu(rng, backend, heads, name, kv, scales):
    cfg = MLAModelConfig(num_attention_heads=heads, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=128,
                         v_head_dim=128, num_speculative_tokens=spec_tokens(name))
    tgt = target_for(None)
    dt = "float8_e4m3fn" if kv == "fp8" else "bfloat16"
    for op, p in (("decode", decode_problem(cfg, dtype=dt, page_size=BLOCK, target=tgt,
                                            q_len=max(1, spec_tokens(name) + 1))),
                  ("prefill", prefill_problem(cfg, dtype="bfloat16", target=tgt))):
        _, why = resolve_kernel_backend(op, p, backend)
        if why is not None:
            pytest.skip(why)
    check_case(rng, name, heads=heads, kv_cache_dtype=kv, scales=scales, tokenspeed_backend=backend)
