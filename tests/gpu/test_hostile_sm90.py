"""Hostile NaN / Inf placement on the sm90 backend (issue 34), H100/H200: the CPU cases of ``tests/test_hostile.py``
that the kernels must hold, against the float64 visible-keys-only reference (:mod:`tests.hostile_ref`); NaN / Inf
positions must match exactly, values within a loose bound (the kernels round P to 16 bits, or to FP8 in some FP8 P V
modes; values are O(1)).

Decode (bf16 and fp8, pages 16 and 64, MTP S = 3, H = 16, R1 dims 512 + 64): NaN in unowned pages, past ``seq_len``
in owned pages, in the causally masked keys of an MTP step (tokens 0 and 1 cannot see the last key; S = 2 and 3 for
every loop, the hidden keys straddling a tile boundary), a non-finite ``output_scale`` (empty rows exactly 0), a
uint32 ``2**32 - 1`` length (clamped to the capacity, never wrapped to 0), int32 lengths and page ids out of range
(clamped by the kernels themselves). Prefill (bf16, Dqk 192 / Dv 128, 16
heads): NaN / Inf in every k and v row past ``cu_seqlens_k[-1]`` (the 127 rows FA4 reads there included: finite by
construction, the backend zeroes them), NaN q rows outside every request (0 / LSE -inf), and a NaN v row 200 rows
into a request (other requests exact; the rows that see it NaN; its own request's rows that do not see it may follow
it, the documented kernel contract of ``tokenspeed_jax.prefill``).

Few compiles: decode 8 (2 dtypes x 2 page sizes x S = 3 and S = 2), prefill 2 (causal, full); every case reuses
them. Run: ``pytest -q tests/gpu/test_hostile_sm90.py``."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.conftest import needs_sm90_prefill


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("sm90_arch")]

NAN, INF = np.nan, np.inf




def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Leave NaN in freed device memory so outputs the kernel fails to write are likely to show NaN."""
    import jax.numpy as jnp

    x = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def check(got, want, *, atol, dtype="bfloat16"):
    """Output within ``atol`` (+ one output ulp), and where ``want`` carries the P-rounding spread (FP8 decode:
    ``_run_decode``) within ``atol`` plus the FP8 P V tolerance on it (``benchmarks.decode.FP8_P_ROUND``, the check
    matrix's); LSE within 1e-4 relative + 2e-3."""
    from benchmarks.decode import FP8_P_ROUND
    from tests import reference as ref

    (o, l), (ro, rl, *spr) = got, want
    if spr:
        atol = atol + FP8_P_ROUND * np.nan_to_num(spr[0], nan=0.0, posinf=0.0)
    ref.assert_close(np.asarray(o, np.float32), ro, dtype=dtype, atol=atol, what="out")
    ref.assert_close(np.asarray(l), rl, dtype="float32", rtol=1e-4, atol=2e-3, what="lse")


# ----------------------------------------------------------------------------------------- decode
L, R, S, H = 512, 64, 3, 16
LENS = (1, 90, 0, 200)  # request 0: tokens 0, 1 see nothing; request 2: empty


@functools.cache
def _decode_fn():
    import jax

    import tokenspeed_jax as tj

    return jax.jit(lambda q, kv, bt, sl, ss, os_: tj.mla_decode(
        q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=True, kv_lora_rank=L, return_lse=True,
        backend="sm90"))


def _decode_inputs(seed, page, dtype, lens=LENS, s=S, h=H):
    from tests import reference as ref

    rng = np.random.default_rng(seed)
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=list(lens), S=s, H=h, L=L, R=R, page_size=page,
                                           dtype=dtype)
    return np.array(q), np.array(kv), bt, sl


def _run_decode(q, kv, bt, sl, os_=1.0):
    import jax.numpy as jnp

    from tests import hostile_ref as HR

    poison_allocator()
    got = _decode_fn()(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(bt), jnp.asarray(sl), jnp.float32(0.04),
                       jnp.float32(os_))
    slc = np.clip(np.asarray(sl).astype(np.int64), 0, bt.shape[1] * kv.shape[1])
    fp8 = kv.dtype.itemsize == 1  # (the P V on FP8 tensor cores: P rounded to e4m3, check's spread term)
    want = HR.decode(q, kv, np.clip(bt, 0, kv.shape[0] - 1), slc, softmax_scale=np.float32(0.04),
                     output_scale=os_, causal=True, kv_lora_rank=L, spread=fp8)
    return got, want


def _row(bt, b, j, page):
    return int(bt[b, j // page]), j % page


DECODE_ATOL = {"bfloat16": 2e-2, "float8_e4m3fn": 5e-2}
CONFIGS = [(p, d) for d in ("bfloat16", "float8_e4m3fn") for p in (16, 64)]


@pytest.mark.parametrize("page,dtype", CONFIGS, ids=[f"p{p}-{d[:4]}" for p, d in CONFIGS])
def test_decode_nan_unowned_and_past_seq_len(page, dtype, rng):
    """make_decode_inputs leaves NaN in every row a request does not own: other requests' pages, spare
    pages, and the rows of its own last page past seq_len; garbage table entries past the used pages."""
    q, kv, bt, sl = _decode_inputs(int(rng.integers(2**31)), page, dtype)
    got, want = _run_decode(q, kv, bt, sl)
    check(got, want, atol=DECODE_ATOL[dtype])
    assert np.isfinite(np.asarray(got[0], np.float32)).all()


@pytest.mark.parametrize("page,dtype", CONFIGS, ids=[f"p{p}-{d[:4]}" for p, d in CONFIGS])
def test_decode_nan_in_causally_masked_keys(page, dtype, rng):
    """MTP S = 3: the last key of a request is visible to token 2 only, the one before to tokens 1 and 2.
    NaN there must not reach token 0 (nor token 1 for the last key)."""
    q, kv, bt, sl = _decode_inputs(int(rng.integers(2**31)), page, dtype)
    kv[_row(bt, 1, 89, page)] = NAN
    kv[_row(bt, 3, 198, page)] = NAN
    got, want = _run_decode(q, kv, bt, sl)
    check(got, want, atol=DECODE_ATOL[dtype])
    out = np.asarray(got[0], np.float32)
    assert np.isfinite(out[1, :2]).all() and np.isnan(out[1, 2]).all()
    assert np.isfinite(out[3, 0]).all() and np.isnan(out[3, 1:]).all()


HIDDEN_LENS = (129, 64, 3, 200, 70)  # 129: the hidden keys straddle the tiles at 128; 3: as short as S
HIDDEN_SH = ((2, 16), (3, 16))  # (S, H): 32 rows (the transposed loops on 64-token pages), 48 (the 64-row ones)


@pytest.mark.parametrize("s,h", HIDDEN_SH, ids=[f"S{s}-H{h}" for s, h in HIDDEN_SH])
@pytest.mark.parametrize("page,dtype", CONFIGS, ids=[f"p{p}-{d[:4]}" for p, d in CONFIGS])
def test_decode_nan_in_hidden_keys_every_loop(page, dtype, s, h, rng):
    """NaN in the first key requests 0-3 hide from their token 0 (``seq_len - S + 1``; 32 rows run the transposed
    loops, 48 the seesaw / 64-row O^T ones), and in request 4's last key: token 0 stays finite (request 4's tokens
    before the last too), every token that sees a NaN key is NaN, the rest match the reference."""
    q, kv, bt, sl = _decode_inputs(int(rng.integers(2**31)), page, dtype, HIDDEN_LENS, s, h)
    for b, n in enumerate(HIDDEN_LENS[:4]):
        kv[_row(bt, b, n - s + 1, page)] = NAN
    kv[_row(bt, 4, HIDDEN_LENS[4] - 1, page)] = NAN
    got, want = _run_decode(q, kv, bt, sl)
    check(got, want, atol=DECODE_ATOL[dtype])
    out = np.asarray(got[0], np.float32)
    assert np.isfinite(out[:4, 0]).all() and np.isnan(out[:4, 1:]).all()
    assert np.isfinite(out[4, :s - 1]).all() and np.isnan(out[4, s - 1]).all()


@pytest.mark.parametrize("page,dtype", CONFIGS, ids=[f"p{p}-{d[:4]}" for p, d in CONFIGS])
def test_decode_nonfinite_output_scale_keeps_empty_rows_zero(page, dtype, rng):
    q, kv, bt, sl = _decode_inputs(int(rng.integers(2**31)), page, dtype)
    for os_ in (NAN, INF):
        got, want = _run_decode(q, kv, bt, sl, os_)
        out = np.asarray(got[0], np.float32)
        assert (out[2] == 0).all() and (out[0, :2] == 0).all()
        from tests import reference as ref

        ref.assert_close(np.asarray(got[1]), want[1], dtype="float32", rtol=1e-4, atol=2e-3, what="lse")
        # every row that sees a key is non-finite (NaN, or +-inf whose sign is that of a product rounded near 0,
        # so not compared element by element)
        seen = np.isfinite(want[1])
        assert not np.isfinite(out[seen]).any()


@pytest.mark.parametrize("page,dtype", CONFIGS[:1], ids=["p16-bflo"])
def test_decode_uint32_length_clamps_to_capacity(page, dtype, rng):
    q, kv, bt, sl = _decode_inputs(int(rng.integers(2**31)), page, dtype)
    kv = np.where(np.isnan(kv.astype(np.float32)), 0, kv).astype(kv.dtype)  # (np.nan_to_num skips bf16)
    # a length at the capacity reads every row the table names: all finite now
    sl = np.array([2**32 - 1, 90, 0, 200], np.uint32)
    got, want = _run_decode(q, kv, bt, sl)
    check(got, want, atol=DECODE_ATOL[dtype])
    assert np.isfinite(np.asarray(got[1])[0]).all()  # not wrapped to length 0 (LSE -inf)


def int32_out_of_range(seed: int, page: int, dtype: str) -> None:
    """int32 lengths and table entries out of range reach the sm90 kernels unclamped (``mla_decode`` leaves int32
    arrays to them: ``decode_clamps_indices``): lengths -5, ``2**31 - 1`` (the capacity) and ``-2**31``; page ids
    -1, ``num_pages``, ``2**31 - 1`` and ``-2**31`` inside the used pages of request 3.  The result must be the
    documented clamp's (the float64 reference on clamped inputs; NaN rows zeroed so that every page read is finite).
    Also run under compute-sanitizer memcheck (``tests/gpu/test_sm90_decode.py::test_memcheck_small_shapes``)."""
    q, kv, bt, sl = _decode_inputs(seed, page, dtype)
    kv = np.where(np.isnan(kv.astype(np.float32)), 0, kv).astype(kv.dtype)
    bt = np.asarray(bt, np.int32).copy()
    for j, v in enumerate((-1, kv.shape[0], 2**31 - 1, -2**31)):
        bt[3, j * -(-200 // page) // 4] = v  # (inside the pages of request 3's 200 tokens)
    sl = np.array([-5, 2**31 - 1, -2**31, 200], np.int32)
    got, want = _run_decode(q, kv, bt, sl)
    check(got, want, atol=DECODE_ATOL[dtype])
    out, lse = np.asarray(got[0], np.float32), np.asarray(got[1])
    assert (out[[0, 2]] == 0).all() and (lse[[0, 2]] == -np.inf).all()
    assert np.isfinite(out[[1, 3]]).all()


@pytest.mark.parametrize("page,dtype", CONFIGS, ids=[f"p{p}-{d[:4]}" for p, d in CONFIGS])
def test_decode_int32_out_of_range_clamped_in_kernel(page, dtype, rng):
    int32_out_of_range(int(rng.integers(2**31)), page, dtype)


# ---------------------------------------------------------------------------------------- prefill
LQ, LK = (100, 300, 64), (150, 300, 64)
TQ, TK = sum(LQ) + 40, sum(LK) + 200  # 40 q rows and 200 k/v rows outside every request
HQ = HK = 16


@functools.cache
def _prefill_fn(causal):
    import jax

    import tokenspeed_jax as tj

    return jax.jit(lambda q, k, v, cq, ck, ss: tj.mla_prefill(q, k, v, cq, ck, softmax_scale=ss, causal=causal,
                                                              return_lse=True, backend="sm90"))


def _prefill_inputs(seed):
    from tests import reference as ref

    rng = np.random.default_rng(seed)
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=LQ, lens_k=LK, Hq=HQ, Hk=HK, Dqk=192, Dv=128,
                                              dtype="bfloat16", pad_q=TQ - sum(LQ), pad_k=TK - sum(LK))
    return np.array(q), np.array(k), np.array(v), cq, ck  # k / v rows past the last request: NaN


def _run_prefill(q, k, v, cq, ck, causal):
    import jax.numpy as jnp

    from tests import hostile_ref as HR

    poison_allocator()
    ss = 192**-0.5
    got = _prefill_fn(causal)(*(jnp.asarray(x) for x in (q, k, v, cq, ck)), jnp.float32(ss))
    want = HR.prefill(q, k, v, cq, ck, softmax_scale=np.float32(ss), causal=causal)
    return got, want


@needs_sm90_prefill()
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_prefill_nonfinite_tail_rows_are_never_a_precondition(causal, rng):
    """NaN k and NaN / +-Inf v in every row past cu_seqlens_k[-1] (so in the 127 FA4 reads): the output is
    the reference's, finite for every request (the sm90 backend zeroes the V rows it reads there)."""
    q, k, v, cq, ck = _prefill_inputs(int(rng.integers(2**31)))
    end = int(ck[-1])
    v[end::3], v[end + 1::3] = INF, -INF
    assert np.isnan(k[end:].astype(np.float32)).all() and not np.isfinite(v[end:].astype(np.float32)).any()
    q[int(cq[-1]):] = NAN  # q rows outside every request: 0 / LSE -inf whatever they hold
    got, want = _run_prefill(q, k, v, cq, ck, causal)
    check(got, want, atol=1e-2)
    out = np.asarray(got[0], np.float32)
    assert np.isfinite(out).all() and (out[int(cq[-1]):] == 0).all()
    assert np.isneginf(np.asarray(got[1])[int(cq[-1]):]).all()


@needs_sm90_prefill()
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_prefill_nan_v_row_stays_in_its_request(causal, rng):
    """NaN in the v row 200 keys into request 1 (beyond the 127 rows request 0's tiles read past its end):
    requests 0 and 2 and the rows outside every request are exactly the reference's; request 1's rows that
    see the key are NaN; its rows that do not see it are the reference's or NaN (kernel tiles, documented)."""
    q, k, v, cq, ck = _prefill_inputs(int(rng.integers(2**31)))
    bad = int(ck[1]) + 200
    v[bad, 3] = NAN
    got, want = _run_prefill(q, k, v, cq, ck, causal)
    out, lse = (np.asarray(x, np.float32) for x in got)
    r_out, r_lse = want
    lo, hi = int(cq[1]), int(cq[2])
    others = np.r_[0:lo, hi:out.shape[0]]
    check((out[others], lse[others]), (r_out[others], r_lse[others]), atol=1e-2)
    sees = np.isnan(r_out[lo:hi, 3, 0])
    assert sees.any() and np.isnan(out[lo:hi][sees][:, 3]).all()
    mine = out[lo:hi][~sees]
    close = np.isnan(mine) | (np.abs(mine - r_out[lo:hi][~sees]) <= 1e-2 + 2**-7 * np.abs(r_out[lo:hi][~sees]))
    assert close.all()
    heads = np.r_[0:3, 4:HQ]  # the other heads never read v head 3: exact
    check((out[lo:hi, heads], lse[lo:hi, heads]), (r_out[lo:hi, heads], r_lse[lo:hi, heads]), atol=1e-2)
