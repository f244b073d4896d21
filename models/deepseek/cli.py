"""``tokenspeed-deepseek`` / ``python -m tokenspeed_jax.models.deepseek``: run DeepSeek-V3/R1 on the
tokenspeed_jax MLA ops and report prefill / decode throughput, the MTP acceptance rate and the attention
backend that ran.

By default it loads the shipped checkpoint ``pystdlib-tiny`` (a small DeepSeek-V3-architecture model with a
trained MTP head, ``tokenspeed_jax.models.deepseek.checkpoints``) and continues three Python prompts, so it runs
anywhere and prints real text (CPU: float32 compute, xla backend; GPU: bfloat16, ``backend=auto`` picks the
kernel backend when it supports the call).  ``--preset NAME`` builds a config with generated (random) weights
instead; ``--checkpoint DIR`` loads another Hugging Face checkpoint; when DIR has ``tokenizer.json``,
``--prompt TEXT`` (repeatable) or ``--prompts-file FILE`` (one prompt per line) give text prompts and the
generated text is printed.  Without text prompts the prompts are random token ids.  Each configuration
runs once to compile (warm-up; JAX's persistent compilation cache makes a second process's warm-up
short, ``--no-compilation-cache`` turns it off) and once timed; ``--profile DIR`` wraps the timed run in
``jax.profiler.trace`` and reports which tokenspeed names its events show (read as XProf reads it: on a
GPU the custom calls, on a CPU none, since the reference runs as fused XLA code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

TOKENSPEED_SCOPES = (
    "tokenspeed_mla_prefill",
    "tokenspeed_mla_decode",
    "tokenspeed_concat_and_cache_mla",
    "tokenspeed_merge_attn_states",
)
BACKENDS = ("auto", "xla", "sm90", "sm100")
PAGE_SIZES = (16, 32, 64, 128, 256)  # mla_decode's page sizes
# the text prompts of the default run (the shipped checkpoint was trained on the Python standard library)
DEFAULT_PROMPTS = ("    def __init__(self, name", "        if not isinstance(", "import ")


def _parser() -> argparse.ArgumentParser:
    from tokenspeed_jax.models.deepseek.config import PRESETS

    p = argparse.ArgumentParser(
        prog="tokenspeed-deepseek",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="a config with generated (random) weights instead of a checkpoint",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="Hugging Face checkpoint directory (default, without --preset: the shipped pystdlib-tiny)",
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
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention backend")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="a text prompt (repeatable; needs tokenizer.json)",
    )
    p.add_argument("--prompts-file", default=None, metavar="FILE", help="text prompts, one per line")
    p.add_argument("--batch", type=int, default=4, help="number of random prompts (without text prompts)")
    p.add_argument("--prompt-len", type=int, default=64, help="longest random prompt (others are shorter)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="new tokens per prompt, at most (EOS and the model's context stop a request earlier)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="{0..15}",
        help="MTP drafts per round (default: 1 if the model has an MTP layer, else 0)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling probability in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts, generated weights and sampling")
    p.add_argument("--ignore-eos", action="store_true", help="run every request to --max-new-tokens")
    p.add_argument("--page-size", type=int, default=64, choices=PAGE_SIZES, help="tokens per KV cache page")
    p.add_argument("--prefill-chunk", type=int, default=None, help="chunked context prefill chunk size")
    p.add_argument(
        "--max-slots", type=int, default=None, help="decode slots (continuous batching; default: all prompts)"
    )
    p.add_argument(
        "--no-plain", action="store_true", help="with MTP, skip the comparison run with plain decode"
    )
    p.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="do not enable JAX's persistent compilation cache (default dir: ~/.cache/tokenspeed_jax/xla)",
    )
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


def _validate(p: argparse.ArgumentParser, args) -> None:
    """One-line ``parser.error`` naming the flag for every bad value (exit status 2, no traceback)."""
    for flag, v, lo in (
        ("--batch", args.batch, 1),
        ("--prompt-len", args.prompt_len, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--prefill-chunk", args.prefill_chunk, 1),
        ("--max-slots", args.max_slots, 1),
        ("--top-k", args.top_k, 0),
        ("--seed", args.seed, 0),
        ("--context", args.context, 1),
        ("--prefill-tokens", args.prefill_tokens, 1),
    ):
        if v is not None and v < lo:
            p.error(f"{flag}: expected an integer >= {lo}, got {v}")
    if args.device_memory_gib is not None and not 0 < args.device_memory_gib < float("inf"):
        p.error(f"--device-memory-gib: expected a positive number, got {args.device_memory_gib}")
    k = args.num_speculative_tokens
    if k is not None and not 0 <= k <= 15:
        p.error(f"--num-speculative-tokens: expected 0..15 (mla_decode verifies at most 16 tokens), got {k}")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature: expected a finite number >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top-p: expected a number in (0, 1], got {args.top_p}")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint: no such directory {args.checkpoint!r}")
    if args.prompts_file is not None and not os.path.isfile(args.prompts_file):
        p.error(f"--prompts-file: no such file {args.prompts_file!r}")
    if args.preset is not None and args.checkpoint is not None:
        p.error("--preset: give either --preset (generated weights) or --checkpoint, not both")
    if args.preset is None and args.checkpoint is None:  # the shipped checkpoint (its config for --plan)
        from tokenspeed_jax.models.deepseek.checkpoints import default_checkpoint

        args.checkpoint = default_checkpoint()
        if args.prompt is None and args.prompts_file is None and not args.plan:
            args.prompt = list(DEFAULT_PROMPTS)
    if args.mesh is not None:
        from tokenspeed_jax.models.deepseek.parallel import parse_mesh

        try:
            data = parse_mesh(args.mesh)["data"]
        except ValueError as e:
            p.error(f"--mesh: {str(e).removeprefix('mesh: ')}")
        if args.max_slots is not None and args.max_slots % data:
            p.error(
                f"--max-slots: DP attention (--mesh data={data}) gives every data rank max-slots / data "
                f"slots, expected a multiple of {data}, got {args.max_slots}"
            )
    if args.prompt is not None and args.prompts_file is not None:
        p.error("--prompts-file: give either --prompt or --prompts-file, not both")
    if (args.prompt or args.prompts_file) and args.checkpoint is None:
        flag = "--prompt" if args.prompt else "--prompts-file"
        p.error(f"{flag}: text prompts need a tokenizer: pass --checkpoint DIR with a tokenizer.json")


def _config(parser: argparse.ArgumentParser, args):
    """The config of ``--checkpoint`` (its config.json) or ``--preset``; a bad config.json is a parser error."""
    from tokenspeed_jax.models.deepseek.config import DeepseekV3Config

    if args.checkpoint is None:
        return DeepseekV3Config.preset(args.preset)
    try:
        return DeepseekV3Config.from_json(args.checkpoint)
    except (ValueError, OSError) as e:
        parser.error(f"--checkpoint: {e}".splitlines()[0])


def _model_name(checkpoint: str) -> str:
    return os.path.basename(os.path.normpath(checkpoint))


def _plan_main(parser: argparse.ArgumentParser, args) -> int:
    import jax.numpy as jnp

    from tokenspeed_jax.models.deepseek.parallel import parse_mesh
    from tokenspeed_jax.models.deepseek.plan import H200_BYTES, plan

    cfg = _config(parser, args)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    kv = None if args.kv_dtype == "auto" else jnp.dtype(args.kv_dtype)
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else 1
    try:
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
    except ValueError as e:  # a mesh the model cannot run on (parallel.check_mesh)
        parser.error(f"--mesh: {str(e).removeprefix('mesh: ')}")
    model_name = f"preset:{args.preset}" if args.checkpoint is None else _model_name(args.checkpoint)
    print(f"model: {model_name}")
    print(p.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_name, **p.to_dict()}, f, indent=1)
    if not p.fits:
        print(f"refused: {p.advice()}", file=sys.stderr)
        return 2
    return 0


def bytes_per_device(model, cache=None) -> dict[str, int]:
    """Bytes the first device holds of the parameters (and cache): the sizes of the sharded arrays."""
    import jax
    from flax import nnx

    dev = jax.devices()[0]

    def on_dev(a):
        return sum(s.data.nbytes for s in a.addressable_shards if s.device == dev)

    w = sum(on_dev(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = {"weights": int(w)}
    if cache is not None:
        out["kv_cache"] = int(on_dev(cache.kv))
    return out


def attention_backends(engine, batch: int, prompt_len: int, q_len: int) -> dict[str, dict]:
    """The backend each op runs with, as the tokenspeed_jax registry decides it for these shapes:
    ``{op: {"name": chosen or None, "not_chosen": {backend: reason}}}``."""
    import jax.numpy as jnp

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
        out[op] = {
            "name": name,
            "not_chosen": {n: r for n, r in reasons.items() if r is not None and n != name},
        }
    return out


def _backend_line(b: dict) -> str:
    why = "; ".join(f"{n}: {r}" for n, r in b["not_chosen"].items())
    return f"{b['name']}" + (f" (not chosen: {why})" if why else "")


def find_trace_names(directory: str, names=TOKENSPEED_SCOPES) -> dict[str, bool]:
    """Which of ``names`` show in the events of the profiler output under ``directory``, read as XProf's
    trace viewer reads it (:func:`tokenspeed_jax.profiling.trace_names`; on a CPU none is expected)."""
    from tokenspeed_jax.profiling import trace_names

    return {n: bool(planes) for n, planes in trace_names(directory, names).items()}


class _Progress:
    """A stderr line every ``every`` seconds while a long step (compilation) runs."""

    def __init__(self, what: str, every: float = 5.0):
        self.what, self.every = what, every
        self._stop = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()
        print(f"{self.what} ...", file=sys.stderr, flush=True)

        def tick():
            while not self._stop.wait(self.every):
                print(f"{self.what} ... {time.perf_counter() - self.t0:.0f} s", file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        print(f"{self.what}: done in {time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _validate(parser, args)

    import jax
    import jax.numpy as jnp
    import numpy as np
    if args.plan:
        return _plan_main(parser, args)
    from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
    from tokenspeed_jax.models.deepseek.compile_cache import CompileClock
    from tokenspeed_jax.models.deepseek.engine import Engine, enable_compilation_cache
    from tokenspeed_jax.models.deepseek.model import DeepseekV3
    from tokenspeed_jax.models.deepseek.tokenizer import load_tokenizer
    from tokenspeed_jax.models.deepseek.weights import load_checkpoint

    mesh = None
    if args.mesh:  # before loading: enough devices, and a layout the model can run on
        from tokenspeed_jax.models.deepseek.parallel import check_mesh, make_mesh

        config = _config(parser, args)
        try:
            mesh = make_mesh(args.mesh)
            check_mesh(config, mesh)
        except ValueError as e:
            parser.error(f"--mesh: {str(e).removeprefix('mesh: ')}")
    cache_dir = None if args.no_compilation_cache else enable_compilation_cache()
    platform = jax.default_backend()
    dtype = {
        "auto": jnp.bfloat16 if platform == "gpu" else jnp.float32,
        "float32": jnp.float32,
        "bfloat16": jnp.bfloat16,
    }[args.dtype]
    kv_dtype = None if args.kv_dtype == "auto" else jnp.dtype(args.kv_dtype)
    t0 = time.perf_counter()
    tokenizer = None
    if args.checkpoint:
        try:
            model = load_checkpoint(args.checkpoint, dtype=dtype, mesh=mesh)
            tokenizer = load_tokenizer(args.checkpoint)
        except (ValueError, OSError) as e:
            parser.error(f"--checkpoint: {e}".splitlines()[0])
        source = args.checkpoint
        model_name = _model_name(args.checkpoint)
    else:
        config = DeepseekV3Config.preset(args.preset)
        model = DeepseekV3.random(config, dtype=dtype, seed=args.seed, mesh=mesh)
        source = f"preset {args.preset!r} with generated weights"
        model_name = f"preset:{args.preset}"
    load_s = time.perf_counter() - t0
    c = model.config
    k = args.num_speculative_tokens
    if k is None:
        k = 1 if c.num_nextn_predict_layers else 0
    if k and not c.num_nextn_predict_layers:
        parser.error("--num-speculative-tokens: the model has no MTP layer (num_nextn_predict_layers = 0)")
    texts_in = None
    flag = "--prompt" if args.prompt else "--prompts-file" if args.prompts_file else "--prompt-len"
    if args.prompt or args.prompts_file:
        if tokenizer is None:
            parser.error(f"{flag}: {args.checkpoint!r} has no tokenizer.json")
        if args.prompt:
            texts_in = list(args.prompt)
        else:
            with open(args.prompts_file) as f:
                texts_in = [line.rstrip("\n") for line in f if line.strip()]
            if not texts_in:
                parser.error(f"--prompts-file: {args.prompts_file!r} has no prompt")
        prompts = [tokenizer.encode(t) for t in texts_in]
        if any(max(p, default=0) >= c.vocab_size for p in prompts):
            parser.error(f"{flag}: the tokenizer produced ids >= the model's vocab_size {c.vocab_size}")
    else:
        rng = np.random.default_rng(args.seed)
        lens = [max(1, args.prompt_len - 7 * i) for i in range(args.batch)]
        prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in lens]
    lens = [len(p) for p in prompts]
    if max(lens) >= c.max_position_embeddings:
        parser.error(
            f"{flag}: a prompt of {max(lens)} tokens does not fit the model's context of "
            f"{c.max_position_embeddings} tokens (max_position_embeddings)"
        )
    engine = Engine(
        model,
        page_size=args.page_size,
        kv_dtype=kv_dtype,
        backend=args.backend,
        prefill_chunk=args.prefill_chunk,
        max_slots=args.max_slots,
        tokenizer=tokenizer,
        compilation_cache=False,  # enabled above unless --no-compilation-cache
        seed=args.seed,
    )
    print(
        f"model: {source}; {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads, "
        f"{c.n_routed_experts} experts, MTP layers {c.num_nextn_predict_layers}; dtype "
        f"{jnp.dtype(dtype).name}, kv cache {jnp.dtype(engine.kv_dtype).name}; platform {platform}; "
        f"built/loaded in {load_s:.1f} s"
    )
    kw = {
        "num_speculative_tokens": k,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "eos_token_id": [] if args.ignore_eos else None,
    }
    clock = CompileClock().install()  # where the warm-up goes: tracing, lowering, XLA compiles (cache hits)
    t0 = time.perf_counter()
    try:
        with _Progress("warm-up: compiling prefill and decode steps (first run)"):
            engine.generate(prompts, args.max_new_tokens, **kw)
    except ValueError as e:  # an argument combination the engine rejects: one line, no traceback
        parser.error(str(e).splitlines()[0])
    compile_s = time.perf_counter() - t0
    warmup_compile = clock.snapshot()
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
        with _Progress("warm-up: plain decode for the comparison"):
            engine.generate(prompts, args.max_new_tokens, **pkw)
        plain = engine.generate(prompts, args.max_new_tokens, **pkw)
    backends = attention_backends(engine, len(prompts), max(lens), k + 1)
    out = {
        "model": model_name,
        "platform": platform,
        "prompts": lens,
        "max_new_tokens": args.max_new_tokens,
        "num_speculative_tokens": k,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "compilation_cache_dir": cache_dir,
        "warmup_s": compile_s,
        "warmup_compile": warmup_compile,
        "prefill_tokens_per_s": res.prefill_tokens / res.prefill_s,
        "decode_tokens_per_s": (res.decode_tokens / res.decode_s) if res.decode_tokens else None,
        "generated_tokens": [len(t) for t in res.tokens],
        "stop_reasons": res.stop_reasons,
        "mtp_acceptance_rate": res.acceptance_rate,
        "attention_backend": backends,
        "first_tokens": [t[:8] for t in res.tokens],
        "texts": res.texts,
        "mesh": None if mesh is None else dict(mesh.shape),
        "bytes_per_device": bytes_per_device(model, engine.cache),
    }
    print(
        f"prompts {lens} (up to {args.max_new_tokens} new tokens each); warm-up (compile) {compile_s:.1f} s"
    )
    print(
        f"prefill: {res.prefill_tokens} tokens in {res.prefill_s * 1e3:.1f} ms = "
        f"{out['prefill_tokens_per_s']:.1f} tokens/s"
    )
    if res.decode_tokens:
        print(
            f"decode:  {res.decode_tokens} tokens in {res.decode_s * 1e3:.1f} ms = "
            f"{out['decode_tokens_per_s']:.1f} tokens/s" + (f" (MTP, k = {k})" if k else "")
        )
    if k and res.acceptance_rate is not None:
        print(
            f"MTP acceptance rate: {res.acceptance_rate:.3f} "
            f"({res.accepted_tokens}/{res.draft_tokens} drafts)"
        )
    if plain is not None and plain.decode_tokens:
        out["plain_decode_tokens_per_s"] = plain.decode_tokens / plain.decode_s
        same = plain.tokens == res.tokens
        out["mtp_tokens_equal_plain"] = same if args.temperature <= 0 else None
        what = "greedy tokens" if args.temperature <= 0 else "tokens (sampling: not expected)"
        print(
            f"decode (plain, S = 1): {out['plain_decode_tokens_per_s']:.1f} tokens/s; MTP tokens == plain "
            f"{what}: {'yes' if same else 'NO'}"
        )
    for op, b in backends.items():
        print(f"attention backend ({op}): {_backend_line(b)}")
    if res.texts is not None:
        for i, t in enumerate(res.texts):
            src = texts_in[i] if texts_in else f"<{lens[i]} random ids>"
            print(f"[{i}] {src!r} -> {t!r} ({res.stop_reasons[i]})")
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
