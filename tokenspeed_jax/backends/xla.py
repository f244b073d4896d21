"""The ``xla`` backend: pure-JAX, exact fp32 reference of every op, on every platform.

It is the oracle the GPU kernels are tested against, so it favours exactness over speed: 16-bit and FP8
inputs are multiplied with fp32 accumulation (their products are exact in fp32), fp32 inputs use
``Precision.HIGHEST`` (no TF32), softmax and normalisation run in fp32, and P @ V multiplies fp32 P by V
upcast to fp32.  Masked keys are zeroed before any arithmetic so NaN in memory a request does not own
never reaches a result.

Non-finite values reach exactly the rows that see them.  P @ V sums over every key of the block (every
cached token of a decode request, every packed row of a prefill batch), so a masked key's V row is
multiplied by a probability of exactly 0, and ``0 * NaN`` is NaN.  The matmul therefore runs on V with its
non-finite entries replaced by 0, and 0/1 products add back, per output row and column, what IEEE
arithmetic gives over the **visible** keys only: ``p * NaN`` is NaN, ``p * inf`` is +-inf for ``p > 0``
and NaN for a visible key whose probability is exactly 0 (a score of -inf, or an underflow), +inf plus
-inf is NaN.  Two counts per element carry that (``[NaN or +inf]`` and ``[NaN or -inf]`` over keys with
``p > 0``, plus ``[non-finite]`` over visible keys with ``p == 0`` added to both): both nonzero means NaN,
one of them +inf or -inf.  So an output element is non-finite iff exact IEEE arithmetic over the keys its
row sees makes it so, and masked or unowned memory never matters.  A NaN or +inf score of a visible key
makes its row NaN (LSE NaN too).  A row that sees no key is exactly 0 with LSE -inf whatever the scales
hold (a NaN ``output_scale`` included).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tokenspeed_jax.problems import ALL_DTYPES, FP8_DTYPE, DecodeProblem, PrefillProblem

HIGHEST = jax.lax.Precision.HIGHEST


def _operand(x):
    """Operand dtype for the score matmul: FP8 widens to bf16 (exact); others stay as they are."""
    return x.astype(jnp.bfloat16) if jnp.dtype(x.dtype).name == FP8_DTYPE else x


def _softmax_rows(s, valid):
    """Masked, exactly-zero-safe softmax pieces: returns (p unnormalised, row sum l, row max m_safe).

    A row max of -inf (no visible key) uses 0 as reference (exact zeros); a NaN or +inf max (a visible
    non-finite score) is kept, so that row's p, l and LSE are NaN as in exact arithmetic."""
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # initial: no keys at all (Tk = 0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m_safe)  # masked entries: exp(-inf) = 0
    return p, jnp.sum(p, axis=-1), m_safe[..., 0]


def _finite_and_indicators(v):
    """``(v with non-finite entries 0, [NaN or +inf | NaN or -inf] [..., 2 Dv], [non-finite] [..., Dv])``
    for float32 ``v`` with its values last; the indicators are 0/1 float32 (counts exact to 2^24)."""
    fin = jnp.isfinite(v)
    nan = jnp.isnan(v)
    signed = jnp.concatenate([nan | (v == jnp.inf), nan | (v == -jnp.inf)], axis=-1)
    return jnp.where(fin, v, 0.0), signed.astype(jnp.float32), (~fin).astype(jnp.float32)


def _nonfinite(signed_counts, zero_counts):
    """The non-finite part of P @ V (module docstring): 0, NaN, +inf or -inf per element."""
    dv = zero_counts.shape[-1]
    a = signed_counts[..., :dv] + zero_counts > 0
    b = signed_counts[..., dv:] + zero_counts > 0
    return jnp.where(a & b, jnp.nan, jnp.where(a, jnp.inf, jnp.where(b, -jnp.inf, 0.0)))


def _pv(spec: str, pr, visible, v):
    """``pr @ v`` with IEEE semantics over the visible keys only (module docstring); ``spec`` is the
    einsum of P (unnormalised, masked entries 0) and V; ``visible`` broadcasts to ``pr``."""
    vf, signed, nonfin = _finite_and_indicators(v)
    acc = jnp.einsum(spec, pr, vf, precision=HIGHEST)
    pos = (pr > 0).astype(jnp.float32)
    zero = (visible & (pr == 0)).astype(jnp.float32)
    cnt = jnp.einsum(spec, pos, signed, preferred_element_type=jnp.float32)
    zcnt = jnp.einsum(spec, zero, nonfin, preferred_element_type=jnp.float32)
    return acc + _nonfinite(cnt, zcnt)


def _finish(acc, l, m_safe, out_scale, out_dtype, has):
    """Normalise; ``has`` (bool, l's shape) marks the rows that see at least one key: the others are
    exactly 0 with LSE -inf whatever ``acc`` and ``out_scale`` hold."""
    inv = 1.0 / jnp.where(has, l, 1.0)
    out = jnp.where(has[..., None], acc * (inv * out_scale)[..., None], 0.0).astype(out_dtype)
    lse = jnp.where(has, m_safe + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf).astype(jnp.float32)
    return out, lse


def decode_probs(p: DecodeProblem, q, kv_cache, block_table, seq_lens, softmax_scale):
    """The decode reference up to P: ``(p [B,S,H,K] unnormalised, l [B,S,H], m_safe [B,S,H], v [B,K,L] fp32)``,
    masked keys exactly zero in p and v (also the tests' yardstick of the FP8 P V's P rounding)."""
    return _decode_parts(p, q, kv_cache, block_table, seq_lens, softmax_scale)[:4]


def _decode_parts(p: DecodeProblem, q, kv_cache, block_table, seq_lens, softmax_scale):
    """:func:`decode_probs` plus the visibility mask ``[B, S, K]``."""
    B, S, _, D = q.shape
    L = p.kv_lora_rank
    K = p.max_kv_len
    bt = jnp.clip(block_table.astype(jnp.int32), 0, p.num_pages - 1)
    kv = jnp.take(kv_cache, bt, axis=0, mode="clip").reshape(B, K, D)  # paged gather
    sl = jnp.clip(seq_lens.astype(jnp.int32), 0, K)
    j = jnp.arange(K, dtype=jnp.int32)
    kv = _operand(kv)
    kv = jnp.where((j[None, :] < sl[:, None])[..., None], kv, jnp.zeros((), kv.dtype))
    s = jnp.einsum("bshd,bkd->bshk", _operand(q), kv, preferred_element_type=jnp.float32,
                   precision=HIGHEST) * softmax_scale
    if p.causal:
        limit = sl[:, None] - S + 1 + jnp.arange(S, dtype=jnp.int32)[None, :]
    else:
        limit = jnp.broadcast_to(sl[:, None], (B, S))
    valid = (j[None, None, :] < limit[:, :, None])[:, :, None, :]  # [B, S, 1, K]
    pr, l, m = _softmax_rows(s, valid)
    return pr, l, m, kv[..., :L].astype(jnp.float32), valid[:, :, 0, :]


class XlaBackend:
    name = "xla"
    priority = 0
    decode_batch_invariant = True  # accepted, nothing changes (mla_decode's docstring: no guarantee)

    def supports_decode(self, problem: DecodeProblem) -> str | None:
        if problem.dtype not in ALL_DTYPES:
            return f"dtype {problem.dtype} not in {ALL_DTYPES}"
        return None

    def supports_prefill(self, problem: PrefillProblem) -> str | None:
        if problem.dtype not in ALL_DTYPES:
            return f"dtype {problem.dtype} not in {ALL_DTYPES}"
        return None

    # ------------------------------------------------------------------------------------------ decode
    def decode(self, p: DecodeProblem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale):
        pr, l, m, v, vis = _decode_parts(p, q, kv_cache, block_table, seq_lens, softmax_scale)
        acc = _pv("bshk,bkl->bshl", pr, vis[:, :, None, :], v)
        has = jnp.broadcast_to(jnp.any(vis, axis=-1)[:, :, None], l.shape)
        out, lse = _finish(acc, l, m, output_scale, jnp.dtype(p.out_dtype), has)
        return out, (lse if p.return_lse else None)

    # ----------------------------------------------------------------------------------------- prefill
    def prefill(self, p: PrefillProblem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        Tq, Hq, Dqk = q.shape
        Tk, Hk, Dv = v.shape
        G = p.group_size
        seg_q, pos_q, len_q = _segments(cu_seqlens_q, Tq)
        seg_k, pos_k, _ = _segments(cu_seqlens_k, Tk)
        valid_k = seg_k < p.batch
        kz = jnp.where(valid_k[:, None, None], _operand(k), jnp.zeros((), _operand(k).dtype))
        vz = jnp.where(valid_k[:, None, None], v.astype(jnp.float32), 0.0)
        # Per q row: visible key rows are those of its own request with pos_k <= pos_q + Lk - Lq.
        cu_k = cu_seqlens_k.astype(jnp.int32)
        lk_of_q = jnp.take(cu_k[1:] - cu_k[:-1], jnp.clip(seg_q, 0, p.batch - 1), mode="clip")
        shift_q = jnp.where(seg_q < p.batch, pos_q + lk_of_q - len_q, -1)

        # Query blocks bound each fp32 [H, q, k] tile (scores, P and P @ V's two 0/1 indicator operands) to
        # ~128 MiB; the reference stays usable at 32k+ tokens.
        qb = max(1, min(Tq, (1 << 25) // max(1, Hq * max(Tk, 1))))
        qb = 1 << int(math.floor(math.log2(qb))) if qb < Tq else max(Tq, 1)  # Tq = 0: one empty block
        nblk = -(-Tq // qb)
        pad = nblk * qb - Tq
        q4 = jnp.pad(_operand(q), ((0, pad), (0, 0), (0, 0))).reshape(nblk, qb, Hk, G, Dqk)
        segq = jnp.pad(seg_q, (0, pad), constant_values=p.batch).reshape(nblk, qb)
        shq = jnp.pad(shift_q, (0, pad), constant_values=-1).reshape(nblk, qb)

        def block(args):
            qblk, sq, sh = args
            s = jnp.einsum("qhgd,khd->hgqk", qblk, kz, preferred_element_type=jnp.float32,
                           precision=HIGHEST) * softmax_scale
            vis = (sq[:, None] == seg_k[None, :]) & (sq[:, None] < p.batch)
            if p.causal:
                vis &= pos_k[None, :] <= sh[:, None]
            pr, l, m = _softmax_rows(s, vis[None, None])
            acc = _pv("hgqk,khd->qhgd", pr, vis[None, None], vz)
            l = jnp.moveaxis(l, -1, 0)
            m = jnp.moveaxis(m, -1, 0)
            has = jnp.broadcast_to(jnp.any(vis, axis=-1)[:, None, None], l.shape)
            return _finish(acc, l, m, 1.0, jnp.dtype(p.out_dtype), has)

        if nblk == 1:
            out, lse = block((q4[0], segq[0], shq[0]))
            out, lse = out[None], lse[None]
        else:
            out, lse = jax.lax.map(block, (q4, segq, shq))
        out = out.reshape(nblk * qb, Hq, Dv)[:Tq]
        lse = lse.reshape(nblk * qb, Hq)[:Tq]
        return out, (lse if p.return_lse else None)


def _segments(cu, T):
    """Per row of a packed [T] axis: (request id or B if unowned, position in request, request length)."""
    cu = cu.astype(jnp.int32)
    B = cu.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    seg = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seg = jnp.where(t < cu[0], B, seg)
    segc = jnp.clip(seg, 0, B - 1)
    start = jnp.take(cu, segc, mode="clip")
    length = jnp.take(cu[1:] - cu[:-1], segc, mode="clip")
    return seg, t - start, length


BACKEND = XlaBackend()
