"""Lower the full DeepSeek-R1 config (FP8 weights, MTP), abstract weights (``nnx.eval_shape``: no memory),
on an 8-device mesh, for CUDA sm_90a on this CPU: prefill (with MTP), decode and MTP speculative decode.

Run as a script (the test runs it in a subprocess: CUTE_DSL_ARCH / TOKENSPEED_JAX_TARGET must be set before
cutlass is imported and XLA_FLAGS before jax initialises).  Prints ``RESULT {json}`` with the custom calls
of each step, the lowering times and the per-device bytes of the sharded parameter and cache arrays next
to the plan's."""

import json
import math
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config  # noqa: E402
from tokenspeed_jax.models.deepseek import engine as E  # noqa: E402
from tokenspeed_jax.models.deepseek.cache import KVCache  # noqa: E402
from tokenspeed_jax.models.deepseek.parallel import cache_spec, make_mesh, param_sharding  # noqa: E402
from tokenspeed_jax.models.deepseek.plan import plan, shard_shape  # noqa: E402


def main(spec="data=8", batch=16, context=4096, page_size=64, k=1):
    cfg = DeepseekV3Config.preset("deepseek-r1")
    mesh = make_mesh(spec)
    nd = mesh.shape["data"]
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    model.mesh = mesh
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    w_bytes = 0
    for p, v in flat:
        sh = param_sharding(p, tuple(v.shape), mesh)
        v.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh))
        w_bytes += math.prod(shard_shape(v.shape, sh.spec, dict(mesh.shape))) * np.dtype(v.dtype).itemsize
    state = nnx.from_flat_state(flat)
    pl = plan(cfg, dict(mesh.shape), batch=batch, context=context, num_speculative_tokens=k,
              page_size=page_size)
    pages = pl.num_pages * nd
    L = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    kv = jax.ShapeDtypeStruct((pages, L, page_size, cfg.kv_cache_dim), jnp.bfloat16,
                              sharding=NamedSharding(mesh, cache_spec(mesh)))
    cache = KVCache(kv=kv, k_scale=jax.ShapeDtypeStruct((), jnp.float32))
    kv_bytes = math.prod(shard_shape(kv.shape, cache_spec(mesh), dict(mesh.shape))) * 2
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    max_pages = -(-(context + 2 * k + 1) // page_size)
    bt = i32(batch, max_pages)
    res = {"mesh": dict(mesh.shape), "batch": batch, "context": context,
           "bytes_per_device": {"weights": int(w_bytes), "kv_cache": int(kv_bytes)},
           "plan_bytes_per_device": {"weights": pl.weight_bytes, "kv_cache": pl.kv_cache_bytes}}

    def lower(name, fn, *a, **kw):
        t = time.perf_counter()
        txt = fn.trace(*a, **kw).lower(lowering_platforms=("cuda",)).as_text()
        res[name] = {"seconds": round(time.perf_counter() - t, 1),
                     "custom_calls": sorted(set(re.findall(r"custom_call @(\w+)", txt)))}
        print(name, res[name], flush=True)

    Tl = 256  # prefill rows per data rank
    T = nd * Tl
    cu = i32(nd * (batch // nd + 1))
    lower("prefill", E._prefill_step, graphdef, state, cache, i32(T), i32(T), i32(T), cu, i32(T),
          jax.ShapeDtypeStruct((T,), jnp.bool_), i32(T), i32(batch), bt, i32(batch),
          jax.ShapeDtypeStruct((batch, 2), jnp.uint32), backend="auto", context_capacity=0, use_mtp=True,
          max_seqlen=Tl)
    lower("decode", E._decode_step, graphdef, state, cache, i32(batch, 1), i32(batch, 1), bt, backend="auto",
          page_size=page_size)
    # the MTP verify step: k drafts + the last token at k + 1 positions, one mla_decode call per layer with S = k + 1
    lower("mtp_decode", E._decode_step, graphdef, state, cache, i32(batch, k + 1), i32(batch, k + 1), bt,
          backend="auto", page_size=page_size)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["data=8"]))
