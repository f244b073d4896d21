"""Independent float64 NumPy reference of the tokenspeed-jax ops, written from the API text of issue 2.

Nothing here imports tokenspeed_jax: these functions are the oracle the xla backend (and through it the
GPU kernels) are checked against.  Everything is computed in float64 with plain per-request loops; inputs
of any dtype (bf16 / fp16 / float8_e4m3fn through ml_dtypes, float32) are widened exactly to float64.

Semantics (issue 2, "Public API"):

* decode: token ``j`` of request ``b`` is ``kv_cache[block_table[b, j // page_size], j % page_size]``;
  ``s_j = softmax_scale * <q, kv_j>`` over all D dims; ``out = output_scale * softmax(s) @ kv[:, :L]``;
  causal: query ``i`` of ``S`` sees ``j < seq_len - S + 1 + i``; otherwise ``j < seq_len``.
* prefill: ragged; query ``i`` of a request with ``Lq`` queries / ``Lk`` keys sees ``j <= i + Lk - Lq``
  under causal; query head ``h`` uses KV head ``h // (Hq / Hk)``.
* a row that sees no key: output 0, LSE ``-inf``.  LSE is the natural log and ignores output_scale.
* merge: exact combination of two partial attentions over disjoint key sets.
* FP8 (e4m3): stored value = ``x / scale`` saturated to +-448, rounded to nearest (even).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def f64(x) -> np.ndarray:
    """Exact widening of any (jax / numpy / ml_dtypes) array to float64."""
    return np.asarray(x).astype(np.float64)


def _attend(qrows: np.ndarray, keys: np.ndarray, vals: np.ndarray, scale: float):
    """qrows [R, D] over keys [n, D] / vals [n, Dv] -> (out [R, Dv], lse [R]); n may be 0."""
    R = qrows.shape[0]
    if keys.shape[0] == 0:
        return np.zeros((R, vals.shape[1])), np.full((R,), -np.inf)
    s = scale * (qrows @ keys.T)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    den = p.sum(axis=1)
    return (p @ vals) / den[:, None], m[:, 0] + np.log(den)


def mla_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, output_scale=1.0, causal=True,
               kv_lora_rank=512):
    """Returns (out [B, S, H, L] float64, lse [B, S, H] float64)."""
    q = f64(q)
    kv = f64(kv_cache)
    bt = np.asarray(block_table)
    sl = np.asarray(seq_lens)
    B, S, H, D = q.shape
    ps = kv.shape[1]
    L = kv_lora_rank
    out = np.zeros((B, S, H, L))
    lse = np.full((B, S, H), -np.inf)
    for b in range(B):
        n_b = int(sl[b])
        j = np.arange(max(n_b, 0))
        keys = kv[bt[b, j // ps], j % ps] if n_b > 0 else np.zeros((0, D))
        for i in range(S):
            n = n_b - S + 1 + i if causal else n_b
            n = max(0, min(n, n_b))
            o, s = _attend(q[b, i], keys[:n], keys[:n, :L], float(softmax_scale))
            out[b, i] = float(output_scale) * o
            lse[b, i] = s
    return out, lse


def mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal=True):
    """Returns (out [Tq, Hq, Dv] float64, lse [Tq, Hq] float64); rows outside every request: 0 / -inf."""
    q, k, v = f64(q), f64(k), f64(v)
    cq = np.asarray(cu_seqlens_q).astype(np.int64)
    ck = np.asarray(cu_seqlens_k).astype(np.int64)
    Tq, Hq, _ = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    scale = float(softmax_scale)
    out = np.zeros((Tq, Hq, v.shape[2]))
    lse = np.full((Tq, Hq), -np.inf)
    for b in range(len(cq) - 1):
        Lq, Lk = int(cq[b + 1] - cq[b]), int(ck[b + 1] - ck[b])
        if Lq <= 0:
            continue
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        vis = (j <= i + Lk - Lq) if causal else np.ones((Lq, Lk), bool)
        seen = vis.any(axis=1)
        for h in range(Hq):
            qs = q[cq[b]:cq[b + 1], h]
            ks = k[ck[b]:ck[b + 1], h // G]
            vs = v[ck[b]:ck[b + 1], h // G]
            s = np.where(vis, scale * (qs @ ks.T), -np.inf)
            m = np.where(seen, s.max(axis=1, initial=-np.inf), 0.0)[:, None]
            p = np.where(vis, np.exp(s - m), 0.0)
            ls = np.where(seen, p.sum(axis=1), 1.0)
            out[cq[b]:cq[b + 1], h] = np.where(seen[:, None], (p @ vs) / ls[:, None], 0.0)
            lse[cq[b]:cq[b + 1], h] = np.where(seen, m[:, 0] + np.log(ls), -np.inf)
    return out, lse


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """Exact merge in float64 of two normalised partial attentions; -inf sides contribute nothing."""
    oa, ob = f64(out_a), f64(out_b)
    la, lb = f64(lse_a), f64(lse_b)
    m = np.maximum(la, lb)
    both_empty = np.isneginf(m)
    ms = np.where(both_empty, 0.0, m)
    wa = np.where(np.isneginf(la), 0.0, np.exp(la - ms))
    wb = np.where(np.isneginf(lb), 0.0, np.exp(lb - ms))
    tot = wa + wb
    safe = np.where(both_empty, 1.0, tot)
    oa = np.where((wa > 0)[..., None], oa, 0.0)  # a -inf side is never read (it may hold NaN)
    ob = np.where((wb > 0)[..., None], ob, 0.0)
    out = (wa[..., None] * oa + wb[..., None] * ob) / safe[..., None]
    out = np.where(both_empty[..., None], 0.0, out)
    lse = np.where(both_empty, -np.inf, ms + np.log(safe))
    return out, lse


def e4m3(x, scale=1.0) -> np.ndarray:
    """The FP8 convention: ``e4m3(clip(x / scale, -448, 448))`` (NaN stays NaN), the quotient formed in
    float64 and rounded to float32 before the rounding to e4m3, as the library computes it (float32
    arithmetic, then one conversion).  Rounding float64 straight to e4m3 can differ by one e4m3 ulp where
    the float32 quotient lands on a tie (frequent for bf16 inputs); ml_dtypes up to 0.6 converted float64
    through float32 anyway, 0.7.0 (2026-12) rounds directly, which made this reference disagree with the
    library on 0.5% of the elements of ``test_kv_pack_quantize_fp8``."""
    y = f64(x) / float(scale)
    return np.clip(y, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(E4M3)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None):
    """Returns the new cache (NumPy, the cache's dtype); slot < 0 or past the cache writes nothing."""
    cache = np.array(kv_cache, copy=True)
    P, ps, D = cache.shape
    kc = f64(kv_c)
    kp = f64(k_pe).reshape(kc.shape[0], -1)
    rows = np.concatenate([kc, kp], axis=1)
    for t, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot < 0 or slot >= P * ps:
            continue
        if scale is None:
            cache[slot // ps, slot % ps] = rows[t].astype(cache.dtype)
        else:
            cache[slot // ps, slot % ps] = e4m3(rows[t], scale)
    return cache


def mla_kv_pack_quantize_fp8(k_nope, k_pe, v, *, k_scale, v_scale):
    """k = e4m3(concat(k_nope, k_pe broadcast over heads) / k_scale), v = e4m3(v / v_scale)."""
    kn = f64(k_nope)
    T, H, _ = kn.shape
    kp = f64(k_pe).reshape(T, -1, f64(k_pe).shape[-1])
    kp = np.broadcast_to(kp, (T, H, kp.shape[-1]))
    return e4m3(np.concatenate([kn, kp], axis=-1), k_scale), e4m3(v, v_scale)


# ------------------------------------------------------------------------------------------ comparison
_REL = {  # relative tolerance: about one ulp of the output dtype (fp32: accumulation-order noise)
    "float32": 2e-5,
    "bfloat16": 2.0**-7,
    "float16": 2.0**-10,
}


def assert_close(got, want, *, dtype: str | None = None, atol: float = 1e-5, rtol: float | None = None,
                 what: str = ""):
    """``|got - want| <= atol + rtol * |want|`` elementwise, with -inf / +inf / NaN positions equal.

    ``want`` is the float64 reference; ``dtype`` (default: got's dtype) picks ``rtol`` (one ulp of that
    output dtype, so a correctly rounded fp32 computation always passes); ``atol`` may be an array that
    broadcasts to ``want``'s shape (a per-element bound).
    """
    dt = np.dtype(np.asarray(got).dtype).name if dtype is None else dtype
    rtol = _REL.get(dt, 2.0**-7) if rtol is None else rtol
    g, w = f64(got), f64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    for name, fn in (("nan", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        bad = fn(g) != fn(w)
        assert not bad.any(), f"{what}: {name} positions differ at {np.argwhere(bad)[:5].tolist()}"
    fin = np.isfinite(w)
    err = np.abs(g[fin] - w[fin])
    lim = (np.broadcast_to(atol, w.shape)[fin] if np.ndim(atol) else atol) + rtol * np.abs(w[fin])
    if err.size and not (err <= lim).all():
        i = int(np.argmax(err - lim))
        raise AssertionError(
            f"{what}: {int((err > lim).sum())}/{err.size} elements off; worst got {g[fin][i]!r} want "
            f"{w[fin][i]!r} (|err| {err[i]:.3g} > {lim[i]:.3g}, rtol {rtol}, "
            f"atol {atol if np.ndim(atol) == 0 else 'per element'})"
        )


# ---------------------------------------------------------------------------------------- test inputs
GARBAGE_PAGE_IDS = (-7, -1, 1 << 30, 12345)


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> ``dtype`` (NumPy / ml_dtypes); float8 saturates like the FP8 convention."""
    if dtype == "float8_e4m3fn":
        return e4m3(x)
    return np.asarray(x).astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))


def make_decode_inputs(rng: np.random.Generator, *, seq_lens, S: int, H: int, L: int, R: int,
                       page_size: int, dtype: str = "bfloat16", extra_pages: int = 3,
                       extra_cols: int = 1, scale_q: float = 1.0, scale_kv: float = 1.0):
    """Random decode operands (NumPy) in the paged layout, adversarial where the contract allows.

    Each request owns ``ceil(seq_len / page_size)`` pages drawn from a random permutation of the cache;
    every row it does not own (other requests' tails, spare pages) holds NaN; block-table entries past a
    request's used pages hold garbage ids (negative, huge, in range but foreign).
    Returns ``(q [B,S,H,L+R], kv_cache [P,page_size,L+R], block_table int32, seq_lens int32)``.
    """
    seq_lens = np.asarray(seq_lens, np.int32)
    B = len(seq_lens)
    D = L + R
    need = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max(max(need), 1) + extra_cols
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages)
    kv = np.full((num_pages, page_size, D), np.nan)
    bt = rng.choice(np.array(GARBAGE_PAGE_IDS + (0, num_pages - 1), np.int64), size=(B, max_pages))
    at = 0
    for b in range(B):
        pages = perm[at:at + need[b]]
        at += need[b]
        bt[b, :need[b]] = pages
        for j in range(int(seq_lens[b])):
            kv[pages[j // page_size], j % page_size] = rng.standard_normal(D) * scale_kv
    q = rng.standard_normal((B, S, H, D)) * scale_q
    return cast(q, dtype), cast(kv, dtype), bt.astype(np.int32), seq_lens


def make_prefill_inputs(rng: np.random.Generator, *, lens_q, lens_k, Hq: int, Hk: int, Dqk: int, Dv: int,
                        dtype: str = "bfloat16", pad_q: int = 0, pad_k: int = 0):
    """Random ragged prefill operands: requests packed back to back, then ``pad_q`` / ``pad_k`` rows
    outside every request (q rows must come out 0 / -inf, k/v rows are NaN and must not be read).
    Returns ``(q, k, v, cu_seqlens_q int32, cu_seqlens_k int32)``."""
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    Tq, Tk = int(cq[-1]) + pad_q, int(ck[-1]) + pad_k
    q = rng.standard_normal((Tq, Hq, Dqk))
    k = rng.standard_normal((Tk, Hk, Dqk))
    v = rng.standard_normal((Tk, Hk, Dv))
    k[ck[-1]:] = np.nan
    v[ck[-1]:] = np.nan
    return cast(q, dtype), cast(k, dtype), cast(v, dtype), cq, ck
