"""One-GPU benchmark of an R1-shaped model truncated in depth (issue #36): full width (hidden 7168, 128 heads,
the real MLA dims: kv_lora_rank 512, rope 64, nope 128, v 128), 1 dense + 2 MoE layers (+ R1's MTP layer,
resident, unused), FP8 weights resident (e4m3 + 128x128 block scales, dequantised inside the step), bf16
compute and cache, random weights made on the device.

    python -m benchmarks.deepseek_r1_h200 --budget-s 230 --out $OUT/r1.json     # H200 (scripts/gpu_figures.sh r1)
    python -m benchmarks.deepseek_r1_h200 --smoke --out /tmp/r1_smoke.json      # CPU check of the same code

**Experts: 32 routed experts (R1: 256), top-8, by default** (``--experts``).  The MoE runs its experts with
``jax.lax.ragged_dot``, which XLA on NVIDIA GPUs rewrites into a dense dot over a group-masked copy of the
tokens (``RaggedDotRewriter``: a ``[rows, E, hidden]`` temporary and E times the FLOPs, rows = tokens x 8).
At 256 experts a prefill step of 8192 tokens would need a 240 GB temporary and ~1.5 PFLOP per MoE layer, so
the expert count is reduced until the prefill steps fit (32 experts: 30 GB, 0.19 PFLOP per layer per 8192
tokens); the decode figures keep every other weight at R1's size.  The weight bytes of the roofline count
the experts this model has.

Measured (points in this order; ``--budget-s`` skips what no longer fits, with a note in the JSON):

* **decode** for each batch B (one compile per B: the cache is sized for the largest context and each
  context only sets the positions): ``--decode-steps`` S = 1 steps of the whole batch at position
  ``context`` (one jitted step per dispatch; the cache is zeros and attended in full, so its contents do
  not change the time): step time, tokens/s, and the step against its HBM roofline, (weight bytes + KV
  bytes read per step) / ``--hbm-tb-s`` (4.8 TB/s, the H200's spec).  Weight bytes per step count every
  non-expert weight of the 3 layers + lm_head once (FP8 = 1 byte, bf16 2, fp32 4) and the routed experts
  a batch touches (expected distinct experts per layer ``E * (1 - (1 - k/E)^B)`` under uniform routing);
  KV bytes are B x (context + steps/2) rows x 3 layers x 576 x 2 bytes.  Then the step broken down by
  ``attention`` / ``moe`` / ``dense_mlp`` / ``rest`` from an XLA profile of ``--profile-steps`` steps
  (each device event's ``tf_op`` named-scope path, else its HLO op's ``op_name`` metadata; the top
  kernels are listed too).
* **prefill** for each distinct (context C, prompts per step g) of the batch x context matrix: prompts
  of C tokens prefilled ``g = min(B, --prefill-step-tokens // C)`` at a time (a longer prompt in chunks
  of ``--prefill-step-tokens``: chunked context prefill), one warm-up (compile) run, one timed run;
  tokens/s = g * C / time.  Batch B's figure is that of its group size (16 and 64 prompts of 4k both
  run in groups of 2), so rows of equal (C, g) share one measurement (``shared_with``).

The JSON (``--out``, rewritten after every point) records commit, command, date, device, jax version,
the attention backends that ran (decode and prefill separately; on an H200 without FlashAttention-4 the
prefill runs the xla reference: ``attention_backends.prefill.ran == ["xla"]`` and the reason), compile
seconds per point, peak device memory, skipped points and why.  ``--smoke`` runs the same code on an
R1-shaped tiny config (hidden 64, 2 heads, 8 experts, real MLA dims, FP8) with small batches / contexts,
including a chunked prefill (CPU test: ``tests/models/test_deepseek_bench.py``).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.runinfo import Budget, Results

CLASSES = ("attention", "moe", "dense_mlp", "rest")
# where XLA on NVIDIA GPUs puts ragged_dot, the reason the expert count is reduced (module docstring)
EXPERTS_NOTE = (
    "routed experts reduced from R1's 256: jax.lax.ragged_dot (the MoE's grouped matmul) is rewritten by XLA on "
    "NVIDIA GPUs into a dense dot over a [tokens*top_k, E, hidden] group-masked temporary (E times the FLOPs); "
    "at 256 experts one 8192-token prefill step would need a ~240 GB temporary"
)


def r1_truncated(num_experts: int = 32, *, mtp_layers: int = 1):
    """R1's config with 3 layers (1 dense + 2 MoE), ``num_experts`` routed experts (top-8 in up to 8 groups)."""
    from tokenspeed_jax.models.deepseek import DeepseekV3Config

    r1 = DeepseekV3Config.preset("deepseek-r1")
    if num_experts < r1.num_experts_per_tok:
        raise ValueError(f"--experts: expected at least top-k = {r1.num_experts_per_tok}, got {num_experts}")
    groups = min(r1.n_group, max(1, num_experts // 4))
    while num_experts % groups:
        groups -= 1
    return r1.replace(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=num_experts,
        n_group=groups,
        topk_group=min(r1.topk_group, groups),
        num_nextn_predict_layers=mtp_layers,
    )


def smoke_config():
    """The R1 layout at toy width: the tiny preset with R1's FP8 block quantisation, 3 layers (1 dense + 2 MoE)."""
    from tokenspeed_jax.models.deepseek import DeepseekV3Config

    return DeepseekV3Config.preset("tiny").replace(
        quantization_config=DeepseekV3Config.preset("deepseek-r1").quantization_config, num_hidden_layers=3
    )


def device_random_model(config, *, dtype=jnp.bfloat16, seed=0, pool_size=1 << 24):
    """Random weights made on the default device in one jitted call (numpy at R1 width takes minutes, and
    ``jax.random`` per parameter shape compiles one RNG kernel each): one pool of ``pool_size`` N(0, 1) bf16
    values, each parameter a rotated tiling of it (its own rotation).  e4m3 kernels take the values as
    they are, with block scales 0.005 (dequantised std 0.005); other matrices N(0, 0.02); norm weights 1;
    router bias 0."""
    import math

    from flax import nnx
    from tokenspeed_jax.models.deepseek import DeepseekV3

    model = nnx.eval_shape(lambda: DeepseekV3(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    offsets = np.random.default_rng(seed).integers(0, pool_size, len(flat)).tolist()
    specs = []
    for p, v in flat:
        leaf = str(p[-1])
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
        specs.append((tuple(v.shape), jnp.dtype(v.dtype), kind))

    def make(pool, off, shape, dt, kind):
        if kind == "ones":
            return jnp.ones(shape, dt)
        if kind == "zeros":
            return jnp.zeros(shape, dt)
        if kind == "scale":
            return jnp.full(shape, 0.005, dt)
        n = math.prod(shape)
        x = jnp.concatenate([pool[off:], pool[:off]])
        x = jnp.tile(x, -(-n // pool.shape[0]))[:n].reshape(shape)
        return (x if kind == "fp8" else x * 0.02).astype(dt)

    @jax.jit
    def build(pool):
        return [make(pool, off, *spec) for off, spec in zip(offsets, specs)]

    values = build(jax.random.normal(jax.random.PRNGKey(seed), (pool_size,), jnp.bfloat16))
    for (_, v), a in zip(flat, values):
        v.set_value(a)
    return model


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one plain decode step reads (module docstring)."""
    from flax import nnx

    c = model.config
    total = 0.0
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(x) for x in p]
        if names[0] == "mtp" or names[-1] == "embedding":
            continue  # plain decode does not run the MTP layer; the embedding reads B rows only
        nbytes = v.get_value().nbytes
        if "experts" in names:
            E, k = c.n_routed_experts, c.num_experts_per_tok
            nbytes = nbytes * (1 - (1 - k / E) ** batch)
        total += nbytes
    return int(total)


def param_bytes(model) -> dict:
    from flax import nnx

    out: dict[str, int] = {}
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = v.get_value()
        out[str(a.dtype)] = out.get(str(a.dtype), 0) + int(a.nbytes)
    return out


# ------------------------------------------------------------------------------------- profile parsing
def hlo_scopes(compiled_text: str) -> dict[str, str]:
    """HLO instruction name -> its metadata ``op_name`` (the named_scope path)."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*op_name=\"([^\"]*)\"", compiled_text):
        out[m.group(1)] = m.group(2)
        # a GPU kernel is named after its HLO instruction with "." and "-" made "_" (loop_convert_fusion.1 ->
        # loop_convert_fusion_1), which is the name a profile event of a CUDA graph's kernel carries
        out.setdefault(re.sub(r"[.\-]", "_", m.group(1)), m.group(2))
    return out


def classify(op_name: str) -> str:
    """``attention`` / ``moe`` / ``dense_mlp`` (the model's named scopes) or ``rest``."""
    parts = op_name.split("/")
    for key in ("attention", "moe", "dense_mlp"):
        if key in parts:
            return key
    return "rest"


# planes' derived lines (XProf) that repeat the stream events: never summed
_DERIVED_LINES = (
    "XLA Modules",
    "XLA Ops",
    "Framework Ops",
    "TensorFlow Ops",
    "Framework Name Scope",
    "TensorFlow Name Scope",
    "Steps",
    "XLA TraceMe",
    "Launch Stats",
    "Source code",
)


def trace_events(trace_dir: str) -> tuple[str, list[tuple[str, float, dict]]]:
    """``(where, [(event name, seconds, string/int stats)])`` of the device kernels in a jax.profiler output
    directory: the GPU planes' stream lines of the ``*.xplane.pb`` (``where = "gpu"``); without a GPU plane,
    the host's XLA thunk events that name an HLO op (``where = "cpu"``: overlapping threads, a smoke check
    only); ``*.trace.json.gz`` when no XSpace can be read."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if files:
        from jax.profiler import ProfileData

        data = ProfileData.from_file(files[-1])
        gpu, cpu = [], []
        for plane in data.planes:
            if plane.name.startswith("/device:GPU"):
                lines = [ln for ln in plane.lines if ln.name not in _DERIVED_LINES]
                streams = [ln for ln in lines if ln.name.startswith("Stream")]
                for ln in streams or lines:
                    for ev in ln.events:
                        gpu.append((ev.name, ev.duration_ns * 1e-9, dict(ev.stats)))
            elif plane.name.startswith("/host:CPU"):
                for ln in plane.lines:
                    for ev in ln.events:
                        st = dict(ev.stats)
                        if "hlo_op" in st:
                            cpu.append((ev.name, ev.duration_ns * 1e-9, st))
        return ("gpu", gpu) if gpu else ("cpu", cpu)
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        return "none", []
    with gzip.open(files[-1]) as f:
        trace = json.load(f)
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu_pids = {p for p, n in names.items() if "/device:GPU" in n}
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and (
            e.get("pid") in gpu_pids or (not gpu_pids and "hlo_op" in e.get("args", {}))
        ):
            out.append((e.get("name", ""), e.get("dur", 0) * 1e-6, e.get("args", {})))
    return ("gpu" if gpu_pids else "cpu"), out


def profile_breakdown(trace_dir: str, steps: int, scopes_fn) -> dict:
    """Per-step milliseconds by class (:func:`classify` of the event's ``tf_op``, else of its HLO op's
    metadata from ``scopes_fn()``), the top kernels, and how many events had no scope."""
    where, events = trace_events(trace_dir)
    scopes = None
    by_class = dict.fromkeys(CLASSES, 0.0)
    kernels: dict[str, list] = {}
    unscoped = 0
    samples = []
    for name, secs, st in events:
        # the profiler's own scope stats first; where they name no model scope (on a GPU the ``tf_op`` of a fused
        # kernel can be the fusion's name), the compiled HLO's metadata of the event's HLO op
        scope = str(st.get("tf_op") or st.get("name_scope") or "")
        if scope.startswith("XlaModule:"):  # the module, not a scope (a CUDA graph's kernels carry only this)
            scope = ""
        cls = classify(scope)
        if cls == "rest":
            if scopes is None:
                scopes = scopes_fn()
            hlo_scope = scopes.get(str(st.get("hlo_op") or name), "") or scopes.get(name, "")
            unscoped += not (scope or hlo_scope)
            cls = classify(hlo_scope) if hlo_scope else cls
        if len(samples) < 4 and secs > 0:
            samples.append({"name": name[:80], **{k: str(v)[:160] for k, v in st.items()}})
        by_class[cls] += secs
        k = kernels.setdefault(name[:120], [0.0, cls, 0])
        k[0] += secs
        k[2] += 1
    total = sum(by_class.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "source": where,
        "events": len(events),
        "events_without_scope": unscoped,
        "ms_per_step": {k: v / steps * 1e3 for k, v in by_class.items()},
        "fraction": {k: (v / total if total else None) for k, v in by_class.items()},
        "device_ms_per_step": total / steps * 1e3,
        "event_stats_sample": samples,
        "top_kernels": [
            {
                "name": n,
                "ms_per_step": v[0] / steps * 1e3,
                "class": v[1],
                "calls_per_step": v[2] / steps,
                "hlo_scope": None if scopes is None else scopes.get(n, "")[:200],
            }
            for n, v in top
        ],
    }


def peak_gib() -> float | None:
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (CPU: no statistics)
        return None
    v = st.get("peak_bytes_in_use")
    return None if v is None else round(v / 2**30, 2)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"


# ---------------------------------------------------------------------------------------------- run
def run(args, res: Results) -> None:
    from tokenspeed_jax.models.deepseek import Engine
    from tokenspeed_jax.models.deepseek.steps import _decode_step

    dtype = jnp.dtype(args.dtype)
    cfg = smoke_config() if args.smoke else r1_truncated(args.experts, mtp_layers=args.mtp_layers)
    t = time.perf_counter()
    with res.clock.span() as sp:
        model = device_random_model(cfg, dtype=dtype)
        jax.block_until_ready(jax.tree.leaves(model))
    res.set(
        "model",
        {
            "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "layers": cfg.num_hidden_layers,
            "dense_layers": cfg.first_k_dense_replace,
            "experts": cfg.n_routed_experts,
            "r1_experts": 256,
            "top_k": cfg.num_experts_per_tok,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "mtp_layers": cfg.num_nextn_predict_layers,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "fp8_weights": cfg.quantization_config is not None,
            "dtype": dtype.name,
            "param_bytes_by_dtype": param_bytes(model),
            "built_s": round(time.perf_counter() - t, 1),
            "build_compile_s": sp["seconds"],
            "experts_note": None if args.smoke else EXPERTS_NOTE,
        },
    )
    print(f"model: {res.doc['model']}", flush=True)
    ps = args.page_size
    L = cfg.num_hidden_layers
    compile_guess = args.compile_guess_s
    seen_compile: list[float] = []

    def compile_est():
        return max(seen_compile) if seen_compile else compile_guess

    # ------------------------------------------------------------------------------ decode
    if "decode" in args.sections:
        cmax = max(args.contexts)
        for B in args.batches:
            what = f"B={B}"
            if not res.fits("decode", what, compile_est() + 5 * len(args.contexts)):
                continue
            try:
                eng = Engine(model, page_size=ps, backend=args.backend)
                eng.reset([cmax + args.decode_steps + 2] * B)
            except Exception as e:  # noqa: BLE001
                res.skip("decode", what, f"error: {_err(e)}")
                continue
            tok = jnp.zeros((B, 1), jnp.int32)
            kw = {"backend": args.backend, "page_size": ps}

            def steps(n, C, eng=eng, tok=tok, B=B, kw=kw):
                logits = None
                for i in range(n):
                    pos = jnp.full((B, 1), C + i, jnp.int32)
                    eng.cache, logits = _decode_step(
                        eng.graphdef, eng.state, eng.cache, tok, pos, eng.block_table, **kw
                    )
                return jax.block_until_ready(logits)

            for C in args.contexts:
                what = f"B={B} C={C}"
                if not res.fits("decode", what, 5.0):
                    continue
                try:
                    row = {"batch": B, "context": C}
                    with res.clock.span() as sp:
                        t = time.perf_counter()
                        steps(2, C)
                        row["warmup_s"] = round(time.perf_counter() - t, 2)
                    row["warmup_compile_s"] = sp["seconds"]
                    if sp["seconds"]:
                        seen_compile.append(sp["seconds"])
                    t = time.perf_counter()
                    steps(2, C)
                    est = (time.perf_counter() - t) / 2
                    n = int(min(args.decode_steps, max(4, args.decode_time_s / max(est, 1e-6))))
                    with res.clock.span() as sp:
                        t = time.perf_counter()
                        steps(n, C)
                        step = (time.perf_counter() - t) / n
                    if sp["compiles"]:
                        res.note(f"decode {what}: {sp['compiles']} compilation(s) inside the timed steps")
                    row.update(steps=n, decode_step_ms=step * 1e3, decode_tokens_per_s=B / step)
                    wb = weight_bytes_per_step(model, B)
                    kvb = B * (C + n / 2) * L * cfg.kv_cache_dim * jnp.dtype(eng.kv_dtype).itemsize
                    roof = (wb + kvb) / (args.hbm_tb_s * 1e12)
                    row.update(
                        weight_bytes_per_step=wb,
                        kv_bytes_per_step=int(kvb),
                        roofline_step_ms=roof * 1e3,
                        fraction_of_roofline=roof / step,
                    )
                    row["peak_gib"] = peak_gib()
                    row = res.add("decode", row)  # written now: the profile below only adds to it
                    print(
                        f"decode B={B:3d} C={C:6d}: {step * 1e3:8.3f} ms/step {B / step:10.1f} tok/s, "
                        f"roofline {roof * 1e3:.3f} ms ({roof / step:.1%})",
                        flush=True,
                    )
                    profiled = sum("breakdown" in r for r in res.doc["points"])
                    if args.profile_steps and profiled < args.profile_points and res.budget.allows(10.0):
                        # the profile compiles the step again without CUDA graphs: only when the budget has room
                        allow_compile = res.budget.allows(compile_est() + 10.0)
                        br = _profile_decode(args, eng, tok, B, C, steps, allow_compile)
                        row["breakdown"] = br
                        if "ms_per_step" in br:
                            row.update({f"{k}_ms": v for k, v in br["ms_per_step"].items()})
                            print(f"  breakdown (ms/step): {br['ms_per_step']}", flush=True)
                        res.flush()
                except Exception as e:  # noqa: BLE001  (record the point as failed, go on)
                    res.skip("decode", what, f"error: {_err(e)}")
                    traceback.print_exc()
            eng.cache = None  # free this batch's cache before the next one (``steps`` still holds the engine)
            del eng, steps

    # ------------------------------------------------------------------------------ prefill
    if "prefill" in args.sections:
        groups: dict[tuple[int, int, int], list[int]] = {}
        for C in args.contexts:
            for B in args.batches:
                g = max(1, min(B, args.prefill_step_tokens // C))
                chunk = min(C, args.prefill_step_tokens // g)
                groups.setdefault((C, g, chunk), []).append(B)
        seen_run: list[
            tuple[int, int, float]
        ] = []  # (context, group, seconds) of the measured configurations

        def run_est(C, g):
            """Seconds of one prefill run, scaled from the largest measured one: linearly in the tokens, times
            sqrt(context ratio) for attention (quadratic in the context, but a share of the time that shrinks
            with FlashAttention-4; a 32k prompt against 2 x 4k ones, estimated from FLOPs and bytes: about
            7.5x the time with the xla reference, 4x with FA4; this estimate says 11x)."""
            if not seen_run:
                return 1.0
            c0, g0, t0 = max(seen_run, key=lambda x: x[0] * x[1])
            return t0 * (g * C) / (g0 * c0) * max(1.0, C / c0) ** 0.5

        for (C, g, chunk), batches in groups.items():
            what = f"C={C} g={g}"
            rounds = -(-C // chunk)
            est = compile_est() * min(rounds, 4) + 2 * run_est(C, g) + 5.0
            if not res.fits("prefill", what, est):
                continue
            try:
                eng = Engine(
                    model, page_size=ps, backend=args.backend, prefill_chunk=chunk if chunk < C else None
                )
                rng = np.random.default_rng(0)
                prompts = [rng.integers(0, cfg.vocab_size, C).tolist() for _ in range(g)]
                row = {"context": C, "group": g, "chunk": chunk, "rounds": rounds, "batches": batches}
                with res.clock.span() as sp:
                    eng.reset([C + 1] * g)
                    t = time.perf_counter()
                    jax.block_until_ready(eng.prefill(prompts))
                    row["warmup_s"] = round(time.perf_counter() - t, 2)
                row["warmup_compile_s"] = sp["seconds"]
                if sp["seconds"]:
                    seen_compile.append(sp["seconds"] / rounds)
                times = []
                for _ in range(args.prefill_repeats):
                    if times and not res.budget.allows(2 * times[-1] + 5):
                        break
                    eng.reset([C + 1] * g)
                    with res.clock.span() as sp:
                        t = time.perf_counter()
                        jax.block_until_ready(eng.prefill(prompts))
                        times.append(time.perf_counter() - t)
                    if sp["compiles"]:
                        res.note(f"prefill {what}: {sp['compiles']} compilation(s) inside a timed run")
                dt = min(times)
                seen_run.append((C, g, max(times)))
                row.update(
                    prefill_s=dt, prefill_s_all=times, prefill_tokens_per_s=g * C / dt, peak_gib=peak_gib()
                )
                res.add("prefill", row)
                print(
                    f"prefill C={C:6d} g={g:3d} (chunk {chunk}, batches {batches}): {g * C / dt:10.1f} tok/s "
                    f"({dt:.3f} s)",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001
                res.skip("prefill", what, f"error: {_err(e)}")
                traceback.print_exc()
            eng = None  # free the cache before the next configuration


def _profile_decode(args, eng, tok, B, C, steps, allow_compile: bool = True) -> dict:
    """Breakdown of ``--profile-steps`` decode steps from a jax.profiler trace (errors are recorded).

    Inside a CUDA graph (XLA's command buffers, on by default on a GPU) the profiler reports every kernel under
    the graph's HLO op (``command_buffer_N``) with no named scope, so the breakdown came out nearly all
    ``rest``.  With ``allow_compile`` the profiled steps therefore run an executable of the same step compiled
    again with ``xla_gpu_enable_command_buffer`` empty: each kernel is its own launch and its event carries its
    fusion's scope path (``tf_op``), and the executable's HLO text maps any remaining kernel name to its
    ``op_name`` metadata.  Its step time (``profiled_step_ms``, launch gaps included) is reported beside the
    graph's; the breakdown is device time per kernel class.  Without ``allow_compile`` the graph steps are
    profiled as they are (the classes are then mostly ``rest``)."""
    from tokenspeed_jax.models.deepseek.steps import _decode_step

    d = os.path.join(args.profile_dir, f"B{B}_C{C}_{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    kw = {"backend": args.backend, "page_size": args.page_size}
    text = None
    run = steps
    if allow_compile:
        pos0 = jnp.full((B, 1), C, jnp.int32)
        lowered = _decode_step.lower(eng.graphdef, eng.state, eng.cache, tok, pos0, eng.block_table, **kw)
        opts = {"xla_gpu_enable_command_buffer": ""} if jax.default_backend() == "gpu" else None
        exe = lowered.compile(compiler_options=opts) if opts else lowered.compile()
        text = exe.as_text()

        def run(n, C):
            logits = None
            for i in range(n):
                pos = jnp.full((B, 1), C + i, jnp.int32)
                eng.cache, logits = exe(eng.state, eng.cache, tok, pos, eng.block_table)
            return jax.block_until_ready(logits)

        run(1, C)
    try:
        jax.profiler.start_trace(d)
    except Exception as e:  # noqa: BLE001  (no CUPTI, a trace already running, ...)
        return {"error": f"start_trace: {_err(e)}"}
    try:
        t = time.perf_counter()
        run(args.profile_steps, C)
        profiled_ms = (time.perf_counter() - t) / args.profile_steps * 1e3
    finally:
        jax.profiler.stop_trace()
    try:
        out = profile_breakdown(d, args.profile_steps, lambda: hlo_scopes(text) if text else {})
    except Exception as e:  # noqa: BLE001
        out = {"error": f"breakdown: {_err(e)}", "trace_dir": d}
    out["hlo_metadata_compiled"] = text is not None  # (and, on a GPU, the profiled steps ran without CUDA graphs)
    out["profiled_step_ms"] = profiled_ms
    return out


def table(doc: dict) -> str:
    from benchmarks.runinfo import table as tbl

    dec = [r for r in doc["points"] if r["section"] == "decode"]
    pre = [r for r in doc["points"] if r["section"] == "prefill"]
    out = []
    if dec:
        out.append(
            tbl(
                dec,
                [
                    "batch",
                    "context",
                    "decode_step_ms",
                    "decode_tokens_per_s",
                    "roofline_step_ms",
                    "fraction_of_roofline",
                    "attention_ms",
                    "moe_ms",
                    "dense_mlp_ms",
                    "rest_ms",
                ],
            )
        )
    if pre:
        out.append(
            tbl(
                pre, ["context", "group", "chunk", "batches", "prefill_s", "prefill_tokens_per_s", "warmup_s"]
            )
        )
    return "\n\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--smoke",
        "--tiny",
        dest="smoke",
        action="store_true",
        help="R1-shaped tiny config, small batches / contexts (a CPU check of the script)",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 16 64 (smoke: 1 2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 4096 32768 (smoke: 32 96)")
    ap.add_argument("--sections", default="decode,prefill", help="decode and/or prefill, run in this order")
    ap.add_argument("--experts", type=int, default=32, help="routed experts (R1: 256; module docstring)")
    ap.add_argument(
        "--mtp-layers", type=int, default=1, help="MTP layers resident (R1: 1; plain decode skips them)"
    )
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute / cache dtype"
    )
    ap.add_argument(
        "--prefill-step-tokens", type=int, default=8192, help="tokens per prefill step (smoke: 64)"
    )
    ap.add_argument("--prefill-repeats", type=int, default=1, help="timed prefill runs (the fastest is kept)")
    ap.add_argument("--decode-steps", type=int, default=32, help="most timed decode steps (smoke: 4)")
    ap.add_argument(
        "--decode-time-s", type=float, default=0.5, help="timed decode steps fill about this time"
    )
    ap.add_argument(
        "--profile-steps", type=int, default=4, help="decode steps in the profile (0: no profile)"
    )
    ap.add_argument(
        "--profile-points", type=int, default=100, help="profile the first N decode points (smoke: 1)"
    )
    ap.add_argument("--page-size", type=int, default=64, help="cache page size (smoke: 16)")
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "xla", "sm90", "sm100"],
        help="attention backend (auto: sm90 decode on an H200; sm90 prefill when FlashAttention-4 is "
        "importable, else xla; the JSON records what ran)",
    )
    ap.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth of the roofline (H200 spec)")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="skip points that no longer fit (from start)"
    )
    ap.add_argument(
        "--compile-guess-s",
        type=float,
        default=30.0,
        help="estimated compile time of an unseen step shape, until one is measured (smoke: 5)",
    )
    ap.add_argument("--profile-dir", default="/tmp/deepseek_r1_h200_profile")
    ap.add_argument("--commit", default=None, help="commit to record when the checkout has no .git")
    ap.add_argument(
        "--out", "--json", dest="out", default=None, help="JSON file, rewritten after every point"
    )
    args = ap.parse_args(argv)
    if args.batches is None:
        args.batches = [1, 2] if args.smoke else [1, 16, 64]
    if args.contexts is None:
        args.contexts = [32, 96] if args.smoke else [4096, 32768]
    if args.smoke:
        args.prefill_step_tokens = min(args.prefill_step_tokens, 64)
        args.decode_steps = min(args.decode_steps, 4)
        args.profile_steps = min(args.profile_steps, 2)
        args.profile_points = min(args.profile_points, 1)
        args.page_size = 16
        args.compile_guess_s = min(args.compile_guess_s, 5.0)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = set(args.sections) - {"decode", "prefill"}
    if bad:
        ap.error(f"--sections: expected decode and/or prefill, got {sorted(bad)}")
    res = Results(
        args.out,
        "deepseek_r1_h200",
        {k: v for k, v in vars(args).items() if k != "commit"},
        Budget(args.budget_s),
        commit=args.commit,
    )
    res.set("hbm_tb_s", args.hbm_tb_s)
    with res.running():
        run(args, res)
    print("\n" + table(res.doc))
    print(f"attention backends: {res.backends.line()}")
    for s in res.doc["skipped"]:
        print(f"skipped {s['section']} {s['what']}: {s['reason']}")
    print(f"{res.doc['status']} in {res.doc['elapsed_s']} s" + (f"; wrote {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
