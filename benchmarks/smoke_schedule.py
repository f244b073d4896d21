"""Quick GPU smoke test of the scheduled decode kernels: one small varied-length batch per kernel config."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import tokenspeed_jax as tj

CASES = [("bfloat16", 1, 16, 64), ("bfloat16", 1, 128, 64), ("bfloat16", 2, 16, 16), ("float8_e4m3fn", 1, 32, 64),
         ("float8_e4m3fn", 4, 32, 64), ("float8_e4m3fn", 1, 16, 16)]
rng = np.random.default_rng(0)
bad = 0
for dt, S, H, page in CASES:
    t = time.time()
    B, max_pages = 6, 96
    lens = np.array([0, 1, 300, 64 * 90 + 5, 70, 2 * S], np.int32)
    q = jnp.asarray(rng.standard_normal((B, S, H, 576)), jnp.float32).astype(dt)
    kvf = rng.standard_normal((B * max_pages + 4, page, 576)).astype(np.float32)
    bt = rng.permutation(B * max_pages + 4)[: B * max_pages].reshape(B, max_pages)
    owned = np.zeros(B * max_pages + 4, bool)
    for b in range(B):
        owned[bt[b, : -(-int(lens[b]) // page)]] = True
    kvf[~owned] = np.nan
    kv = jnp.asarray(kvf).astype(dt)
    bt, sl = jnp.asarray(bt, jnp.int32), jnp.asarray(lens)
    out, lse = jax.jit(lambda *a: tj.mla_decode(*a, softmax_scale=0.05, return_lse=True, backend="sm90"))(q, kv, bt, sl)
    ro, rl = tj.mla_decode(q.astype(jnp.float32), kv.astype(jnp.float32), bt, sl, softmax_scale=0.05,
                           return_lse=True, backend="xla")
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ro)))
    lerr = float(jnp.max(jnp.where(jnp.isfinite(rl), jnp.abs(lse - rl), 0.0)))
    inf_ok = bool(jnp.all(jnp.isneginf(lse) == jnp.isneginf(rl)))
    fin = bool(jnp.all(jnp.isfinite(out)))
    ok = err < (0.08 if dt == "float8_e4m3fn" else 0.02) and lerr < 0.05 and inf_ok and fin
    bad += not ok
    print(f"SMOKE {dt} S{S} H{H} p{page}: err {err:.3e} lse {lerr:.3e} inf_ok {inf_ok} finite {fin} "
          f"{'OK' if ok else 'FAIL'} {time.time() - t:.1f}s", flush=True)
sys.exit(1 if bad else 0)
