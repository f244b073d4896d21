"""One-GPU benchmark of an R1-shaped model truncated in depth: full width (hidden 7168, 128 heads, the real
MLA dims: kv_lora_rank 512, rope 64, nope 128, v 128), 1 dense + 2 MoE layers (256 experts, top-8, as R1:
about 40 GB of FP8 weights with the MTP layer, so no expert reduction is needed on an H200), FP8 weights
resident (e4m3 + 128x128 block scales, dequantised inside the step), bf16 compute and cache.

    python -m benchmarks.deepseek_r1_h200 --json $OUT/deepseek_r1_h200.json

Measures, for batch 1 / 16 / 64 and context 4k / 32k:

* prefill tokens/s: the batch's prompts of ``context`` tokens, prefilled in steps of at most
  ``--prefill-step-tokens`` tokens (requests grouped, a long prompt chunked: chunked context prefill);
* decode tokens/s: ``--decode-steps`` S = 1 decode steps of the whole batch at position ``context`` (one
  ``lax.fori_loop`` in one jit; the cache is sized for the context and attended in full, its contents do not
  change the time), and the step time against its HBM roofline: (weight bytes read per step + KV bytes read
  per step) / ``--hbm-tb-s`` (4.8 TB/s on an H200).  Weight bytes per step count every non-expert weight of
  the 3 layers + lm_head once, and the routed experts a batch touches (expected distinct experts per layer
  ``E * (1 - (1 - k/E)^B)`` with random routing) at one byte per FP8 weight;
* the decode step's breakdown (attention / moe / dense_mlp / rest) from an XLA profile: each GPU kernel of
  the trace is mapped to its HLO instruction and that instruction's ``named_scope`` path (the model's
  layers open ``attention`` / ``moe`` / ``dense_mlp`` scopes).

Weights are random (generated on the device; routing is then about uniform).  ``--tiny`` runs the same
code on the ``tiny`` preset with small batches / contexts (CPU test).  JSON output carries commit, command,
date and device.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def r1_truncated(num_experts: int = 256):
    from tokenspeed_jax.models.deepseek import DeepseekV3Config

    r1 = DeepseekV3Config.preset("deepseek-r1")
    return r1.replace(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=num_experts,
                      n_group=min(r1.n_group, num_experts // 2))


def device_random_model(config, *, dtype=jnp.bfloat16, seed=0):
    """Random weights made on the default device (jax.random; the numpy path of DeepseekV3.random is slow
    at this size): e4m3 kernels ~ N(0, 1) with block scales 0.02 / sqrt(fan-in) * sqrt(in)... kept simple:
    scale 0.02 / 2 so dequantised weights have std ~0.01; other matrices N(0, 0.02); norms 1; router bias 0."""
    from flax import nnx
    from tokenspeed_jax.models.deepseek import DeepseekV3

    model = nnx.eval_shape(lambda: DeepseekV3(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    key = jax.random.PRNGKey(seed)

    @jax.jit(static_argnums=(1, 2, 3))
    def gen(k, shape, dt, kind):
        if kind == "ones":
            return jnp.ones(shape, dt)
        if kind == "zeros":
            return jnp.zeros(shape, dt)
        if kind == "scale":
            return jnp.full(shape, 0.005, dt)
        x = jax.random.normal(k, shape, jnp.bfloat16)
        return (x if kind == "fp8" else x * 0.02).astype(dt)

    for i, (p, v) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        leaf = p[-1]
        stacked = int(p[0] in ("dense_layers", "moe_layers")) + int("experts" in [str(x) for x in p])
        if leaf.endswith("_scale_inv"):
            kind = "scale"
        elif leaf == "weight" and len(v.shape) - stacked == 1:
            kind = "ones"
        elif leaf == "e_score_correction_bias":
            kind = "zeros"
        elif jnp.dtype(v.dtype) == jnp.float8_e4m3fn:
            kind = "fp8"
        else:
            kind = "normal"
        v.set_value(gen(jax.random.fold_in(key, i), tuple(v.shape), jnp.dtype(v.dtype), kind))
    return model


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one decode step reads (module docstring)."""
    from flax import nnx

    c = model.config
    total = 0
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(x) for x in p]
        if p[0] == "mtp" or names[-1] == "embedding":
            continue  # plain decode does not run the MTP layer; embedding reads B rows only
        nbytes = v.get_value().nbytes
        if "experts" in names:
            E, k = c.n_routed_experts, c.num_experts_per_tok
            nbytes = nbytes * (1 - (1 - k / E) ** batch)
        total += nbytes
    return int(total)


def hlo_scopes(compiled_text: str) -> dict[str, str]:
    """HLO instruction name -> its metadata op_name (the named_scope path)."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*op_name=\"([^\"]*)\"", compiled_text):
        out[m.group(1)] = m.group(2)
    return out


def classify(op_name: str) -> str:
    for key in ("attention", "moe", "dense_mlp"):
        if f"/{key}/" in op_name or op_name.endswith(f"/{key}") or f"{key}/" in op_name:
            return key
    return "rest"


def profile_breakdown(trace_dir: str, scopes: dict[str, str]) -> dict[str, float]:
    """Seconds of GPU (or, on CPU, XLA op) events per class in a jax.profiler trace."""
    times = {"attention": 0.0, "moe": 0.0, "dense_mlp": 0.0, "rest": 0.0}
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {}
    with gzip.open(sorted(files)[-1]) as f:
        trace = json.load(f)
    pids = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pids[e["pid"]] = e["args"]["name"]
    gpu = {p for p, n in pids.items() if "/device:GPU" in n}
    host_xla = {p for p, n in pids.items() if "/host:CPU" in n or "TFRT" in n or "Host" in n}
    use = gpu or host_xla
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("pid") not in use:
            continue
        args = e.get("args", {})
        op = args.get("hlo_op") or args.get("long_name", "").split(" ")[0].lstrip("%") or e.get("name", "")
        op = op.split(":")[0]
        if gpu or op in scopes:
            times[classify(scopes.get(op, ""))] += e.get("dur", 0) * 1e-6
    return times


def run(args) -> dict:
    from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine
    from tokenspeed_jax.models.deepseek import engine as E

    if args.tiny:
        cfg = DeepseekV3Config.preset("tiny").replace(
            quantization_config=DeepseekV3Config.preset("deepseek-r1").quantization_config, num_hidden_layers=3
        )
        model = DeepseekV3.random(cfg, dtype=jnp.float32)
    else:
        cfg = r1_truncated(args.experts)
        model = device_random_model(cfg)
    platform = jax.default_backend()
    out = {"config": {"hidden": cfg.hidden_size, "heads": cfg.num_attention_heads, "layers": cfg.num_hidden_layers,
                      "dense_layers": cfg.first_k_dense_replace, "experts": cfg.n_routed_experts,
                      "top_k": cfg.num_experts_per_tok, "mtp_layers": cfg.num_nextn_predict_layers,
                      "fp8_weights": cfg.quantization_config is not None},
           "platform": platform, "hbm_tb_s": args.hbm_tb_s, "results": []}
    ps = args.page_size
    for C in args.contexts:
        for B in args.batches:
            row = {"batch": B, "context": C}
            # ---- prefill: groups of requests, each step <= prefill_step_tokens tokens
            g = max(1, min(B, args.prefill_step_tokens // C))
            chunk = min(C, args.prefill_step_tokens // g)
            eng = Engine(model, page_size=ps, backend=args.backend, prefill_chunk=chunk if chunk < C else None)
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, cfg.vocab_size, C).tolist() for _ in range(g)]
            for _ in range(2):  # compile (fresh and committed caches)
                eng.reset([C + 1] * g)
                jax.block_until_ready(eng.prefill(prompts))
            eng.reset([C + 1] * g)
            t = time.perf_counter()
            jax.block_until_ready(eng.prefill(prompts))
            dt = time.perf_counter() - t
            row["prefill_tokens_per_s"] = g * C / dt
            row["prefill_group"] = g
            row["prefill_chunk"] = chunk
            # ---- decode: S = 1 steps of the whole batch at position C
            steps = args.decode_steps
            eng = Engine(model, page_size=ps, backend=args.backend)
            eng.reset([C + steps + 1] * B)
            tok = jnp.zeros((B, 1), jnp.int32)
            kw = dict(backend=args.backend, page_size=ps)
            fn = E._decode_step  # one S = 1 step of the whole batch (the decode loop's body), dispatched per step

            def run_steps(n, eng=eng, tok=tok, C=C, B=B, kw=kw, fn=fn):
                logits = None
                for i in range(n):
                    pos = jnp.full((B, 1), C + i, jnp.int32)
                    eng.cache, logits = fn(eng.graphdef, eng.state, eng.cache, tok, pos, eng.block_table, **kw)
                return logits

            for _ in range(2):  # compile (the second call sees the committed, donated cache of the first)
                jax.block_until_ready(run_steps(1))
            t = time.perf_counter()
            jax.block_until_ready(run_steps(steps))
            step = (time.perf_counter() - t) / steps
            row["decode_step_ms"] = step * 1e3
            row["decode_tokens_per_s"] = B / step
            wb = weight_bytes_per_step(model, B)
            L = cfg.num_hidden_layers
            kvb = B * (C + steps / 2) * L * cfg.kv_cache_dim * jnp.dtype(eng.kv_dtype).itemsize
            roof = (wb + kvb) / (args.hbm_tb_s * 1e12)
            row["roofline"] = {"weight_bytes_per_step": wb, "kv_bytes_per_step": int(kvb),
                               "roofline_step_ms": roof * 1e3, "fraction_of_roofline": roof / step}
            # ---- profile of the decode loop: breakdown by named scope
            if args.profile_dir:
                d = os.path.join(args.profile_dir, f"B{B}_C{C}")
                os.makedirs(d, exist_ok=True)
                pos = jnp.full((B, 1), C, jnp.int32)
                compiled = fn.lower(eng.graphdef, eng.state, eng.cache, tok, pos, eng.block_table, **kw).compile()
                scopes = hlo_scopes(compiled.as_text())
                jax.profiler.start_trace(d)
                try:
                    jax.block_until_ready(run_steps(steps))
                finally:
                    jax.profiler.stop_trace()
                br = profile_breakdown(d, scopes)
                tot = sum(br.values())
                row["decode_breakdown_ms_per_step"] = {k: v / steps * 1e3 for k, v in br.items()}
                row["decode_breakdown_fraction"] = {k: (v / tot if tot else None) for k, v in br.items()}
            print(json.dumps(row), flush=True)
            out["results"].append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny preset, small sizes (a CPU check of the script)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--experts", type=int, default=256, help="routed experts (R1: 256)")
    ap.add_argument("--prefill-step-tokens", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--profile-dir", default="/tmp/deepseek_r1_h200_profile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.batches is None:
        args.batches = [1, 2] if args.tiny else [1, 16, 64]
    if args.contexts is None:
        args.contexts = [64] if args.tiny else [4096, 32768]
    if args.tiny:
        args.prefill_step_tokens = min(args.prefill_step_tokens, 64)
        args.decode_steps = min(args.decode_steps, 4)
        args.page_size = 16
    t0 = time.time()
    res = run(args)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = None
    res.update(commit=commit, command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               date=datetime.datetime.now(datetime.UTC).isoformat(), device=str(jax.devices()[0]),
               device_kind=jax.devices()[0].device_kind, wall_s=time.time() - t0)
    print(json.dumps({k: v for k, v in res.items() if k != "results"}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
