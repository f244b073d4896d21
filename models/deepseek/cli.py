"""``tokenspeed-deepseek`` / ``python -m tokenspeed_jax.models.deepseek``: run DeepSeek-V3/R1 on the
tokenspeed_jax MLA ops and report prefill / decode throughput, the MTP acceptance rate and the attention
backend that ran.

By default it builds the ``small`` preset with generated (random) weights, so it runs anywhere (CPU: float32
compute, xla backend; GPU: bfloat16, ``backend=auto`` picks the kernel backend when it supports the call).
``--checkpoint DIR`` loads a Hugging Face checkpoint instead.  Prompts are random token ids.  Each
configuration runs once to compile (warm-up) and once timed; ``--profile DIR`` wraps the timed run in
``jax.profiler.trace`` and checks that the tokenspeed ops appear in the trace by name.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

TOKENSPEED_SCOPES = (
    "tokenspeed_mla_prefill",
    "tokenspeed_mla_decode",
    "tokenspeed_concat_and_cache_mla",
    "tokenspeed_merge_attn_states",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenspeed-deepseek", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default="small", help="config preset with generated weights (tiny, small, ...)"
    )
    p.add_argument(
        "--checkpoint", default=None, help="Hugging Face checkpoint directory (overrides --preset)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="compute/param dtype (auto: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float8_e4m3fn"],
        help="latent cache dtype (auto: the compute dtype)",
    )
    p.add_argument("--backend", default="auto", help="attention backend: auto, xla, sm90, sm100")
    p.add_argument("--batch", type=int, default=4, help="number of prompts")
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt (others are shorter)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="MTP drafts per round (default 1 if the model has an MTP layer, else 0)",
    )
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=None, help="chunked context prefill chunk size")
    p.add_argument(
        "--no-plain", action="store_true", help="with MTP, skip the comparison run with plain decode"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="> 0 samples (plain decode only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile", default=None, metavar="DIR", help="write an XLA profiler trace of the timed run"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--mesh",
        default=None,
        help='device mesh, e.g. "data=1,tensor=2,expert=4" (data: DP attention, tensor: heads, experts '
        "over all axes); parameters and cache are placed with NamedSharding",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the bytes per device (weights, KV cache, peak activations) for the config / mesh / "
        "batch / context and exit (status 2 if it does not fit); nothing is loaded",
    )
    p.add_argument(
        "--context", type=int, default=None, help="--plan: tokens per request (default prompt + new)"
    )
    p.add_argument(
        "--prefill-tokens", type=int, default=None, help="--plan: tokens of one prefill step per data rank"
    )
    p.add_argument(
        "--device-memory-gib", type=float, default=None, help="--plan: device memory (default H200)"
    )
    return p


def _plan_main(args) -> int:
    from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
    from tokenspeed_jax.models.deepseek.parallel import parse_mesh
    from tokenspeed_jax.models.deepseek.plan import H200_BYTES, plan

    if args.checkpoint:
        cfg = DeepseekV3Config.from_json(args.checkpoint)
    else:
        cfg = DeepseekV3Config.preset(args.preset)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    kv = None if args.kv_dtype == "auto" else jnp.dtype(args.kv_dtype)
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else 1
    p = plan(
        cfg,
        parse_mesh(args.mesh or ""),
        batch=args.batch,
        context=args.context or args.prompt_len + args.max_new_tokens,
        prefill_tokens=args.prefill_tokens,
        num_speculative_tokens=k,
        dtype=dtype,
        kv_dtype=kv,
        page_size=args.page_size,
        device_bytes=int(args.device_memory_gib * 1024**3) if args.device_memory_gib else H200_BYTES,
    )
    print(p.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(p.to_dict(), f, indent=1)
    if not p.fits:
        print(f"refused: {p.advice()}", file=sys.stderr)
        return 2
    return 0


def bytes_per_device(model, cache=None) -> dict[str, int]:
    """Bytes the first device holds of the parameters (and cache): the sizes of the sharded arrays."""
    from flax import nnx

    dev = jax.devices()[0]

    def on_dev(a):
        return sum(s.data.nbytes for s in a.addressable_shards if s.device == dev)

    w = sum(on_dev(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = {"weights": int(w)}
    if cache is not None:
        out["kv_cache"] = int(on_dev(cache.kv))
    return out


def attention_backends(engine, batch: int, prompt_len: int, q_len: int) -> dict[str, str]:
    """The backend each op runs with, as the tokenspeed_jax registry decides it for these shapes."""
    import tokenspeed_jax as ts
    from tokenspeed_jax.problems import DecodeProblem, PrefillProblem
    from tokenspeed_jax.runtime import current_target

    c = engine.config
    dt = jnp.dtype(engine.model.dtype).name
    kv = jnp.dtype(engine.kv_dtype).name
    target = current_target()
    pre = PrefillProblem(
        batch=batch,
        num_q_tokens=batch * prompt_len,
        num_k_tokens=batch * prompt_len,
        num_q_heads=c.num_attention_heads,
        num_kv_heads=c.num_attention_heads,
        head_dim_qk=c.qk_head_dim,
        head_dim_v=c.v_head_dim,
        dtype=dt,
        causal=True,
        return_lse=False,
        max_seqlen_q=prompt_len,
        max_seqlen_k=prompt_len,
        target=target,
    )
    dec = DecodeProblem(
        batch=batch,
        q_len=q_len,
        num_heads=c.num_attention_heads,
        head_dim=c.kv_cache_dim,
        kv_lora_rank=c.kv_lora_rank,
        page_size=engine.page_size,
        num_pages=engine.cache.num_pages,
        max_pages=engine.max_pages,
        dtype=kv,
        causal=True,
        return_lse=False,
        target=target,
    )
    out = {}
    for op, prob in (("prefill", pre), ("decode", dec)):
        reasons = ts.backend_reasons(op, prob)
        if engine.backend == "auto":
            name = next((n for n, r in reasons.items() if r is None), None)
        else:
            name = engine.backend if reasons.get(engine.backend) is None else None
        why = "; ".join(f"{n}: {r}" for n, r in reasons.items() if r is not None and n != name)
        out[op] = f"{name}" + (f" (not chosen: {why})" if why else "")
    return out


def find_trace_names(directory: str, names=TOKENSPEED_SCOPES) -> dict[str, bool]:
    """Which of ``names`` occur in the profiler output under ``directory`` (xplane.pb / trace.json.gz)."""
    found = dict.fromkeys(names, False)
    for f in glob.glob(os.path.join(directory, "**", "*"), recursive=True):
        if not os.path.isfile(f) or not f.endswith((".pb", ".json.gz", ".json")):
            continue
        with gzip.open(f) if f.endswith(".gz") else open(f, "rb") as fh:
            data = fh.read()
        for n in names:
            found[n] = found[n] or n.encode() in data
    return found


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.plan:
        return _plan_main(args)
    from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
    from tokenspeed_jax.models.deepseek.engine import Engine
    from tokenspeed_jax.models.deepseek.model import DeepseekV3
    from tokenspeed_jax.models.deepseek.weights import load_checkpoint

    platform = jax.default_backend()
    dtype = {
        "auto": jnp.bfloat16 if platform == "gpu" else jnp.float32,
        "float32": jnp.float32,
        "bfloat16": jnp.bfloat16,
    }[args.dtype]
    kv_dtype = None if args.kv_dtype == "auto" else jnp.dtype(args.kv_dtype)
    mesh = None
    if args.mesh:
        from tokenspeed_jax.models.deepseek.parallel import make_mesh

        mesh = make_mesh(args.mesh)
    t0 = time.perf_counter()
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, dtype=dtype, mesh=mesh)
        source = args.checkpoint
    else:
        config = DeepseekV3Config.preset(args.preset)
        model = DeepseekV3.random(config, dtype=dtype, seed=args.seed, mesh=mesh)
        source = f"preset {args.preset!r} with generated weights"
    load_s = time.perf_counter() - t0
    c = model.config
    k = args.num_speculative_tokens
    if k is None:
        k = 1 if c.num_nextn_predict_layers and args.temperature <= 0 else 0
    rng = np.random.default_rng(args.seed)
    lens = [max(1, args.prompt_len - 7 * i) for i in range(args.batch)]
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in lens]
    engine = Engine(
        model,
        page_size=args.page_size,
        kv_dtype=kv_dtype,
        backend=args.backend,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
    )
    print(
        f"model: {source}; {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads, "
        f"{c.n_routed_experts} experts, MTP layers {c.num_nextn_predict_layers}; dtype "
        f"{jnp.dtype(dtype).name}, kv cache {jnp.dtype(engine.kv_dtype).name}; platform {platform}; "
        f"built/loaded in {load_s:.1f} s"
    )
    kw = {"num_speculative_tokens": k, "temperature": args.temperature, "seed": args.seed}
    t0 = time.perf_counter()
    engine.generate(prompts, args.max_new_tokens, **kw)  # compile
    compile_s = time.perf_counter() - t0
    res = None
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        try:
            jax.profiler.start_trace(args.profile)
        except (RuntimeError, OSError, ValueError) as e:  # e.g. no CUPTI: report it, still measure
            print(f"profile: could not start the XLA profiler ({type(e).__name__}: {e})")
        else:
            try:
                res = engine.generate(prompts, args.max_new_tokens, **kw)
            finally:
                jax.profiler.stop_trace()
    if res is None:
        res = engine.generate(prompts, args.max_new_tokens, **kw)
    plain = None
    if k and not args.no_plain:  # the same prompts with plain decode (S = 1), for comparison
        pkw = {**kw, "num_speculative_tokens": 0}
        engine.generate(prompts, args.max_new_tokens, **pkw)
        plain = engine.generate(prompts, args.max_new_tokens, **pkw)
    backends = attention_backends(engine, len(prompts), max(lens), k + 1)
    out = {
        "platform": platform,
        "prompts": lens,
        "max_new_tokens": args.max_new_tokens,
        "num_speculative_tokens": k,
        "warmup_s": compile_s,
        "prefill_tokens_per_s": res.prefill_tokens / res.prefill_s,
        "decode_tokens_per_s": (res.decode_tokens / res.decode_s) if res.decode_tokens else None,
        "mtp_acceptance_rate": res.acceptance_rate,
        "attention_backend": backends,
        "first_tokens": [t[:8] for t in res.tokens],
        "mesh": None if mesh is None else dict(mesh.shape),
        "bytes_per_device": bytes_per_device(model, engine.cache),
    }
    print(f"prompts {lens} (+{args.max_new_tokens} new tokens each); warm-up (compile) {compile_s:.1f} s")
    print(
        f"prefill: {res.prefill_tokens} tokens in {res.prefill_s * 1e3:.1f} ms = "
        f"{out['prefill_tokens_per_s']:.1f} tokens/s"
    )
    if res.decode_tokens:
        print(
            f"decode:  {res.decode_tokens} tokens in {res.decode_s * 1e3:.1f} ms = "
            f"{out['decode_tokens_per_s']:.1f} tokens/s" + (f" (MTP, k = {k})" if k else "")
        )
    if k:
        print(
            f"MTP acceptance rate: {res.acceptance_rate:.3f} "
            f"({res.accepted_tokens}/{res.draft_tokens} drafts)"
        )
    if plain is not None and plain.decode_tokens:
        out["plain_decode_tokens_per_s"] = plain.decode_tokens / plain.decode_s
        out["mtp_tokens_equal_plain"] = plain.tokens == res.tokens
        print(
            f"decode (plain, S = 1): {out['plain_decode_tokens_per_s']:.1f} tokens/s; MTP tokens == plain "
            f"greedy tokens: {'yes' if out['mtp_tokens_equal_plain'] else 'NO'}"
        )
    for op, b in backends.items():
        print(f"attention backend ({op}): {b}")
    if args.profile:
        found = find_trace_names(args.profile)
        out["trace_names"] = found
        print(
            f"profile written to {args.profile}; tokenspeed ops in the trace: "
            + ", ".join(f"{n} {'yes' if v else 'no'}" for n, v in found.items())
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
