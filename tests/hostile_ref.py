"""Float64 references for the hostile-input tests (issue 34): like :mod:`tests.reference`, but every row is
computed over **exactly the keys it sees**, so NaN / Inf placed anywhere else cannot reach it, and a row
that sees no key is 0 / LSE -inf whatever the scales hold.  Those are the contracts of
``tokenspeed_jax.decode`` and ``tokenspeed_jax.prefill`` ("Non-finite values"); ``tests.reference``
multiplies masked prefill keys by 0, so it would itself turn a masked NaN into NaN.

Lengths and offsets are taken as already clamped Python ints (the tests pass the values the documented
clamp gives).  Nothing here imports tokenspeed_jax.
"""

from __future__ import annotations

import numpy as np

from tests.reference import f64


def _attend(qrows: np.ndarray, keys: np.ndarray, vals: np.ndarray, scale: float):
    """qrows [R, D] over keys [n >= 1, D] / vals [n, Dv] in float64 with IEEE propagation: ``(out, lse, spread)``,
    ``spread = sqrt(sum_j p_j^2 v_j^2) / sum_j p_j`` per output element (the scale of the error of P rounded to e4m3:
    ``benchmarks.decode.FP8_P_ROUND``).  Every score -inf: LSE ``log(0) = -inf`` and output ``0 / 0 = NaN`` (the max
    shift uses 0 there)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = scale * np.einsum("rd,nd->rn", qrows, keys)
        m = s.max(axis=1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        p = np.exp(s - m)
        den = p.sum(axis=1)
        spread = np.sqrt(np.einsum("rn,nv->rv", p * p, vals * vals)) / den[:, None]
        return np.einsum("rn,nv->rv", p, vals) / den[:, None], m[:, 0] + np.log(den), spread


def decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, output_scale=1.0, causal=True,
           kv_lora_rank, spread=False):
    """``(out [B,S,H,L], lse [B,S,H])`` float64, and with ``spread`` each output element's P-rounding spread
    (``_attend``; 0 where a row sees no key); ``seq_lens`` already clamped, the used block-table entries in range."""
    q, kv = f64(q), f64(kv_cache)
    bt = np.asarray(block_table).astype(np.int64)
    B, S, H, D = q.shape
    ps, L = kv.shape[1], kv_lora_rank
    out = np.zeros((B, S, H, L))
    lse = np.full((B, S, H), -np.inf)
    spr = np.zeros((B, S, H, L))
    for b in range(B):
        n_b = int(seq_lens[b])
        for i in range(S):
            n = min(max(n_b - S + 1 + i, 0), n_b) if causal else n_b
            if n == 0:
                continue
            j = np.arange(n)
            keys = kv[bt[b, j // ps], j % ps]
            o, s, spr[b, i] = _attend(q[b, i], keys, keys[:, :L], float(softmax_scale))
            with np.errstate(invalid="ignore"):
                out[b, i] = float(output_scale) * o
            lse[b, i] = s
    return (out, lse, spr) if spread else (out, lse)


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal=True):
    """``(out [Tq,Hq,Dv], lse [Tq,Hq])`` float64, rows outside every request 0 / -inf."""
    q, k, v = f64(q), f64(k), f64(v)
    cq = [int(x) for x in np.asarray(cu_seqlens_q)]
    ck = [int(x) for x in np.asarray(cu_seqlens_k)]
    Tq, Hq, _ = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    out = np.zeros((Tq, Hq, v.shape[2]))
    lse = np.full((Tq, Hq), -np.inf)
    for b in range(len(cq) - 1):
        Lq, Lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for i in range(max(Lq, 0)):
            n = min(Lk, i + Lk - Lq + 1) if causal else Lk
            if n <= 0:
                continue
            row = cq[b] + i
            for g in range(Hk):
                hs = slice(g * G, (g + 1) * G)
                o, s, _ = _attend(q[row, hs], k[ck[b]:ck[b] + n, g], v[ck[b]:ck[b] + n, g], float(softmax_scale))
                out[row, hs], lse[row, hs] = o, s
    return out, lse
