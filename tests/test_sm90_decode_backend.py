"""CPU checks of the sm90 decode backend's routing, no compile: the trace-time switches (which launch function and
compile key each reaches, validation naming the variable), ``supports`` reasons and the planner's sm90 plans.  The
kernel compiles themselves are in ``tests/test_compile_sm90_decode.py``."""

import pytest

from tokenspeed_jax.planner import plan_mla_decode
from tokenspeed_jax.problems import DecodeProblem, Target


def test_schedule_switch(monkeypatch):
    from tokenspeed_jax.backends import sm90_decode as m

    monkeypatch.delenv(m.SCHEDULE_ENV, raising=False)
    assert m.resolve_schedule() == "auto"
    assert m.resolve_schedule("overlap") == "overlap"
    monkeypatch.setenv(m.SCHEDULE_ENV, "overlap")
    assert m.resolve_schedule() == "overlap"
    assert m.resolve_schedule("lockstep") == "lockstep"  # the argument wins
    assert m.resolve_schedule("seesaw") == "seesaw"
    assert m.resolve_schedule("seesaw-cpasync") == "seesaw-cpasync"
    monkeypatch.setenv(m.SCHEDULE_ENV, "fast")
    with pytest.raises(ValueError, match=m.SCHEDULE_ENV):
        m.resolve_schedule()
    with pytest.raises(ValueError, match="schedule"):
        m.resolve_schedule("default")
    assert m.DecodeKernelKey("k", "bfloat16", 16, 1, 64, True, 1, 64, 64) != m.DecodeKernelKey(
        "k", "bfloat16", 16, 1, 64, True, 1, 64, 64, "overlap")


def test_l2_prefetch_switch(monkeypatch):
    """The L2 prefetch distance is read from the environment, validated with the variable named, keyed."""
    from tokenspeed_jax.backends import sm90_decode as m

    monkeypatch.delenv(m.L2_PREFETCH_ENV, raising=False)
    assert m.resolve_l2_prefetch() == m.L2_PREFETCH_DEFAULT
    monkeypatch.setenv(m.L2_PREFETCH_ENV, "late")
    assert m.resolve_l2_prefetch() == "late"
    for bad in ("1", "on", "Late"):
        monkeypatch.setenv(m.L2_PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=m.L2_PREFETCH_ENV):
            m.resolve_l2_prefetch()
    assert m.L2_PREFETCH_ENV in m.TRACE_ENV
    k = ("k", "bfloat16", 16, 1, 64, True, 1, 64, 64, "seesaw", True, False)
    assert m.DecodeKernelKey(*k, "off") != m.DecodeKernelKey(*k, "late")


def test_fp8_pv_switch(monkeypatch):
    """The FP8 P V mode is read from the environment, validated with the variable named, and keyed (the A/B
    script reports whether the lowerings of two modes differ: scripts/decode_ab.py, ``lowering_equal``)."""
    from tokenspeed_jax.backends import sm90_decode as m

    monkeypatch.delenv(m.FP8_PV_ENV, raising=False)
    assert m.resolve_fp8_pv() == m.FP8_PV_DEFAULT == "10"
    for v in m.FP8_PV_MODES:
        monkeypatch.setenv(m.FP8_PV_ENV, v)
        assert m.resolve_fp8_pv() == v
    for bad in ("on", "true", "11"):
        monkeypatch.setenv(m.FP8_PV_ENV, bad)
        with pytest.raises(ValueError, match=m.FP8_PV_ENV):
            m.resolve_fp8_pv()
    assert m.FP8_PV_ENV in m.TRACE_ENV
    k = ("k", "float8_e4m3fn", 16, 1, 64, True, 1, 64, 64, "seesaw", True, True, "late")
    assert len({m.DecodeKernelKey(*k), m.DecodeKernelKey(*k, True), m.DecodeKernelKey(*k, True, True),
                m.DecodeKernelKey(*k, True, True, True), m.DecodeKernelKey(*k, True, True, True, True),
                m.DecodeKernelKey(*k, True, True, True, True, True),
                m.DecodeKernelKey(*k, True, True, True, True, True, True),
                m.DecodeKernelKey(*k, True, True, True, True, True, True, 4)}) == 8
    assert m.RS_STAGES_ENV in m.TRACE_ENV
    monkeypatch.delenv(m.RS_STAGES_ENV, raising=False)
    assert m.resolve_rs_stages() == int(m.RS_STAGES_DEFAULT) == 4


def test_producer16_switch(monkeypatch):
    """The 16-bit loop's producer warpgroup switch: validated with the variable named, part of the trace key, and
    only where the 16-bit seesaw has TMA refills and pages >= 32 (16-token pages: its coordinates would spill)."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m

    assert m.PRODUCER16_ENV in m.TRACE_ENV and m.PRODUCER16_DEFAULT == "1"
    seen = _record_custom_calls(monkeypatch)
    monkeypatch.setenv(m.T16_ENV, "0")  # (16 rows of 16-bit run the transposed loop by default, producer built in)
    q = jnp.zeros((2, 1, 16, 576), jnp.bfloat16)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for page, env, want in ((64, None, True), (32, "1", True), (64, "0", False), (16, "1", False)):
        if env is None:
            monkeypatch.delenv(m.PRODUCER16_ENV, raising=False)
        else:
            monkeypatch.setenv(m.PRODUCER16_ENV, env)
        kv = jnp.zeros((16, page, 576), jnp.bfloat16)
        m.decode(_problem(batch=2, q_len=1, page_size=page, num_pages=16, max_pages=8), q, kv, bt, sl, 0.1, 1.0)
        assert seen["kw"]["tma_producer"] is want and seen["key"].tma_producer is want, (page, env)
    monkeypatch.setenv(m.PRODUCER16_ENV, "yes")
    with pytest.raises(ValueError, match=m.PRODUCER16_ENV):
        m.decode(_problem(batch=2, q_len=1, num_pages=16, max_pages=8), q, jnp.zeros((16, 64, 576), jnp.bfloat16),
                 bt, sl, 0.1, 1.0)


def test_kv_evict_and_cross_first_switches(monkeypatch):
    """The KV eviction hint and the 16-bit loop's cross-PV-first order: validated with the variable named, part of
    the trace key and the compile key, passed to the launch only where they apply (the hint on the TMA loops of
    either dtype, the PV order on the 16-bit seesaw alone)."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m

    assert m.KV_EVICT_ENV in m.TRACE_ENV and m.CROSS_FIRST_ENV in m.TRACE_ENV
    seen = _record_custom_calls(monkeypatch)
    monkeypatch.setenv(m.T16_ENV, "0")  # (16 rows of 16-bit run the transposed loop by default, no cross PV there)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for dtype, page, evict, cross, want_evict, want_cross in (
            ("bfloat16", 64, None, None, "normal", False), ("bfloat16", 64, "first", "1", "first", True),
            ("bfloat16", 8, "first", "1", "normal", True),  # page 8: cp.async refills, no TMA to hint
            ("float8_e4m3fn", 64, "first", "1", "first", False), ("float8_e4m3fn", 64, "normal", "0", "normal", False)):
        for env, v in ((m.KV_EVICT_ENV, evict), (m.CROSS_FIRST_ENV, cross)):
            if v is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, v)
        q = jnp.zeros((2, 1, 16, 576), dtype)
        kv = jnp.zeros((16, page, 576), dtype)
        m.decode(_problem(batch=2, q_len=1, page_size=page, num_pages=16, max_pages=8, dtype=dtype), q, kv, bt, sl,
                 0.1, 1.0)
        case = (dtype, page, evict, cross)
        assert seen["key"].kv_evict == want_evict and seen["key"].cross_first is want_cross, case
        assert seen["kw"].get("kv_evict", "normal") == want_evict, case
        assert seen["kw"].get("cross_first", False) is want_cross, case
    _assert_rejected(monkeypatch, lambda: m.decode(
        _problem(batch=2, q_len=1, num_pages=16, max_pages=8), jnp.zeros((2, 1, 16, 576), jnp.bfloat16),
        jnp.zeros((16, 64, 576), jnp.bfloat16), bt, sl, 0.1, 1.0), ((m.KV_EVICT_ENV, "last"), (m.CROSS_FIRST_ENV, "yes")))


def test_t16_and_pdl_main_switches(monkeypatch):
    """The transposed 16-bit loop runs only where it is built for (16-bit, S x H <= 32, the producer warpgroup's pages
    >= 32 with TMA); PDL for the main kernel reaches every loop; both validated with the variable named and keyed."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m

    assert m.T16_ENV in m.TRACE_ENV and m.PDL_MAIN_ENV in m.TRACE_ENV
    assert m.T16_DEFAULT == "1" and m.PDL_MAIN_DEFAULT == "0"
    seen = _record_custom_calls(monkeypatch)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for env in (m.T16_ENV, m.PDL_MAIN_ENV, m.PRODUCER16_ENV, m.FP8_PV_ENV):
        monkeypatch.delenv(env, raising=False)

    def run(dtype="bfloat16", S=1, H=16, page=64):
        q = jnp.zeros((2, S, H, 576), dtype)
        kv = jnp.zeros((16, page, 576), dtype)
        m.decode(_problem(batch=2, q_len=S, num_heads=H, page_size=page, num_pages=16, max_pages=8, dtype=dtype),
                 q, kv, bt, sl, 0.1, 1.0)
        return seen["launch"].__name__, seen["key"].t16, seen["key"].pdl_main, dict(seen["kw"])

    assert run()[:3] == ("launch_mla_decode_ot16", True, False)  # the defaults
    monkeypatch.setenv(m.T16_ENV, "0")
    assert run()[:3] == ("launch_mla_decode_seesaw", False, False)
    monkeypatch.setenv(m.T16_ENV, "1")
    launch, t16, _, kw = run()
    assert (launch, t16) == ("launch_mla_decode_ot16", True) and "tma_producer" not in kw and "cross_first" not in kw
    assert run(S=2, H=16)[:2] == ("launch_mla_decode_ot16", True)  # 32 rows
    assert run(S=4, H=16)[:2] == ("launch_mla_decode_seesaw", False)  # 64 rows: the seesaw loop
    assert run(page=16)[:2] == ("launch_mla_decode_seesaw", False)  # no producer warpgroup with 16-token pages
    assert run(dtype="float8_e4m3fn")[:2] == ("launch_mla_decode_ot", False)  # FP8: its own O^T loop
    monkeypatch.setenv(m.PRODUCER16_ENV, "0")
    assert run()[:2] == ("launch_mla_decode_seesaw", False)
    monkeypatch.delenv(m.PRODUCER16_ENV)
    monkeypatch.setenv(m.PDL_MAIN_ENV, "1")
    for args in ({}, {"dtype": "float8_e4m3fn"}, {"dtype": "float8_e4m3fn", "S": 4, "H": 32}, {"page": 16}):
        _, _, pdl_main, kw = run(**args)
        assert pdl_main is True and kw["pdl_main"] is True, args
    _assert_rejected(monkeypatch, run, ((m.T16_ENV, "on"), (m.PDL_MAIN_ENV, "2")))


def test_t16_pt_and_bars_switches(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_T16_PT=q`` and ``_T16_BARS=chunk`` (opt-in) reach the transposed 16-bit loop only,
    keyed; off by default; validated with the variable named wherever they apply or not."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m

    assert m.T16_PT_ENV in m.TRACE_ENV and m.T16_PT_DEFAULT == "rope" and m.T16_PT_CHOICES == ("rope", "q")
    assert m.T16_BARS_ENV in m.TRACE_ENV and m.T16_BARS_DEFAULT == "group"
    assert m.T16_BARS_CHOICES == ("group", "chunk")
    seen = _record_custom_calls(monkeypatch)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for env in (m.T16_PT_ENV, m.T16_BARS_ENV, m.T16_ENV, m.PRODUCER16_ENV, m.FP8_PV_ENV):
        monkeypatch.delenv(env, raising=False)

    def run(dtype="bfloat16", S=1, H=16):
        m.decode(_problem(batch=2, q_len=S, num_heads=H, num_pages=16, max_pages=8, dtype=dtype),
                 jnp.zeros((2, S, H, 576), dtype), jnp.zeros((16, 64, 576), dtype), bt, sl, 0.1, 1.0)
        key, kw = seen["key"], seen["kw"]
        return (seen["launch"].__name__, key.t16_pt_q, kw.get("pt_q", False), key.t16_chunk_bars,
                kw.get("chunk_bars", False))

    off = (False,) * 4
    assert run() == ("launch_mla_decode_ot16", *off)  # the defaults
    monkeypatch.setenv(m.T16_PT_ENV, "q")
    assert run() == ("launch_mla_decode_ot16", True, True, False, False)
    monkeypatch.setenv(m.T16_BARS_ENV, "chunk")
    assert run() == ("launch_mla_decode_ot16", True, True, True, True)
    assert run(S=2) == ("launch_mla_decode_ot16", True, True, True, True)  # 32 rows
    monkeypatch.delenv(m.T16_PT_ENV)
    assert run() == ("launch_mla_decode_ot16", False, False, True, True)
    monkeypatch.setenv(m.T16_PT_ENV, "q")
    assert run(S=4) == ("launch_mla_decode_seesaw", *off)  # 64 rows: the seesaw loop, P in its slots
    assert run(dtype="float8_e4m3fn") == ("launch_mla_decode_ot", *off)  # FP8: its own O^T loop
    monkeypatch.setenv(m.T16_ENV, "0")
    assert run() == ("launch_mla_decode_seesaw", *off)
    _assert_rejected(monkeypatch, run, ((m.T16_PT_ENV, "slot"), (m.T16_BARS_ENV, "tile")))


def test_colmax_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_COLMAX`` (default "shfl") reaches the transposed loops only (FP8 modes 6 / 7, the
    16-bit T16 loop), keyed; validated with the variable named wherever it applies or not (not in mode 10's 64-row
    O^T loop)."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    assert m.COLMAX_ENV in m.TRACE_ENV and m.COLMAX_DEFAULT == "shfl" and m.COLMAX_CHOICES == ("shfl", "xpose")
    run, _ = _switch_run(monkeypatch, m, (m.COLMAX_ENV, m.T16_ENV, m.FP8_PV_ENV, m.PRODUCER16_ENV), "colmax", "shfl",
                         "bfloat16", 1, 16)

    f8 = "float8_e4m3fn"
    assert run() == ("launch_mla_decode_ot16", "shfl", "shfl")  # the default
    monkeypatch.setenv(m.COLMAX_ENV, "xpose")
    assert run() == ("launch_mla_decode_ot16", "xpose", "xpose")
    assert run(S=2) == ("launch_mla_decode_ot16", "xpose", "xpose")  # 32 rows
    assert run(dtype=f8, H=32) == ("launch_mla_decode_ot", "xpose", "xpose")  # FP8 mode 6
    assert run(S=4) == ("launch_mla_decode_seesaw", "shfl", "shfl")  # 64 rows: the seesaw loop
    assert run(dtype=f8, S=4) == ("launch_mla_decode_ot", "shfl", "shfl")  # FP8 mode 10: the 64-row O^T loop
    monkeypatch.setenv(m.FP8_PV_ENV, "6")
    assert run(dtype=f8, S=4) == ("launch_mla_decode_seesaw", "shfl", "shfl")  # FP8 mode 6: mode 4 for 64 rows
    monkeypatch.setenv(m.FP8_PV_ENV, "7")
    assert run(dtype=f8, S=4) == ("launch_mla_decode_ot", "xpose", "xpose")  # mode 7: 32-row tiles, any S x H
    monkeypatch.setenv(m.FP8_PV_ENV, "5")
    assert run(dtype=f8) == ("launch_mla_decode_ot", "shfl", "shfl")  # mode 5: the O^T loop without the transposed QK
    monkeypatch.delenv(m.FP8_PV_ENV)
    monkeypatch.setenv(m.T16_ENV, "0")
    assert run() == ("launch_mla_decode_seesaw", "shfl", "shfl")
    _assert_rejected(monkeypatch, run, ((m.COLMAX_ENV, "redux"),))


def test_ot64_p0_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_OT64_P0`` (default "early") reaches only the O^T loop's 64-row blocks (FP8 mode 10 with
    S x H > 32), keyed; validated with the variable named wherever it applies or not."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    assert m.OT64_P0_ENV in m.TRACE_ENV and m.OT64_P0_DEFAULT == "early" and m.OT64_P0_CHOICES == ("early", "late")
    run, _ = _switch_run(monkeypatch, m, (m.OT64_P0_ENV, m.FP8_PV_ENV), "p0_late", False, "float8_e4m3fn", 4, 16)

    assert run() == ("launch_mla_decode_ot", False, False)  # the default, 64 rows
    monkeypatch.setenv(m.OT64_P0_ENV, "late")
    assert run() == ("launch_mla_decode_ot", True, True)
    assert run(S=3, H=24) == ("launch_mla_decode_ot", True, True)  # 72 rows: two blocks
    assert run(S=1) == ("launch_mla_decode_ot", False, False)  # 16 rows: mode 6's loop (qk_t)
    assert run(dtype="bfloat16") == ("launch_mla_decode_seesaw", False, False)
    _ot_switch_end(monkeypatch, m, run, m.OT64_P0_ENV, False, "lazy")


def test_ot64_fence_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_OT64_FENCE`` (default "always") reaches only the P0 rescale of the O^T loop's 64-row
    blocks (FP8 mode 10 with S x H > 32, not with ``OT64_P0=late``), keyed; validated with the variable named wherever
    it applies or not."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    run, seen = _switch_run(monkeypatch, m, (m.OT64_FENCE_ENV, m.OT64_P0_ENV, m.OT64_QK_ENV, m.FP8_PV_ENV),
                            "p0_fence", "always", "float8_e4m3fn", 4, 16)
    assert run() == ("launch_mla_decode_ot", "always", "always")  # the default, 64 rows
    monkeypatch.setenv(m.OT64_FENCE_ENV, "rescaled")
    assert run() == ("launch_mla_decode_ot", "rescaled", "rescaled")
    assert run(S=3, H=24) == ("launch_mla_decode_ot", "rescaled", "rescaled")  # 72 rows: two blocks
    assert run(S=1) == ("launch_mla_decode_ot", "always", "always")  # 16 rows: mode 6's loop, no P0 rescale
    assert run(dtype="bfloat16") == ("launch_mla_decode_seesaw", "always", "always")
    monkeypatch.setenv(m.OT64_P0_ENV, "late")  # (no rescale)
    assert run() == ("launch_mla_decode_ot", "always", "always") and seen["kw"]["p0_late"]
    monkeypatch.delenv(m.OT64_P0_ENV)
    _ot_switch_end(monkeypatch, m, run, m.OT64_FENCE_ENV, "always", "inside")


def test_ot_softmax_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_OT_SOFTMAX`` (default "auto": "max" on the 32- / 16-row tiles, "exp" on the 64-row
    blocks; a set order reaches every tile size of the O^T loop, FP8 mode 10), keyed; validated with the variable named
    wherever it applies or not."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    run, _ = _switch_run(monkeypatch, m, (m.OT_SOFTMAX_ENV, m.OT64_P0_ENV, m.FP8_PV_ENV), "softmax", "exp",
                         "float8_e4m3fn", 4, 16)
    assert run() == ("launch_mla_decode_ot", "exp", "exp")  # the default ("auto"), 64 rows
    assert run(S=1) == ("launch_mla_decode_ot", "max", "max")  # ... 16 rows: mode 6's loop
    assert run(S=2) == ("launch_mla_decode_ot", "max", "max")  # ... 32 rows
    assert run(dtype="bfloat16", S=1) == ("launch_mla_decode_ot16", "exp", "exp")  # (the 16-bit loop: not this)
    for order in ("exp", "fold", "max"):
        monkeypatch.setenv(m.OT_SOFTMAX_ENV, order)
        assert run() == ("launch_mla_decode_ot", order, order)
        assert run(S=1) == ("launch_mla_decode_ot", order, order)  # 16 rows: mode 6's loop
        assert run(S=3, H=24) == ("launch_mla_decode_ot", order, order)  # 72 rows: two blocks
        assert run(dtype="bfloat16") == ("launch_mla_decode_seesaw", "exp", "exp")
        assert run(dtype="bfloat16", S=1) == ("launch_mla_decode_ot16", "exp", "exp")  # (the 16-bit loop: not this)
    _ot_switch_end(monkeypatch, m, run, m.OT_SOFTMAX_ENV, "exp", "early")


def test_resolve_ot_loop(monkeypatch):
    """The rule the backend and benchmarks/trace_decode.py share for the O^T loop's switches: defaults, not applicable,
    the 32-row tiles' own switch, OT64_P0=late alone (QK "after", no fence to place), both set (refused, both named),
    the P0 rescale's fence, bad values named wherever they apply or not."""
    from tokenspeed_jax.backends import sm90_decode as m

    envs = (m.OT64_QK_ENV, m.OT64_P0_ENV, m.OT32_QK_ENV, m.OT64_FENCE_ENV, m.OT_SOFTMAX_ENV, m.OT_P1_ENV,
            m.OT32_LOOP_ENV)
    for env in envs:
        monkeypatch.delenv(env, raising=False)
    r = m.resolve_ot_loop
    assert m.OT32_LOOP_ENV in m.TRACE_ENV and m.OT32_LOOP_DEFAULT == "own" and m.OT32_LOOP_CHOICES == ("shared", "own")
    # the default on the 32- / 16-row tiles: each warpgroup its own tiles; no cross-warpgroup chain, so the other
    # switches keep their defaults there (and still act on the 64-row blocks)
    monkeypatch.setenv(m.OT_SOFTMAX_ENV, "fold")
    assert r(False, True) == m.OtLoop(loop32="own") == (False, "after", "always", "exp", "cross", "own")
    assert r(True, False) == (False, "wg0", "always", "fold", "store", "shared")
    assert r(False, False) == m.OtLoop()
    assert r(False, True, False) == (False, "wg0", "always", "fold", "store", "shared")  # (mode 5: no transposed QK)
    monkeypatch.delenv(m.OT_SOFTMAX_ENV)
    monkeypatch.setenv(m.OT32_LOOP_ENV, "shared")  # (the shared loop's switches from here on)
    assert m.OT32_QK_ENV in m.TRACE_ENV and m.OT32_QK_DEFAULT == "wg0" and m.OT32_QK_CHOICES == ("after", "wg0", "wg01")
    assert m.OT64_FENCE_ENV in m.TRACE_ENV and m.OT64_FENCE_DEFAULT == "always"
    assert m.OT64_FENCE_CHOICES == ("always", "rescaled")
    assert m.OT_SOFTMAX_ENV in m.TRACE_ENV and m.OT_SOFTMAX_DEFAULT == "auto"
    assert m.OT_SOFTMAX_CHOICES == ("auto", "exp", "fold", "max")
    assert m.OT_P1_ENV in m.TRACE_ENV and m.OT_P1_DEFAULT == "store" and m.OT_P1_CHOICES == ("cross", "store")
    monkeypatch.setenv(m.OT_P1_ENV, "cross")  # (every tile size of the O^T loop; nothing without it)
    assert r(True, False).p1_ready == r(False, True).p1_ready == r(False, False).p1_ready == "cross"
    monkeypatch.delenv(m.OT_P1_ENV)
    assert r(False, False) == m.OtLoop() and r(True, False)._fields == ("p0_late", "qk_early", "p0_fence",
                                                                        "softmax", "p1_ready",
                                                                        "loop32")
    assert r(True, False) == (False, "wg0", "always", "exp", "store", "shared")
    assert r(False, False) == (False, "after", "always", "exp", "cross", "shared")
    assert r(False, True) == (False, "wg0", "always", "max", "store", "shared")
    monkeypatch.setenv(m.OT32_QK_ENV, "after")
    assert r(False, True) == (False, "after", "always", "max", "store", "shared")
    assert r(True, False) == (False, "wg0", "always", "exp", "store", "shared")
    assert r(False, False) == (False, "after", "always", "exp", "cross", "shared")
    monkeypatch.delenv(m.OT32_QK_ENV)
    monkeypatch.setenv(m.OT64_QK_ENV, "wg0s")
    assert r(True, False) == (False, "wg0s", "always", "exp", "store", "shared")
    assert r(False, True) == (False, "wg0", "always", "max", "store", "shared")
    monkeypatch.delenv(m.OT64_QK_ENV)
    monkeypatch.setenv(m.OT_SOFTMAX_ENV, "max")  # (every tile size of the O^T loop)
    assert r(True, False) == (False, "wg0", "always", "max", "store", "shared")
    assert r(False, True) == (False, "wg0", "always", "max", "store", "shared")
    assert r(False, False) == (False, "after", "always", "exp", "cross", "shared")
    monkeypatch.delenv(m.OT_SOFTMAX_ENV)
    monkeypatch.setenv(m.OT64_FENCE_ENV, "rescaled")  # (the 64-row blocks' P0 rescale only)
    assert r(True, False) == (False, "wg0", "rescaled", "exp", "store", "shared")
    assert r(False, True) == (False, "wg0", "always", "max", "store", "shared")
    assert r(False, False) == (False, "after", "always", "exp", "cross", "shared")
    monkeypatch.setenv(m.OT64_P0_ENV, "late")  # (no rescale: the fence stays where it is)
    assert r(True, False) == (True, "after", "always", "exp", "store", "shared")
    assert r(False, False) == (False, "after", "always", "exp", "cross", "shared")
    assert r(False, True) == (False, "wg0", "always", "max", "store", "shared")
    monkeypatch.delenv(m.OT64_FENCE_ENV)
    monkeypatch.delenv(m.OT64_P0_ENV)
    monkeypatch.setenv(m.OT64_P0_ENV, "late")
    monkeypatch.setenv(m.OT64_QK_ENV, "after")
    assert r(True, False) == (True, "after", "always", "exp", "store", "shared")
    monkeypatch.setenv(m.OT64_QK_ENV, "wg0s")
    with pytest.raises(ValueError, match=f"{m.OT64_P0_ENV}=late and {m.OT64_QK_ENV}=wg0s"):
        r(True, False)
    assert r(False, False) == (False, "after", "always", "exp", "cross", "shared")
    for env, bad in ((m.OT64_QK_ENV, "early"), (m.OT64_P0_ENV, "1"), (m.OT32_QK_ENV, "wg0s"),
                     (m.OT64_FENCE_ENV, "never"), (m.OT_SOFTMAX_ENV, "early"),
                     (m.OT_P1_ENV, "late"), (m.OT32_LOOP_ENV, "split")):
        for e in envs:
            monkeypatch.delenv(e, raising=False)
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            r(False, False)


def test_ot64_qk_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_OT64_QK`` (default "wg0") reaches only the O^T loop's 64-row blocks (FP8 mode 10 with
    S x H > 32), keyed; ``OT64_P0=late`` alone runs the QK "after" (as measured), with ``OT64_QK=wg0`` set as well it
    is refused with both variables named; validated with the variable named wherever it applies or not."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    assert m.OT64_QK_ENV in m.TRACE_ENV and m.OT64_QK_DEFAULT == "wg0"
    assert m.OT64_QK_CHOICES == ("after", "wg0", "wg0s")
    run, seen = _switch_run(monkeypatch, m, (m.OT64_QK_ENV, m.OT64_P0_ENV, m.OT32_QK_ENV, m.FP8_PV_ENV), "qk_early",
                            "after", "float8_e4m3fn", 4, 16)

    assert run() == ("launch_mla_decode_ot", "wg0", "wg0")  # the default, 64 rows
    assert run(S=3, H=24) == ("launch_mla_decode_ot", "wg0", "wg0")  # 72 rows: two blocks
    assert run(S=1) == ("launch_mla_decode_ot", "wg0", "wg0")  # 16 rows: mode 6's loop (qk_t), OT32_QK's default
    assert run(S=2) == ("launch_mla_decode_ot", "wg0", "wg0")  # 32 rows
    assert run(dtype="bfloat16") == ("launch_mla_decode_seesaw", "after", "after")
    assert run(dtype="bfloat16", S=1) == ("launch_mla_decode_ot16", "after", "after")  # (the 16-bit loop: none)
    monkeypatch.setenv(m.OT32_QK_ENV, "after")  # (the 32- and 16-row tiles' own switch)
    assert run(S=1) == ("launch_mla_decode_ot", "after", "after")
    assert run() == ("launch_mla_decode_ot", "wg0", "wg0")  # (64 rows: not this switch)
    monkeypatch.delenv(m.OT32_QK_ENV)
    monkeypatch.setenv(m.OT64_QK_ENV, "after")
    assert run() == ("launch_mla_decode_ot", "after", "after")
    monkeypatch.setenv(m.OT64_QK_ENV, "wg0s")
    assert run() == ("launch_mla_decode_ot", "wg0s", "wg0s")
    assert run(S=1) == ("launch_mla_decode_ot", "wg0", "wg0")
    monkeypatch.setenv(m.FP8_PV_ENV, "4")
    monkeypatch.setenv(m.OT64_QK_ENV, "wg0")
    assert run() == ("launch_mla_decode_seesaw", "after", "after")
    monkeypatch.delenv(m.FP8_PV_ENV)
    monkeypatch.delenv(m.OT64_QK_ENV)
    monkeypatch.setenv(m.OT64_P0_ENV, "late")
    assert run() == ("launch_mla_decode_ot", "after", "after")
    assert seen["key"].p0_late and seen["kw"]["p0_late"]
    monkeypatch.setenv(m.OT64_QK_ENV, "wg0")
    with pytest.raises(ValueError, match=f"{m.OT64_P0_ENV}=late and {m.OT64_QK_ENV}=wg0"):
        run()
    monkeypatch.delenv(m.OT64_P0_ENV)
    monkeypatch.delenv(m.OT64_QK_ENV)
    _assert_rejected(monkeypatch, run, ((m.OT64_QK_ENV, "both"),))
    _assert_rejected(monkeypatch, lambda: run(dtype="bfloat16"), ((m.OT64_QK_ENV, "early"),))


def test_pad_rows_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_PAD_ROWS`` reaches the seesaw launcher (16-bit and FP8 mode 4) only where a row block
    has rows past S x H, keyed; the O^T and transposed loops (no padded rows) never get it; validated, named."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    assert m.PAD_ROWS_ENV in m.TRACE_ENV and m.PAD_ROWS_DEFAULT == "zero"
    run, _ = _switch_run(monkeypatch, m, (m.PAD_ROWS_ENV, m.T16_ENV, m.FP8_PV_ENV, m.PRODUCER16_ENV), "pad_rows",
                         "copy", "bfloat16", 1, 16)

    monkeypatch.setenv(m.T16_ENV, "0")  # (16 rows run the transposed loop by default)
    assert run() == ("launch_mla_decode_seesaw", "zero", "zero")  # the default; 16 rows of 64
    monkeypatch.setenv(m.PAD_ROWS_ENV, "copy")
    assert run() == ("launch_mla_decode_seesaw", "copy", "copy")
    monkeypatch.setenv(m.PAD_ROWS_ENV, "zero")
    assert run(S=3, H=32) == ("launch_mla_decode_seesaw", "zero", "zero")  # 96 rows: the second block padded
    assert run(S=4, H=16) == ("launch_mla_decode_seesaw", "copy", "copy")  # 64 rows: nothing to pad
    # the FP8 default (mode 10) runs the O^T loop there, which copies a real row into the padded ones; mode 4 zeros
    # them
    assert run(dtype="float8_e4m3fn", S=3, H=16) == ("launch_mla_decode_ot", "copy", "copy")
    monkeypatch.setenv(m.FP8_PV_ENV, "4")
    assert run(dtype="float8_e4m3fn", S=3, H=16) == ("launch_mla_decode_seesaw", "zero", "zero")  # mode 4
    monkeypatch.delenv(m.FP8_PV_ENV)
    assert run(dtype="float8_e4m3fn")[1:] == ("copy", "copy")  # mode 10 for 16 rows: mode 6's O^T loop, N = S x H
    monkeypatch.delenv(m.T16_ENV)
    assert run() == ("launch_mla_decode_ot16", "copy", "copy")
    monkeypatch.setenv(m.PAD_ROWS_ENV, "nan")
    with pytest.raises(ValueError, match=m.PAD_ROWS_ENV):
        run()


def test_store_switches(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_P_STSM`` and ``_EPILOGUE`` (both on by default) reach the 16-bit seesaw launcher only,
    keyed; ``_EPILOGUE_FP8`` (on by default) FP8 mode 4 only; the O^T loop and the transposed 16-bit loop never get
    them; validated, named."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m

    assert m.P_STSM_ENV in m.TRACE_ENV and m.EPILOGUE_ENV in m.TRACE_ENV
    assert m.P_STSM_DEFAULT == "1" and m.EPILOGUE_DEFAULT == "staged" and m.EPILOGUE_FP8_DEFAULT == "staged"
    assert m.EPILOGUE_FP8_ENV in m.TRACE_ENV
    seen = _record_custom_calls(monkeypatch)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for env in (m.P_STSM_ENV, m.EPILOGUE_ENV, m.EPILOGUE_FP8_ENV, m.T16_ENV, m.FP8_PV_ENV, m.PRODUCER16_ENV):
        monkeypatch.delenv(env, raising=False)

    def run(dtype="bfloat16", S=4, H=32):
        q = jnp.zeros((2, S, H, 576), dtype)
        m.decode(_problem(batch=2, q_len=S, num_heads=H, num_pages=16, max_pages=8, dtype=dtype), q,
                 jnp.zeros((16, 64, 576), dtype), bt, sl, 0.1, 1.0)
        kw, key = seen["kw"], seen["key"]
        return seen["launch"].__name__, key.p_stsm, key.o_staged, kw.get("p_stsm", False), kw.get("o_staged", False)

    assert run() == ("launch_mla_decode_seesaw", True, True, True, True)  # the defaults, 128 rows
    assert run(dtype="float16", S=3, H=24) == ("launch_mla_decode_seesaw", True, True, True, True)  # padded block
    # the FP8 default (mode 10, 128 rows): the O^T loop, which stores straight from its accumulators (neither switch)
    assert run(dtype="float8_e4m3fn") == ("launch_mla_decode_ot", False, False, False, False)
    monkeypatch.setenv(m.FP8_PV_ENV, "4")
    assert run(dtype="float8_e4m3fn") == ("launch_mla_decode_seesaw", False, True, False, True)  # mode 4
    monkeypatch.setenv(m.EPILOGUE_FP8_ENV, "direct")
    assert run(dtype="float8_e4m3fn") == ("launch_mla_decode_seesaw", False, False, False, False)
    monkeypatch.setenv(m.EPILOGUE_FP8_ENV, "staged")
    monkeypatch.delenv(m.FP8_PV_ENV)
    assert run(dtype="float8_e4m3fn", S=1, H=16)[1:] == (False,) * 4  # mode 6: the O^T loop
    assert run()[1:] == (True,) * 4  # (16-bit: its own switch)
    monkeypatch.delenv(m.EPILOGUE_FP8_ENV)
    assert run(S=1, H=16)[1:] == (False,) * 4  # the transposed loop
    monkeypatch.setenv(m.P_STSM_ENV, "0")
    assert run() == ("launch_mla_decode_seesaw", False, True, False, True)
    monkeypatch.setenv(m.EPILOGUE_ENV, "direct")
    assert run() == ("launch_mla_decode_seesaw", False, False, False, False)
    _assert_rejected(monkeypatch, run, ((m.P_STSM_ENV, "yes"), (m.EPILOGUE_ENV, "smem"), (m.EPILOGUE_FP8_ENV, "on")))


def _assert_rejected(monkeypatch, run, bad_values):
    """Each ``(variable, value)`` of ``bad_values`` set alone makes ``run()`` raise a ValueError naming the
    variable."""
    for env, bad in bad_values:
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            run()
        monkeypatch.delenv(env)


def _ot_switch_end(monkeypatch, m, run, env: str, off, bad: str):
    """The common end of an O^T-loop switch test (``env`` set to a non-default value, ``run`` from
    :func:`_switch_run`): with FP8 P V mode 4 (the seesaw loop) it does not reach the kernel (``off``: the key's and
    launch's value then); unset, then a bad value ``bad`` is refused with ``env`` named where the switch applies (FP8)
    and where it does not (BF16)."""
    monkeypatch.setenv(m.FP8_PV_ENV, "4")
    assert run() == ("launch_mla_decode_seesaw", off, off)
    monkeypatch.delenv(m.FP8_PV_ENV)
    monkeypatch.delenv(env)
    _assert_rejected(monkeypatch, run, ((env, bad),))
    _assert_rejected(monkeypatch, lambda: run(dtype="bfloat16"), ((env, "1"),))


def _switch_run(monkeypatch, m, clear, field: str, absent, dtype: str, S: int, H: int):
    """``(run, seen)`` for a switch test: the variables ``clear`` unset, the backend's custom call recorded (no
    compile); ``run(dtype, S, H)`` (defaults as given) decodes a 2-request problem with 64-token pages and returns
    ``(launch name, key.<field>, the launch's static argument <field>, or absent when not passed)``."""
    import jax.numpy as jnp

    seen = _record_custom_calls(monkeypatch)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for env in clear:
        monkeypatch.delenv(env, raising=False)
    d0, s0, h0 = dtype, S, H

    def run(dtype=d0, S=s0, H=h0):
        m.decode(_problem(batch=2, q_len=S, num_heads=H, num_pages=16, max_pages=8, dtype=dtype),
                 jnp.zeros((2, S, H, 576), dtype), jnp.zeros((16, 64, 576), dtype), bt, sl, 0.1, 1.0)
        return seen["launch"].__name__, getattr(seen["key"], field), seen["kw"].get(field, absent)

    return run, seen


def _record_custom_calls(monkeypatch) -> dict:
    """Replace ``tokenspeed_jax.ffi.custom_call`` by a recorder: the backend's last call leaves its ``launch``
    function, ``key`` (compile key) and ``kw`` (the launch's static arguments) in the returned dict, and the call
    returns zeros of the declared outputs (no compile).  It also sets ``$TOKENSPEED_SM90_DECODE_OT32_LOOP=shared``:
    most switch tests follow the shared O^T loop, whose switches the default "own" loop on the 32- / 16-row tiles
    does not take (:func:`test_ot32_loop_switch` unsets it)."""
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode

    monkeypatch.setenv(sm90_decode.OT32_LOOP_ENV, "shared")
    seen = {}

    def fake_call(target, launch, *, outputs, compile_key, **kw):
        seen["launch"], seen["key"], seen["kw"] = launch, compile_key, kw
        return lambda *a: [jnp.zeros(o.shape, o.dtype) for o in outputs]

    monkeypatch.setattr("tokenspeed_jax.ffi.custom_call", fake_call)
    return seen


def _problem(**kw):
    base = {"batch": 3, "q_len": 2, "num_heads": 16, "head_dim": 576, "kv_lora_rank": 512, "page_size": 64,
            "num_pages": 100, "max_pages": 40, "dtype": "bfloat16", "causal": True, "return_lse": True,
            "target": Target("cuda", "sm_90a", 132)}
    base.update(kw)
    return DecodeProblem(**base)


def test_sm90_plan_block_m():
    """``block_m`` 32 (the O^T loop with the transposed QK): ``ceil(rows / 32)`` row tiles; other values and other
    families refused, naming the argument."""
    p = plan_mla_decode(batch=3, q_len=3, num_heads=32, max_kv_len=4096, page_size=64, block_m=32, num_sms=132)
    assert p.block_m == 32 and p.num_m_blocks == 3 and p.grid[0] == 3
    assert plan_mla_decode(batch=3, q_len=3, num_heads=32, max_kv_len=4096, page_size=64, num_sms=132).num_m_blocks == 2
    with pytest.raises(ValueError, match="block_m"):
        plan_mla_decode(batch=3, q_len=1, num_heads=16, max_kv_len=4096, page_size=64, block_m=16)
    with pytest.raises(ValueError, match="block_m"):
        plan_mla_decode(batch=3, q_len=1, num_heads=16, max_kv_len=4096, page_size=64, block_m=32, arch="sm_100a")


def test_supports_reasons():
    from tokenspeed_jax.backends import sm90_decode as m

    assert m.supports(_problem()) is None
    assert m.supports(_problem(dtype="float16")) is None
    assert "sm_90" in m.supports(_problem(target=Target("cpu")))
    assert "sm_90" in m.supports(_problem(target=Target("cuda", "sm_100a", 148)))
    assert m.supports(_problem(dtype="float8_e4m3fn")) is None
    assert "float32" in m.supports(_problem(dtype="float32"))
    assert "kv_lora_rank" in m.supports(_problem(kv_lora_rank=448, head_dim=512))


@pytest.mark.parametrize("B,S,H,K", [(64, 1, 16, 81920), (64, 8, 128, 81920), (1, 1, 16, 81920), (3, 2, 16, 2560),
                                     (128, 1, 128, 4096), (1, 16, 1, 64), (7, 3, 96, 100000)])
def test_sm90_plan(B, S, H, K):
    p = plan_mla_decode(batch=B, q_len=S, num_heads=H, max_kv_len=K, page_size=64, arch="sm_90a", num_sms=132)
    R = S * H
    assert p.rows == R and p.num_m_blocks == -(-R // 64) and p.block_m == 64 and p.block_n == 64
    assert p.tokens_per_split % 64 == 0
    assert (p.num_splits - 1) * p.tokens_per_split < K <= p.num_splits * p.tokens_per_split
    assert p.grid == (p.num_m_blocks, p.num_splits, B)
    if p.num_splits == 1:
        assert p.workspace == ()
    else:
        shapes = {w.name: w.shape for w in p.workspace}
        assert shapes == {"o_accum": (B, p.num_splits, R, 512), "lse_accum": (B, p.num_splits, R)}
    ctas = B * p.num_m_blocks * p.num_splits
    if B * p.num_m_blocks < 132 and K >= 64 * 4:
        # fills (most of) a wave, unless limited by at least two 64-token blocks per split
        assert ctas >= 100 or p.num_splits == -(-K // 64) // 2


def test_ot32_loop_switch(monkeypatch):
    """``TOKENSPEED_SM90_DECODE_OT32_LOOP`` (default "own") picks the "own" loop's launch function for the O^T loop's
    32- / 16-row tiles (FP8 mode 10 with S x H <= 32, mode 7 for any S x H), without the shared loop's switches (not
    passed, at their defaults in the key); "shared" the shared loop; the 64-row blocks, mode 5 (no transposed QK) and
    BF16 never run it; a bad value is named."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode as m

    run, seen = _switch_run(monkeypatch, m, (m.OT32_LOOP_ENV, m.FP8_PV_ENV, m.OT_SOFTMAX_ENV), "loop32", "shared",
                            "float8_e4m3fn", 1, 32)
    # (clear unset the "shared" of _record_custom_calls)
    assert run() == ("launch_mla_decode_ot_own", "own", "own")  # the default, 32 rows
    assert all(k not in seen["kw"] for k in ("qk_early", "softmax", "p1_ready")) and seen["kw"]["qk_t"] is True
    assert (seen["key"].qk_early, seen["key"].softmax, seen["key"].p1_ready) == ("after", "exp", "cross")
    assert run(H=16) == ("launch_mla_decode_ot_own", "own", "own")  # 16 rows
    assert run(S=4) == ("launch_mla_decode_ot", "shared", "shared")  # 64 rows: the 64-row blocks
    assert run(dtype="bfloat16") == ("launch_mla_decode_ot16", "shared", "shared")  # (the 16-bit loop: not this)
    monkeypatch.setenv(m.FP8_PV_ENV, "7")  # 32-row tiles for any S x H
    assert run(S=4) == ("launch_mla_decode_ot_own", "own", "own")
    monkeypatch.setenv(m.FP8_PV_ENV, "5")  # no transposed QK: the shared loop, with its own switches' defaults
    assert run() == ("launch_mla_decode_ot", "shared", "shared")
    assert seen["kw"]["softmax"] == "max" and seen["kw"]["qk_early"] == "wg0" and seen["kw"]["qk_t"] is False
    monkeypatch.delenv(m.FP8_PV_ENV)
    monkeypatch.setenv(m.OT32_LOOP_ENV, "shared")
    assert run() == ("launch_mla_decode_ot", "shared", "shared")
    assert seen["kw"]["softmax"] == "max" and seen["kw"]["qk_early"] == "wg0"  # (the shared loop's defaults)
    monkeypatch.setenv(m.OT32_LOOP_ENV, "split")
    with pytest.raises(ValueError, match=m.OT32_LOOP_ENV):
        run(S=4)  # (validated wherever it applies or not)


def test_fp8_ot_switch(monkeypatch):
    """FP8 P V modes 5 and 6 run the O^T schedule's launch function (keyed ``pv_ot``; 6 with the transposed QK,
    ``qk_t``) for S x H <= 32 with pages >= 32, and otherwise what mode 4 runs (its loop; with 16-token pages its
    fallback); mode 10 (the default) is mode 6 with the O^T loop on 64-row blocks instead of mode 4; mode 7 runs mode
    6's loop for any S x H, on the 32-row plan; mode 8 the row-split loop for any S x H, mode 9 for S x H <= 32."""
    pytest.importorskip("cutlass")
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m
    from tokenspeed_jax.kernels.sm90 import mla_decode_ot
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import launch_mla_decode_ot
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import launch_mla_decode_seesaw

    assert m._MAX_OT_ROWS == mla_decode_ot._MAX_ROWS  # (the backend's copy: it imports no cutlass at module level)
    seen = _record_custom_calls(monkeypatch)
    f8 = jnp.float8_e4m3fn
    q = jnp.zeros((2, 1, 16, 576), f8)
    bt, sl = jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 100, jnp.int32)
    for mode, page, ot in (("5", 64, True), ("5", 32, True), ("5", 16, False), ("4", 64, False), ("6", 64, True),
                           ("6", 16, False), ("7", 64, True)):
        monkeypatch.setenv(m.FP8_PV_ENV, mode)
        kv = jnp.zeros((16, page, 576), f8)
        m.decode(_problem(batch=2, q_len=1, page_size=page, num_pages=16, max_pages=8, dtype="float8_e4m3fn"),
                 q, kv, bt, sl, 0.1, 1.0)
        assert seen["key"].pv_ot is ot and (seen["launch"] is launch_mla_decode_ot) is ot, (mode, page)
        if ot:
            assert "pv_fp8" not in seen["kw"] and seen["kw"]["l2_prefetch"] == m.L2_PREFETCH_DEFAULT, seen["kw"]
            assert seen["kw"]["qk_t"] is (mode != "5") and seen["key"].qk_t is (mode != "5"), seen["kw"]
        else:
            assert seen["launch"] is launch_mla_decode_seesaw and seen["kw"]["vt_packed"] is True, (mode, page)
    # mode 10 (the default): mode 6's loop for S x H <= 32, the O^T loop without the transposed QK on the default
    # plan's 64-row blocks for more rows (S x H = 64 and 72: one and two blocks), mode 4's loop for 16-token pages
    plan_calls = []
    real_plan = m.plan_for_problem
    monkeypatch.setattr(m, "plan_for_problem", lambda *a, **kw: plan_calls.append(kw) or real_plan(*a, **kw))
    for v in ("10", ""):  # (the default)
        monkeypatch.setenv(m.FP8_PV_ENV, v)
        for S, H, page, ot, qk_t in ((1, 16, 64, True, True), (2, 32, 64, True, False), (3, 24, 32, True, False),
                                     (2, 32, 16, False, False)):
            plan_calls.clear()
            m.decode(_problem(batch=2, q_len=S, num_heads=H, page_size=page, num_pages=16, max_pages=8,
                              dtype="float8_e4m3fn"), jnp.zeros((2, S, H, 576), f8), jnp.zeros((16, page, 576), f8),
                     bt, sl, 0.1, 1.0)
            assert seen["key"].pv_ot is ot and (seen["launch"] is launch_mla_decode_ot) is ot, (v, S, H, page)
            if ot:
                assert seen["kw"]["qk_t"] is qk_t and seen["key"].qk_t is qk_t, (v, S, H, seen["kw"])
                assert plan_calls == [{}, {"block_m": 32}] if qk_t else plan_calls == [{}], plan_calls
            else:
                assert seen["launch"] is launch_mla_decode_seesaw and seen["kw"]["vt_packed"] is True, seen["kw"]
    monkeypatch.setattr(m, "plan_for_problem", real_plan)
    # more than 32 query rows (S x H = 64): mode 4's loop with modes 5 and 6
    for mode in ("5", "6"):
        monkeypatch.setenv(m.FP8_PV_ENV, mode)
        m.decode(_problem(batch=2, q_len=2, num_heads=32, page_size=64, num_pages=16, max_pages=8,
                          dtype="float8_e4m3fn"), jnp.zeros((2, 2, 32, 576), f8), jnp.zeros((16, 64, 576), f8), bt, sl,
                 0.1, 1.0)
        assert seen["key"].pv_ot is False and seen["launch"] is launch_mla_decode_seesaw, (mode, seen["key"])
        assert seen["kw"]["tma_producer"] is True and seen["kw"]["vt_packed"] is True, seen["kw"]
    # ... mode 7 runs the O^T loop for them, on its 32-row plan (a long table: the split counts of the two differ)
    monkeypatch.setenv(m.FP8_PV_ENV, "7")
    bt = jnp.zeros((2, 1200), jnp.int32)
    prob = _problem(batch=2, q_len=2, num_heads=32, page_size=64, num_pages=16, max_pages=1200, dtype="float8_e4m3fn")
    m.decode(prob, jnp.zeros((2, 2, 32, 576), f8), jnp.zeros((16, 64, 576), f8), bt, sl, 0.1, 1.0)
    p32 = plan_mla_decode(batch=2, q_len=2, num_heads=32, max_kv_len=1200 * 64, page_size=64, block_m=32,
                          num_sms=132)
    assert seen["key"].pv_ot and seen["key"].qk_t and seen["launch"] is launch_mla_decode_ot, seen["key"]
    assert (seen["key"].num_splits, seen["key"].tokens_per_split) == (p32.num_splits, p32.tokens_per_split), p32
    assert p32.num_m_blocks == 2 and p32.num_splits != plan_mla_decode(
        batch=2, q_len=2, num_heads=32, max_kv_len=1200 * 64, page_size=64, num_sms=132).num_splits

    # mode 8: the row-split launch for every S x H with pages >= 32, on the default plan (64-row blocks), with
    # $TOKENSPEED_SM90_DECODE_RS_STAGES KV buffers; mode 9 the same for S x H <= 32 and mode 4's loop for more rows;
    # mode 4's loop for 16-token pages
    from tokenspeed_jax.kernels.sm90.mla_decode_rs import launch_mla_decode_rs

    monkeypatch.setenv(m.FP8_PV_ENV, "8")
    p64 = plan_mla_decode(batch=2, q_len=2, num_heads=32, max_kv_len=1200 * 64, page_size=64, num_sms=132)
    for stages in ("", "2", "5"):
        monkeypatch.setenv(m.RS_STAGES_ENV, stages)
        m.decode(prob, jnp.zeros((2, 2, 32, 576), f8), jnp.zeros((16, 64, 576), f8), bt, sl, 0.1, 1.0)
        want = int(stages or m.RS_STAGES_DEFAULT)
        assert seen["launch"] is launch_mla_decode_rs and seen["key"].rs_stages == want, seen["key"]
        assert seen["kw"]["stages"] == want and "l2_prefetch" not in seen["kw"] and "qk_t" not in seen["kw"], seen["kw"]
        assert (seen["key"].num_splits, seen["key"].tokens_per_split) == (p64.num_splits, p64.tokens_per_split)
    monkeypatch.setenv(m.RS_STAGES_ENV, "6")
    with pytest.raises(ValueError, match=m.RS_STAGES_ENV):
        m.decode(prob, jnp.zeros((2, 2, 32, 576), f8), jnp.zeros((16, 64, 576), f8), bt, sl, 0.1, 1.0)
    monkeypatch.delenv(m.RS_STAGES_ENV)
    small = _problem(batch=2, q_len=1, page_size=64, num_pages=16, max_pages=8, dtype="float8_e4m3fn")
    for mode in ("8", "9"):
        monkeypatch.setenv(m.FP8_PV_ENV, mode)
        m.decode(small, jnp.zeros((2, 1, 16, 576), f8), jnp.zeros((16, 64, 576), f8), bt[:, :8], sl, 0.1, 1.0)
        assert seen["launch"] is launch_mla_decode_rs and not seen["key"].qk_t and seen["key"].rs_stages == 4, mode
        m.decode(_problem(batch=2, q_len=2, num_heads=32, page_size=16, num_pages=16, max_pages=8,
                          dtype="float8_e4m3fn"),
                 jnp.zeros((2, 2, 32, 576), f8), jnp.zeros((16, 16, 576), f8), bt[:, :8], sl, 0.1, 1.0)
        assert seen["launch"] is launch_mla_decode_seesaw and seen["key"].rs_stages == 0, seen["key"]
    m.decode(prob, jnp.zeros((2, 2, 32, 576), f8), jnp.zeros((16, 64, 576), f8), bt, sl, 0.1, 1.0)  # mode 9, 64 rows
    assert seen["launch"] is launch_mla_decode_seesaw and seen["kw"]["tma_producer"] and seen["kw"]["vt_packed"]
