"""GPU correctness of the sm90 MLA decode kernel (``mla_decode(backend="sm90")``) on an H100/H200.

The matrix lives in :data:`benchmarks.decode.CHECK` (one definition for this test and the one-call device
script): S 1..16, H 1..128, page sizes 16/32/64/128, B 1/3/64, lengths 0, 1, S-1, page-1, page+1, 2.5k and
81920, permuted block tables with NaN in every page a request does not own, garbage table entries past
the used ones and a seq_len beyond the table (clamped), causal and non-causal, bf16 and fp16.  Each case
checks out/LSE against the exact fp32 reference (xla backend on fp32-cast inputs) with a tolerance of 2x the
error of the same computation in the input dtype + 1e-3, -inf LSE rows and zero outputs where no key is
visible, finiteness, and bitwise run-to-run determinism, with device memory poisoned (NaN) before each call.  FP8
cases use the FP8 P V tolerance (P rounded to e4m3).  The configs ``select_config`` does not pick for a case but that
run it are checked the same way (``test_sm90_decode_config_matches_reference``).
"""

import os

import pytest


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("sm90_arch")]




def _env_with_xla_flag(flag: str) -> dict:
    """This process's environment with ``flag`` appended to ``XLA_FLAGS`` (for a subprocess)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
    return env


def _cases():
    from benchmarks.decode import CHECK

    return CHECK


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_sm90_decode_matches_reference(case, rng):
    from benchmarks.decode import check

    (r,) = check([case], int(rng.integers(0, 2**31 - 1)))
    assert r["ok"], r


def _config_cases():
    """(config name, case): every named config of ``sm90_decode.CONFIGS`` on each check case it runs, other than the
    one ``select_config`` picks there (the test above covers those)."""
    from benchmarks.decode import config_applies
    from tokenspeed_jax.backends import sm90_decode

    out = []
    for c in _cases():
        for name in sm90_decode.CONFIGS:
            if config_applies(c, name) and not _selected(c, name):
                out.append((name, c))
    return out


def _selected(c, name: str) -> bool:
    from benchmarks.decode import shapes
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.runtime import target_override

    with target_override("sm_90a", num_sms=132):
        prob = _decode_problem(*shapes(c), c.causal, 512, True)
    return sm90_decode.select_config(prob) == sm90_decode.CONFIGS[name]


@pytest.mark.parametrize("config,case", _config_cases(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_sm90_decode_config_matches_reference(config, case, rng):
    """The configs the table does not pick for a check case but that run it (the 16-bit seesaw with or without the
    producer warpgroup on S x H <= 32, where the table picks the transposed loop, or on pages >= 32 without it),
    against the fp32 reference with the same tolerances."""
    from benchmarks.decode import check

    rs = check([case], int(rng.integers(0, 2**31 - 1)), (config,))
    assert len(rs) == 2 and all(r["ok"] for r in rs), rs


def test_new_scale_does_not_recompile(rng):
    import jax
    import jax.numpy as jnp

    from benchmarks.decode import CHECK, decode_fn, make_inputs

    c = CHECK[0]
    q, kv, bt, sl = make_inputs(c, int(rng.integers(0, 2**31 - 1)))
    f = decode_fn(c, "sm90")
    a = f(q, kv, bt, sl, jnp.float32(0.04))[0]
    n = f._cache_size()
    b = f(q, kv, bt, sl, jnp.float32(0.05))[0]
    assert f._cache_size() == n
    assert not bool(jnp.array_equal(a, b))
    jax.block_until_ready(b)


@pytest.mark.skipif(os.environ.get("TOKENSPEED_SANITIZER") != "1", reason="opt-in: TOKENSPEED_SANITIZER=1 (slow)")
def test_memcheck_small_shapes():
    """compute-sanitizer memcheck of our three kernels (schedule, main, combine) on shapes with garbage block-table
    entries, a seq_len beyond the table, NaN pages, BF16 and FP8, and both combine layouts (2-8 splits and
    16 splits), and on int32 lengths and page ids out of range (``test_hostile_sm90.int32_out_of_range``).  Only
    kernels whose name contains ``MlaDecode`` are checked (XLA's own kernels are out of scope); every entry point of
    our decode kernels carries that substring (``tests/test_compile_sm90_decode.py`` asserts it on the PTX; the
    schedule kernel's class is named ``MlaDecodeScheduleKernel`` so that it is checked too)."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not found")
    names = ("s2h32p64_garbage", "fp8_s2h32p32_garbage", "b1s1h16p64_short", "s4h32p32", "fp8_s1h32p32_garbage",
             "s2h16p32_garbage")
    from benchmarks.decode import CHECK, Case, prewarm

    # the kernels compiled first in CPU workers, outside the sanitizer (under it a compile takes minutes; the check's
    # shapes and the two int32 cases' shapes, S 3 / H 16, page 64 bf16 and page 16 FP8)
    prewarm([c for c in CHECK if c.name in names] + [Case("i32_bf16", "bfloat16", 4, 3, 16, 64, 8),
                                                     Case("i32_fp8", "float8_e4m3fn", 4, 3, 16, 16, 16)], 4)
    code = ("import sys; from benchmarks.decode import CHECK, check; "
            "from tests.gpu.test_hostile_sm90 import int32_out_of_range; "
            "int32_out_of_range(5, 64, 'bfloat16'); int32_out_of_range(6, 16, 'float8_e4m3fn'); "
            f"r = check([c for c in CHECK if c.name in {names!r}], 5); "
            "sys.exit(0 if r and all(x['ok'] for x in r) else 3)")
    # XLA's GEMM autotuning (the fp32 reference's dots) under the sanitizer made this test time out and the
    # sanitizer segfault on the H200 (2026-11-30, "Very slow compile" of gemm fusions); it is irrelevant here
    env = _env_with_xla_flag("--xla_gpu_autotune_level=0")
    p = subprocess.run([exe, "--tool", "memcheck", "--error-exitcode", "9", "--kernel-name", "kns=MlaDecode",
                        sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=False,
                       env=env)
    print((p.stdout + p.stderr)[-1500:])  # the check's table and the sanitizer's summary (pytest -s)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in p.stdout + p.stderr, p.stdout[-4000:]


_GRAPH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import tokenspeed_jax as tj
rng = np.random.default_rng(0)
B, S, H, page, max_pages = 1, 1, 16, 64, 160  # one request of 10k tokens: split over the GPU (PDL combine)
q = jnp.asarray(rng.standard_normal((B, S, H, 576)), jnp.bfloat16)
kv = jnp.asarray(rng.standard_normal((B * max_pages, page, 576)), jnp.bfloat16)
bt = jnp.asarray(rng.permutation(B * max_pages).reshape(B, max_pages), jnp.int32)
sl = jnp.array([10000], jnp.int32)
@jax.jit
def f(q, s):
    def body(c, _):
        o = tj.mla_decode(q + c, kv, bt, sl, softmax_scale=s, backend="sm90")
        return c + o[..., :1].mean().astype(c.dtype) * 0, o
    return jax.lax.scan(body, jnp.zeros((), q.dtype), None, length=3)[1]
a = f(q, jnp.float32(0.07)); b = f(q, jnp.float32(0.07))
ref = tj.mla_decode(q.astype(jnp.float32), kv.astype(jnp.float32), bt, sl, softmax_scale=0.07, backend="xla")
assert np.array_equal(np.asarray(a), np.asarray(b))
err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - ref[None].astype(jnp.float32))))
txt = f.lower(q, jnp.float32(0.07)).compile().as_text()
print("GRAPH_OK", err, "command_buffer" in txt)
"""


def test_inside_cuda_graph():
    """XLA captures the decode custom call (main kernel + PDL-launched combine kernel) in a command buffer
    (CUDA graph) inside a loop body; results equal the fp32 reference and repeat bitwise."""
    import subprocess
    import sys
    from pathlib import Path

    env = _env_with_xla_flag("--xla_gpu_graph_min_graph_size=1")
    p = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT], env=env, cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("GRAPH_OK")][-1].split()
    assert float(line[1]) < 2e-2, line
    print("command buffer in HLO:", line[2])


_GRAPH_LENS_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import tokenspeed_jax as tj
rng = np.random.default_rng(1)
B, S, H, page, max_pages = 48, 2, 16, 64, 40
q = jnp.asarray(rng.standard_normal((B, S, H, 576)), jnp.bfloat16)
kv = jnp.asarray(rng.standard_normal((B * max_pages, page, 576)), jnp.bfloat16)
bt = jnp.asarray(rng.permutation(B * max_pages).reshape(B, max_pages), jnp.int32)
lens = jnp.asarray(np.stack([rng.integers(0, max_pages * page + 1, B) for _ in range(3)]), jnp.int32)
@jax.jit
def f(q, lens):
    def body(c, sl):
        return c, tj.mla_decode(q, kv, bt, sl, softmax_scale=0.07, backend="sm90")
    return jax.lax.scan(body, 0, lens)[1]
a = f(q, lens); b = f(q, lens[::-1])
err = 0.0
for i in range(3):
    ref = tj.mla_decode(q.astype(jnp.float32), kv.astype(jnp.float32), bt, lens[i], softmax_scale=0.07, backend="xla")
    err = max(err, float(jnp.max(jnp.abs(a[i].astype(jnp.float32) - ref))),
              float(jnp.max(jnp.abs(b[2 - i].astype(jnp.float32) - ref))))
print("GRAPH_LENS_OK", err)
"""


def test_cuda_graph_replay_with_changing_lengths():
    """The schedule is computed inside the graph from each step's lengths: one executable (a command buffer in a
    loop body) replayed over three different length vectors, in two orders, matches the fp32 reference each time."""
    import subprocess
    import sys
    from pathlib import Path

    env = _env_with_xla_flag("--xla_gpu_graph_min_graph_size=1")
    p = subprocess.run([sys.executable, "-c", _GRAPH_LENS_SCRIPT], env=env, cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("GRAPH_LENS_OK")][-1].split()
    assert float(line[1]) < 2e-2, line


def test_shared_work_bitwise_and_one_object_for_every_batch(rng):
    """``mla_decode(work=mla_decode_work(...))`` is bitwise ``mla_decode(...)``; batches of other sizes and table
    widths run the first call's compiled object (no further compile: the custom call reads its extents at run
    time) and match the fp32 reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tokenspeed_jax as tj
    from tokenspeed_jax.ffi.compile_cache import cache_stats

    kw = dict(softmax_scale=0.07, backend="sm90")
    with_work = jax.jit(lambda q, kv, bt, sl: tj.mla_decode(q, kv, bt, sl, **kw,
                                                            work=tj.mla_decode_work(q, kv, bt, sl, backend="sm90")))
    plain = jax.jit(lambda q, kv, bt, sl: tj.mla_decode(q, kv, bt, sl, **kw))
    misses = None
    for B, max_pages in ((3, 40), (17, 9), (64, 130), (1, 2)):
        page = 64
        q = jnp.asarray(rng.standard_normal((B, 2, 16, 576)), jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((B * max_pages, page, 576)), jnp.bfloat16)
        bt = jnp.asarray(rng.permutation(B * max_pages).reshape(B, max_pages), jnp.int32)
        sl = jnp.asarray(rng.integers(0, max_pages * page + 1, B), jnp.int32)
        a, b = with_work(q, kv, bt, sl), plain(q, kv, bt, sl)
        assert np.array_equal(np.asarray(a), np.asarray(b)), (B, max_pages)
        ref = tj.mla_decode(q.astype(jnp.float32), kv.astype(jnp.float32), bt, sl, softmax_scale=0.07, backend="xla")
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - ref))) < 2e-2, (B, max_pages)
        if misses is None:
            misses = cache_stats()["misses"]
        assert cache_stats()["misses"] == misses, (B, max_pages, cache_stats())


# (dtype, S, H, page): the batch-invariant mode on the 16-bit and FP8 loops, S = 1 and S = 4 causal, pages 64 and 16
_INVARIANT_CASES = [("bfloat16", 1, 16, 64), ("bfloat16", 4, 32, 64), ("float8_e4m3fn", 1, 16, 64),
                    ("float8_e4m3fn", 4, 32, 64), ("bfloat16", 1, 128, 16)]
# the requests followed through the batches: empty, shorter than S, inside one piece, at and around the piece length
# of either chunk (4096, 8192), several pieces, and one long request
_INVARIANT_TARGETS = (0, 3, 100, 4095, 4096, 4097, 8192, 8193, 3 * 8192 + 77, 50000)


@pytest.mark.parametrize("dtype,S,H,page", _INVARIANT_CASES, ids=lambda x: str(x))
def test_batch_invariant_bitwise(dtype, S, H, page, rng):
    """``mla_decode(batch_invariant=True)``: each followed request's output and LSE are bitwise the same alone (a
    batch of the targets alone) and inside batches of 2 / 8 / 64 / 128 requests with random other lengths (0 to
    40k, empty ones included), at random positions, with other table widths and its pages at other page ids (the
    cache permuted); and they match the fp32 reference at the check matrix's tolerances."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from types import SimpleNamespace

    import tokenspeed_jax as tj
    from benchmarks.decode import FP8_P_ROUND, fp8_qk_lse_slack, p_round_spread

    scale = jnp.float32(576 ** -0.5)
    targets = np.array(_INVARIANT_TARGETS, np.int64)
    T = len(targets)
    num_pages = (262144 // page) + 8
    width0 = -(-int(targets.max()) // page) + 3
    key = jax.random.PRNGKey(int(rng.integers(0, 2**31 - 1)))
    kv = jax.random.normal(key, (num_pages, page, 576), jnp.float32).astype(dtype)
    qt = jnp.asarray(rng.standard_normal((T, S, H, 576)), jnp.float32).astype(dtype)
    bt_t = rng.integers(0, num_pages, (T, width0))  # the targets' pages (random, shared pages allowed)

    @jax.jit
    def run(q, kv, bt, sl):
        return tj.mla_decode(q, kv, bt, sl, softmax_scale=scale, backend="sm90", return_lse=True,
                             batch_invariant=True, work=tj.mla_decode_work(q, kv, bt, sl, backend="sm90",
                                                                           batch_invariant=True))

    def batch(B, width, perm=None):
        """A batch of ``B`` requests holding the targets (all of them, or the first ``B // 2`` when fewer fit) at
        random positions among random others; ``width`` >= width0 table columns; ``perm``: page ids relabelled."""
        n_t = min(T, max(1, B // 2))
        pick = rng.permutation(T)[:n_t]
        pos = rng.permutation(B)[:n_t]
        lens = rng.integers(0, 40001, B)
        lens[rng.random(B) < 0.1] = 0
        lens = np.minimum(lens, width * page)
        bt = rng.integers(0, num_pages, (B, width))
        q = jnp.asarray(rng.standard_normal((B, S, H, 576)), jnp.float32).astype(dtype)
        lens[pos] = targets[pick]
        bt[pos, :width0] = bt_t[pick]
        q = q.at[pos].set(qt[pick])
        kvb = kv
        if perm is not None:  # page p's content now at id perm[p]
            inv = np.argsort(perm)
            kvb = kv[jnp.asarray(inv)]
            bt = perm[bt]
        out, lse = run(q, kvb, jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32))
        return pick, np.asarray(out[pos].astype(jnp.float32)), np.asarray(lse[pos])

    alone_o, alone_l = run(qt, kv, jnp.asarray(bt_t, jnp.int32), jnp.asarray(targets, jnp.int32))
    alone_o, alone_l = np.asarray(alone_o.astype(jnp.float32)), np.asarray(alone_l)
    for i in range(T):  # each target alone, B = 1
        o1, l1 = run(qt[i:i + 1], kv, jnp.asarray(bt_t[i:i + 1], jnp.int32),
                     jnp.asarray(targets[i:i + 1], jnp.int32))
        assert np.array_equal(np.asarray(o1.astype(jnp.float32))[0], alone_o[i], equal_nan=True), (i, targets[i])
        assert np.array_equal(np.asarray(l1)[0], alone_l[i], equal_nan=True), (i, targets[i])
    runs = [(2, width0, None), (8, width0 + 5, None), (64, width0 + 40, rng.permutation(num_pages)),
            (128, width0, None), (128, width0 + 1, rng.permutation(num_pages))]
    for B, width, perm in runs:
        pick, o, lse = batch(B, width, perm)
        for j, i in enumerate(pick):
            assert np.array_equal(o[j], alone_o[i], equal_nan=True), (B, width, targets[i])
            assert np.array_equal(lse[j], alone_l[i], equal_nan=True), (B, width, targets[i])

    # the fp32 reference, at the tolerances of benchmarks.decode.check
    f32 = jnp.float32
    bt_j, sl_j = jnp.asarray(bt_t, jnp.int32), jnp.asarray(targets, jnp.int32)
    ro, rl = tj.mla_decode(qt.astype(f32), kv.astype(f32), bt_j, sl_j, softmax_scale=scale, backend="xla",
                           return_lse=True)
    ro, rl = np.asarray(ro), np.asarray(rl)
    xo = np.asarray(jnp.asarray(ro).astype("bfloat16" if dtype == "float8_e4m3fn" else dtype).astype(f32))
    tol_o = 2 * float(np.nanmax(np.abs(xo - ro))) + 1e-3
    c = SimpleNamespace(dtype=dtype, causal=True)
    if dtype == "float8_e4m3fn":
        tol_o = tol_o + FP8_P_ROUND * p_round_spread(c, qt, kv, bt_j, sl_j, scale)
    assert np.all(np.abs(alone_o - ro) <= tol_o), float(np.max(np.abs(alone_o - ro)))
    assert np.array_equal(np.isneginf(alone_l), np.isneginf(rl))
    fin = np.isfinite(rl)
    ltol = 1e-3 + 1e-4 * float(np.max(np.abs(rl[fin]), initial=0)) + fp8_qk_lse_slack(c, qt, kv, scale)
    assert np.all(np.abs(alone_l[fin] - rl[fin]) <= (ltol[fin] if np.ndim(ltol) else ltol))
    assert np.all(alone_o[np.isneginf(rl)] == 0) and np.all(np.isfinite(alone_o))


_SCHED_SPECS = [(132, "choose", 0), (132, "balanced", 0), (132, "per_request", 0), (66, "choose", 0), (1, "choose", 0),
                (132, "choose", 4096), (66, "choose", 8192)]


@pytest.mark.parametrize("num_ctas,mode,chunk", _SCHED_SPECS, ids=lambda x: str(x))
def test_schedule_kernel_matches_jnp(num_ctas, mode, chunk, rng):
    """The CuTe DSL schedule kernel (``decode_schedule(..., cuda_kernel=True)`` on CUDA) gives the jnp schedule's
    arrays bit for bit: batch sizes 1-2049 (the prefixes in shared memory up to ``SMEM_BATCH``, in global memory
    past it), empty requests, lengths past the capacity and below 0, full-length batches, capacities 64-131072 and
    per-request cuts 1-39, one compiled object for all of them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tokenspeed_jax.decode_schedule import ScheduleSpec, decode_schedule
    from tokenspeed_jax.kernels.sm90.schedule import SMEM_BATCH

    for i in range(12):
        B = int(rng.choice([1, 2, 3, 64, 130, 257, 1100]))
        if i in (1, 2):  # the largest batch whose prefixes stay in shared memory, and the first past it
            B = SMEM_BATCH + i - 1
        cap = int(rng.choice([64, 1000, 4096, 81920, 131072]))
        sl = rng.integers(-5, cap + 300, B).astype(np.int32)
        if i % 3 == 0:
            sl[rng.random(B) < 0.5] = 0
        if i % 5 == 0:
            sl[:] = cap
        spec = ScheduleSpec(num_ctas=num_ctas, capacity=cap, split_units=int(rng.integers(1, 40)), fixed_cost=5,
                            unit=64, mode=mode, chunk=chunk)
        got = jax.jit(lambda s: decode_schedule(s, spec, cuda_kernel=True))(jnp.asarray(sl))
        want = jax.jit(lambda s: decode_schedule(s, spec))(jnp.asarray(sl))
        for g, w, name in zip(got, want, ("cta", "req")):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name}: B={B} cap={cap} {spec}")
