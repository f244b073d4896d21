"""The length-balanced decode schedule (tokenspeed_jax.decode_schedule): coverage, slots, balance, and the
split-KV attention it implies, emulated in float64 against the exact softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed_jax.backends.sm90_decode import _FIXED_COST
from tokenspeed_jax.decode_schedule import UNIT, ScheduleSpec, decode_schedule, reference_pieces


def _run(seq, **kw):
    spec = ScheduleSpec(**kw)
    cta, req = jax.jit(decode_schedule, static_argnums=1)(jnp.asarray(seq, jnp.int32), spec)
    return spec, np.asarray(cta), np.asarray(req)


def _check_cover(seq, spec, cta, req):
    """Every request's tokens [0, L) covered once by its pieces, in CTA order; slots consistent with req."""
    L = np.clip(np.asarray(seq, np.int64), 0, spec.capacity)
    pieces = reference_pieces(cta, req, seq, spec.capacity, spec.chunk)
    by_req: dict[int, list] = {}
    for g, b, s, e, slot in pieces:
        by_req.setdefault(b, []).append((g, s, e, slot))
    used_slots = set()
    for b in range(len(L)):
        ps = by_req.get(b, [])
        assert req[b, 0] == len(ps), (b, req[b], ps)
        if L[b] == 0:
            assert ps == []
            continue
        assert [p[0] for p in ps] == sorted(p[0] for p in ps)
        assert ps[0][1] == 0 and ps[-1][2] == L[b]
        for (_, _, e0, _), (_, s1, _, _) in zip(ps, ps[1:]):
            assert e0 == s1
        for _, s, e, _ in ps:
            assert s % UNIT == 0 and e > s
        if len(ps) == 1:
            assert ps[0][3] == -1 and req[b, 1] == -1
        else:
            assert [p[3] for p in ps] == list(range(req[b, 1], req[b, 1] + len(ps)))
            used_slots.update(p[3] for p in ps)
    split = [b for b in range(len(L)) if req[b, 0] >= 2]
    if spec.chunk:  # the batch-invariant schedule: the pieces [j chunk, (j + 1) chunk) of every request
        for b in range(len(L)):
            assert [(s, e) for _, s, e, _ in by_req.get(b, [])] == _own_pieces(L[b], spec.chunk), b
        assert (cta[:, 6] == -1).all() and list(cta[:, 7]) == [len(split)] * spec.num_ctas
        assert all(0 <= s < spec.slots(len(L)) for s in used_slots)
        assert len(used_slots) == sum(int(r[0]) for r in req if r[0] >= 2)
        return pieces
    # the combine's work list: the requests cut into pieces, in order, then -1 (at most num_ctas - 1 of them)
    assert len(split) <= max(spec.num_ctas - 1, 0)
    assert list(cta[:, 6]) == split + [-1] * (spec.num_ctas - len(split)), (cta[:, 6], split)
    assert list(cta[:, 7]) == [len(split)] * spec.num_ctas
    assert all(0 <= s < spec.max_slots for s in used_slots)
    assert len(used_slots) == sum(int(r[0]) for r in req if r[0] >= 2)
    return pieces


def _own_pieces(length, chunk):
    """The batch-invariant schedule's pieces of a request of ``length`` tokens: every multiple of ``chunk``."""
    return [(s, min(s + chunk, int(length))) for s in range(0, int(length), chunk)]


def _cta_costs(pieces, spec):
    cost = np.zeros(spec.num_ctas)
    for g, _, s, e, _ in pieces:
        cost[g] += -(-(e - s) // UNIT) + spec.fixed_cost
    return cost


@pytest.mark.parametrize("fixed_cost", [3, _FIXED_COST])  # (the sm90 backend's)
@pytest.mark.parametrize("mode", ["balanced", "per_request", "choose"])
@pytest.mark.parametrize("case", ["uniform", "tail", "zeros", "one", "full"])
def test_cover_and_slots(mode, case, fixed_cost):
    rng = np.random.default_rng(7)
    B, cap = 64, 81920
    seq = {"uniform": rng.integers(256, cap + 1, B), "tail": np.where(rng.random(B) < 0.1, cap, rng.integers(1, 2048, B)),
           "zeros": np.where(rng.random(B) < 0.5, 0, rng.integers(1, cap, B)), "one": np.full(1, 131072),
           "full": np.full(B, cap)}[case]
    capacity = 131072 if case == "one" else cap
    spec, cta, req = _run(seq, num_ctas=132, capacity=capacity, split_units=320, mode=mode, fixed_cost=fixed_cost)
    _check_cover(seq, spec, cta, req)


def test_balanced_is_balanced():
    rng = np.random.default_rng(3)
    seq = rng.integers(256, 81921, 64)
    spec, cta, req = _run(seq, num_ctas=132, capacity=81920, split_units=320, mode="balanced")
    cost = _cta_costs(_check_cover(seq, spec, cta, req), spec)
    total = sum(-(-int(s) // UNIT) + spec.fixed_cost for s in seq)
    # each CTA within one unit plus one extra piece's fixed cost of the even share
    assert cost.max() <= total / spec.num_ctas + 1 + spec.fixed_cost + 1
    assert cost.max() < 1.05 * total / spec.num_ctas


def test_full_length_keeps_the_static_split():
    """A full-length batch under 'choose' runs the static plan's pieces: [s*T, (s+1)*T) of every request."""
    B, cap, tps = 64, 81920, 40960
    spec, cta, req = _run(np.full(B, cap), num_ctas=132, capacity=cap, split_units=tps // UNIT, mode="choose")
    pieces = _check_cover(np.full(B, cap), spec, cta, req)
    assert sorted((b, s, e) for _, b, s, e, _ in pieces) == [(b, s * tps, (s + 1) * tps) for b in range(B)
                                                           for s in range(2)]
    assert max(np.bincount([p[0] for p in pieces])) == 1  # one piece per CTA, as the static grid


def test_varied_batch_chooses_balanced():
    rng = np.random.default_rng(11)
    seq = rng.integers(256, 81921, 64)
    spec, cta, req = _run(seq, num_ctas=132, capacity=81920, split_units=320, mode="choose")
    cost = _cta_costs(_check_cover(seq, spec, cta, req), spec)
    _, ctab, reqb = _run(seq, num_ctas=132, capacity=81920, split_units=320, mode="balanced")
    np.testing.assert_array_equal(cta, ctab)
    assert cost.max() < 1.05 * cost.mean()


def test_workspace_bound_and_shapes():
    spec = ScheduleSpec(num_ctas=132, capacity=4096, split_units=1)
    for B in (1, 7, 256):
        cta, req = decode_schedule(jnp.full((B,), 4096, jnp.int32), spec)
        assert cta.shape == (132, 8) and req.shape == (B, 2)
        assert int(jnp.max(req[:, 1] + req[:, 0])) <= spec.max_slots


def test_spec_validation():
    with pytest.raises(ValueError, match="num_ctas"):
        ScheduleSpec(num_ctas=0, capacity=1, split_units=1)
    with pytest.raises(ValueError, match="mode"):
        ScheduleSpec(num_ctas=1, capacity=1, split_units=1, mode="fast")
    with pytest.raises(ValueError, match="seq_lens"):
        decode_schedule(jnp.zeros((2, 2), jnp.int32), ScheduleSpec(num_ctas=1, capacity=1, split_units=1))


def _emulate(q, kv, seq, spec, cta, req, S, causal=True):
    """Split-KV attention as the kernel + combine run it (float64): each piece's normalised partial and LSE
    over its token range (a row's causal limit applied), merged in slot order."""
    B, _, H, D = q.shape
    L = np.clip(seq, 0, spec.capacity)
    out = np.zeros((B, S, H, D))
    lse = np.full((B, S, H), -np.inf)
    parts: dict[int, list] = {}
    for _, b, s, e, slot in reference_pieces(cta, req, seq, spec.capacity, spec.chunk):
        sc = np.einsum("shd,td->sht", q[b], kv[b, s:e])
        keys = np.arange(s, e)
        lim = (L[b] - S + 1 + np.arange(S)) if causal else np.full(S, L[b])
        sc = np.where(keys[None, None, :] < lim[:, None, None], sc, -np.inf)
        m = sc.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(sc - m)
        lsum = p.sum(-1)
        o = np.einsum("sht,td->shd", p, kv[b, s:e]) / np.where(lsum > 0, lsum, 1)[..., None]
        lp = np.where(lsum > 0, np.log(np.where(lsum > 0, lsum, 1)) + m[..., 0], -np.inf)
        if slot < 0:
            out[b], lse[b] = o, lp
        else:
            parts.setdefault(b, []).append((slot, o, lp))
    for b, ps in parts.items():
        ps.sort(key=lambda t: t[0])
        lall = np.stack([p[2] for p in ps])
        mx = lall.max(0)
        mx0 = np.where(np.isfinite(mx), mx, 0.0)
        w = np.exp(lall - mx0)
        tot = w.sum(0)
        out[b] = sum(wi[..., None] * p[1] for wi, p in zip(w, ps)) / np.where(tot > 0, tot, 1)[..., None]
        lse[b] = np.where(tot > 0, mx0 + np.log(np.where(tot > 0, tot, 1)), -np.inf)
    return out, lse


def _exact(q, kv, seq, S, capacity, causal=True):
    B, _, H, D = q.shape
    L = np.clip(seq, 0, capacity)
    out = np.zeros((B, S, H, D))
    lse = np.full((B, S, H), -np.inf)
    for b in range(B):
        for s in range(S):
            lim = L[b] - S + 1 + s if causal else L[b]
            if lim <= 0:
                continue
            sc = q[b, s] @ kv[b, :lim].T
            m = sc.max(-1, keepdims=True)
            p = np.exp(sc - m)
            out[b, s] = p @ kv[b, :lim] / p.sum(-1, keepdims=True)
            lse[b, s] = np.log(p.sum(-1)) + m[:, 0]
    return out, lse


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_emulated_split_attention_is_exact(data):
    B = data.draw(st.integers(1, 9))
    S = data.draw(st.integers(1, 3))
    G = data.draw(st.integers(1, 12))
    cap = UNIT * data.draw(st.integers(1, 6))
    seq = np.array(data.draw(st.lists(st.integers(-3, cap + 300), min_size=B, max_size=B)), np.int64)
    mode = data.draw(st.sampled_from(["balanced", "per_request", "choose", "invariant"]))
    split_units = data.draw(st.integers(1, cap // UNIT))
    fixed = data.draw(st.integers(0, 24))
    chunk = UNIT * data.draw(st.integers(1, 3)) if mode == "invariant" else 0
    spec, cta, req = _run(seq, num_ctas=G, capacity=cap, split_units=split_units, mode="choose" if chunk else mode,
                          fixed_cost=fixed, chunk=chunk)
    _check_cover(seq, spec, cta, req)
    rng = np.random.default_rng(int(seq.sum()) % 1000)
    q = rng.standard_normal((B, S, 2, 8))
    kv = rng.standard_normal((B, cap, 8))
    o, lse = _emulate(q, kv, seq, spec, cta, req, S)
    oe, lsee = _exact(q, kv, seq, S, cap)
    np.testing.assert_allclose(o, oe, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lsee))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(lsee), 0, lsee), rtol=1e-10)


# ------------------------------------------------------------------------------- the batch-invariant schedule

def _request_pieces(seq, spec, cta, req, b):
    """``(piece count, [(start, end)], slots)`` of request ``b`` as the kernel's walk runs it."""
    ps = sorted((s, e, slot) for _, bb, s, e, slot in reference_pieces(cta, req, seq, spec.capacity, spec.chunk)
                if bb == b)
    return int(req[b, 0]), [(s, e) for s, e, _ in ps], [slot for _, _, slot in ps]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_invariant_pieces_depend_on_own_length(data):
    """The batch-invariant schedule: a request's pieces ``(start, end)`` and their count depend on its own length
    alone: the same request inside random batches (other lengths, sizes, positions, zeros, lengths past the
    capacity) gets the pieces ``[j chunk, (j + 1) chunk)``, its slots consecutive (none when it has one piece); every
    batch is covered once and balanced to within one piece of the even cost share."""
    G = data.draw(st.integers(1, 24))
    cap = UNIT * data.draw(st.integers(1, 40))
    chunk = UNIT * data.draw(st.integers(1, 8))
    fixed = data.draw(st.integers(0, 24))
    L0 = data.draw(st.integers(0, cap + 200))
    seen = set()
    for _ in range(3):
        others = data.draw(st.lists(st.integers(-3, cap + 200), min_size=0, max_size=40))
        pos = data.draw(st.integers(0, len(others)))
        seq = np.array(others[:pos] + [L0] + others[pos:], np.int64)
        spec, cta, req = _run(seq, num_ctas=G, capacity=cap, split_units=1, fixed_cost=fixed, chunk=chunk)
        pieces = _check_cover(seq, spec, cta, req)
        n, own, slots = _request_pieces(seq, spec, cta, req, pos)
        want = _own_pieces(min(max(L0, 0), cap), chunk)
        assert own == want and n == len(want)
        assert slots == ([-1] if n == 1 else list(range(req[pos, 1], req[pos, 1] + n)) if n else [])
        seen.add((n, tuple(own)))
        # balance: each cut within half a piece of the even share, so no CTA above it by more than one piece
        cost = _cta_costs(pieces, spec)
        total = sum(-(-(e - s) // UNIT) + fixed for _, _, s, e, _ in pieces)
        assert cost.max() <= total / G + chunk // UNIT + fixed + 1
    assert len(seen) == 1


def test_invariant_balanced_and_slots_bound():
    """B=64 varied lengths over 132 CTAs: balanced to within one piece, slots within ``B * ceil(capacity / chunk)``;
    one long request alone is spread over ``ceil(L / chunk)`` CTAs."""
    rng = np.random.default_rng(5)
    seq = rng.integers(0, 81921, 64)
    spec, cta, req = _run(seq, num_ctas=132, capacity=81920, split_units=1, fixed_cost=5, unit=64, chunk=4096)
    pieces = _check_cover(seq, spec, cta, req)
    cost = np.zeros(132)
    for g, _, s, e, _ in pieces:
        cost[g] += -(-(e - s) // 64) + 5
    assert cost.max() <= cost.sum() / 132 + 4096 // 64 + 5
    assert int(np.max(req[:, 1] + req[:, 0])) <= spec.slots(64) == 64 * 20
    spec, cta, req = _run([131072], num_ctas=132, capacity=131072, split_units=1, fixed_cost=5, unit=64,
                          chunk=4096)
    pieces = _check_cover([131072], spec, cta, req)
    assert len(pieces) == 32 and len({p[0] for p in pieces}) == 32
    assert ScheduleSpec(num_ctas=4, capacity=4096, split_units=1, chunk=4096).slots(100) == 1  # (never split)


def test_invariant_spec_validation():
    with pytest.raises(ValueError, match="chunk"):
        ScheduleSpec(num_ctas=1, capacity=1, split_units=1, chunk=100)
    with pytest.raises(ValueError, match="chunk"):
        ScheduleSpec(num_ctas=1, capacity=1, split_units=1, chunk=-128)


@pytest.mark.parametrize("G", [1, 3, 7, 40])
def test_emulated_invariant_split_attention_is_exact(G):
    """The batch-invariant schedule's split attention (pieces of 128 tokens, several per CTA range or several CTAs
    per request) emulated as the kernel walks it and the combine merges it: the exact softmax; a request's output is
    the same, in float64, alone and in the batch."""
    rng = np.random.default_rng(G)
    cap, S = 640, 2
    seq = np.array([129, 0, 640, 1, 300, 700, 128, 255], np.int64)
    spec, cta, req = _run(seq, num_ctas=G, capacity=cap, split_units=1, fixed_cost=2, chunk=128)
    _check_cover(seq, spec, cta, req)
    q = rng.standard_normal((len(seq), S, 2, 8))
    kv = rng.standard_normal((len(seq), cap, 8))
    o, lse = _emulate(q, kv, seq, spec, cta, req, S)
    oe, lsee = _exact(q, kv, seq, S, cap)
    np.testing.assert_allclose(o, oe, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lsee))
    for b in (0, 2, 5):
        spec1, cta1, req1 = _run(seq[b:b + 1], num_ctas=G, capacity=cap, split_units=1, fixed_cost=2, chunk=128)
        o1, l1 = _emulate(q[b:b + 1], kv[b:b + 1], seq[b:b + 1], spec1, cta1, req1, S)
        np.testing.assert_array_equal(o1[0], o[b])
        np.testing.assert_array_equal(l1[0], lse[b])


def test_cuda_kernel_flag_runs_the_jnp_ops_off_cuda():
    """``cuda_kernel=True`` (the sm90 backend's schedule) selects the CuTe DSL kernel only where the program is
    lowered for CUDA (``jax.lax.platform_dependent``; the kernel against the jnp ops bit for bit:
    ``tests/gpu/test_sm90_decode.py::test_schedule_kernel_matches_jnp``); here, on the CPU, the jnp ops run."""
    spec = ScheduleSpec(num_ctas=7, capacity=4096, split_units=3, fixed_cost=5, unit=64)
    seq = jnp.asarray([0, 4096, 70, 9000, 1], jnp.int32)
    got = jax.jit(lambda s: decode_schedule(s, spec, cuda_kernel=True))(seq)
    want = decode_schedule(seq, spec)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_cuda_kernel_flag_beyond_the_kernels_grid_lowers_the_jnp_ops():
    """A grid past the kernel's bound (``KERNEL_MAX_CTAS``) keeps the jnp ops on CUDA too: no custom call."""
    from tokenspeed_jax.decode_schedule import KERNEL_MAX_CTAS

    spec = ScheduleSpec(num_ctas=KERNEL_MAX_CTAS + 1, capacity=4096, split_units=1)
    txt = jax.jit(lambda s: decode_schedule(s, spec, cuda_kernel=True)).trace(
        jax.ShapeDtypeStruct((5,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call" not in txt and f"tensor<{KERNEL_MAX_CTAS + 1}x8xi32>" in txt
