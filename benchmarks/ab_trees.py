"""Time ``mla_decode(backend="sm90")`` of the tokenspeed_jax on sys.path against FlashMLA on fixed cases (one
process per tree; compare the ours/FlashMLA ratios of two trees).  Prints one JSON line per case.

    PYTHONPATH=<tree> python benchmarks/ab_trees.py <tag>   # for each tree, on the same GPU"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tokenspeed_jax as tj
from benchmarks.harness import interleaved

tag = sys.argv[1]
import flash_mla as fm  # noqa: E402
import torch  # noqa: E402

# (uniform S 2 / S 4: causal MTP on varied lengths, where every piece's last tile cleans the hidden keys' V)
for dist, perm, H, S in [("full", False, 32, 1), ("full", True, 32, 1), ("full", False, 128, 1),
                         ("full", False, 16, 4), ("uniform", True, 32, 1), ("uniform", True, 16, 2),
                         ("uniform", True, 32, 4)]:
    B, cap, page = 64, 81920, 64
    mp = cap // page
    rng = np.random.default_rng(5)
    lens = np.full(B, cap) if dist == "full" else rng.integers(256, cap + 1, B)
    bt = (rng.permutation(B * mp) if perm else np.arange(B * mp)).reshape(B, mp)
    kv = jax.random.normal(jax.random.PRNGKey(3), (B * mp + 8, page, 576), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(4), (B, S, H, 576), jnp.bfloat16)
    bt, sl = jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32)
    res = {}
    for dt in ("bfloat16", "float8_e4m3fn"):
        qq, kk = q.astype(dt), kv.astype(dt)
        f = jax.jit(lambda q_, kv_, bt_, sl_: tj.mla_decode(q_, kv_, bt_, sl_, softmax_scale=576 ** -0.5, backend="sm90"))
        tq, tk = torch.from_dlpack(q), torch.from_dlpack(kv).view(B * mp + 8, page, 1, 576)
        tbt, tsl = torch.from_dlpack(bt), torch.from_dlpack(sl)
        if dt == "bfloat16":
            sched, _ = fm.get_mla_metadata()
            ref = lambda: fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, sched, None, softmax_scale=576 ** -0.5,
                                                    causal=True)
        else:
            q8, k8 = tq.to(torch.float8_e4m3fn), tk.to(torch.float8_e4m3fn)
            one = torch.ones(1, dtype=torch.float32, device=tq.device)
            ref = lambda: fm.flash_mla_fp8_dense(q8, k8, tbt, tsl, 576 ** -0.5, True, one, one)
        r = interleaved({"ours": lambda: f(qq, kk, bt, sl), "fm": ref}, 1500.0, rounds=7)
        res[dt] = (round(r["ours"]["median_us"], 1), round(r["fm"]["median_us"], 1),
                   round(r["fm"]["median_us"] / r["ours"]["median_us"], 3))
    print("AB", json.dumps({"tree": tag, "case": f"{dist}_perm{int(perm)}_H{H}_S{S}", **res}), flush=True)
