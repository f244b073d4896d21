"""The jitted device steps of the DeepSeek engine (:mod:`tokenspeed_jax.models.deepseek.engine`): packed prefill,
teacher-forced decode, admission of prefilled requests into decode slots, and the decode loop over the slots (plain
and MTP speculative rounds, greedy or sampled), with the slot state they carry.  The engine holds the host side:
the allocator, admission, harvesting and timing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from tokenspeed_jax.models.deepseek import sampling as smp
from tokenspeed_jax.models.deepseek.attention import AttentionBatch
from tokenspeed_jax.models.deepseek.sampling import SamplingParams

GREEDY = SamplingParams()


# ----------------------------------------------------------------------------------- step helpers
def _slots(block_table, pos, page_size):
    """Cache slots of positions ``pos [B, S]`` through ``block_table [B, P]``."""
    page = jnp.take_along_axis(block_table, jnp.clip(pos // page_size, 0, block_table.shape[1] - 1), axis=1)
    return page * page_size + pos % page_size


def _decode_batch(block_table, pos, page_size, backend, active=None):
    """Decode metadata for tokens at positions ``pos [B, S]`` (request-major); rows of inactive requests
    (``active [B]`` False) write nothing."""
    _B, S = pos.shape
    slots = _slots(block_table, pos, page_size)
    if active is not None:
        slots = jnp.where(active[:, None], slots, -1)
    return AttentionBatch(
        positions=pos.reshape(-1),
        slot_mapping=slots.reshape(-1),
        block_table=block_table,
        seq_lens=pos[:, -1] + 1,
        mode="decode",
        q_len=S,
        backend=backend,
    )


def _isin(tokens, eos):
    """``tokens [...]`` equal to one of ``eos [E]`` (-1 entries match nothing)."""
    return jnp.any(tokens[..., None] == eos, axis=-1)


def _draft_chain(
    model, cache, d1, q1, mh, new_pos, block_table, keys, active, *, k, params, page_size, backend
):
    """Drafts ``[B, k]`` (and their distributions ``[B, k, V]`` when sampling): ``d1`` then k-1 chained
    MTP steps, draft j+1 at position ``new_pos + j - 1``; draft j uses key ``(new_pos, TAG_DRAFT + j)``."""
    drafts, qs, tok, h = [d1], [q1], d1, mh
    for j in range(1, k):
        batch = _decode_batch(block_table, (new_pos + j - 1)[:, None], page_size, backend, active)
        h, logits, cache = model.mtp_forward(tok, h, batch, cache)
        tok = smp.sample(logits, smp.position_keys(keys, new_pos, smp.TAG_DRAFT + j), params)
        drafts.append(tok)
        if not params.greedy:
            qs.append(smp.probs(logits, params))
    q = None if params.greedy else jnp.stack(qs, axis=1)
    return jnp.stack(drafts, axis=1), q, cache


# ----------------------------------------------------------------------------------- jitted steps
@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("backend", "context_capacity", "use_mtp", "max_seqlen", "params"),
    donate_argnums=2,
)
def _prefill_step(
    graphdef,
    state,
    cache,
    ids,
    positions,
    slots,
    cu,
    next_ids,
    is_last,
    row_req,
    last_row,
    block_table,
    context_lens,
    keys,
    *,
    backend,
    context_capacity,
    use_mtp,
    max_seqlen,
    params=GREEDY,
):
    """One (chunk) round of packed prefill -> ``(cache, logits [B, V], first [B], d1 [B], q1 [B, V] |
    None, mtp hidden [B, hidden])`` at each request's last row of this round (meaningful for the
    requests whose prompt ends in this round)."""
    model = nnx.merge(graphdef, state)
    batch = AttentionBatch(
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu,
        block_table=block_table,
        context_lens=context_lens if context_capacity else None,
        mode="prefill",
        context_capacity=context_capacity,
        max_seqlen_q=max_seqlen,
        backend=backend,
    )
    h, cache = model(ids, batch, cache)
    logits = model.lm_logits(h[last_row])  # [B, V]
    lens = positions[last_row] + 1
    first = smp.sample(logits, smp.position_keys(keys, lens - 1, smp.TAG_SAMPLE), params)
    d1 = jnp.zeros(last_row.shape, jnp.int32)
    mh = jnp.zeros((last_row.shape[0], h.shape[-1]), h.dtype)
    q1 = None
    if use_mtp:
        nxt = jnp.where(is_last, first[row_req], next_ids)
        mh_all, mlog, cache = model.mtp_forward(nxt, h, batch, cache)
        ml = mlog[last_row]
        d1 = smp.sample(ml, smp.position_keys(keys, lens, smp.TAG_DRAFT), params)
        q1 = None if params.greedy else smp.probs(ml, params)
        mh = mh_all[last_row]
    return cache, logits, first, d1, q1, mh


@functools.partial(jax.jit, static_argnums=0, static_argnames=("backend", "page_size"), donate_argnums=2)
def _decode_step(graphdef, state, cache, tokens, pos, block_table, *, backend, page_size):
    """Teacher-forced decode of ``tokens [B, S]`` at positions ``pos [B, S]`` -> logits ``[B, S, V]``."""
    model = nnx.merge(graphdef, state)
    batch = _decode_batch(block_table, pos, page_size, backend)
    h, cache = model(tokens.reshape(-1), batch, cache)
    return cache, model.lm_logits(h).reshape(tokens.shape + (-1,))


def init_slot_state(B: int, max_pages: int, N: int, *, k: int, vocab: int, params: SamplingParams) -> dict:
    """Device-side state of ``B`` empty slots (all done): block table ``[B, max_pages]``, request keys,
    last token and its position, tokens emitted ``n_out`` / allowed ``limit``, output buffer ``[B, N]``,
    and with ``k`` drafts the next round's drafts (and their distributions when sampling)."""
    z = functools.partial(jnp.zeros, dtype=jnp.int32)
    st = {
        "block_table": z((B, max_pages)),
        "keys": jnp.zeros((B, 2), jnp.uint32),
        "last": z((B,)),
        "pos": z((B,)),
        "n_out": z((B,)),
        "limit": z((B,)),
        "done": jnp.ones((B,), bool),
        "out": z((B, N)),
        "rounds": z((B,)),
        "accepted": z((B,)),
    }
    if k:
        st["drafts"] = z((B, k))
        if not params.greedy:
            st["q"] = jnp.zeros((B, k, vocab), jnp.float32)
    return st


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("backend", "page_size", "k", "params"),
    donate_argnums=(2, 3),
)
def _admit(
    graphdef,
    state,
    cache,
    st,
    slot_ids,
    block_rows,
    keys,
    first,
    d1,
    q1,
    mh,
    lens,
    limits,
    eos,
    *,
    backend,
    page_size,
    k,
    params,
):
    """Write prefilled requests into their slots (``slot_ids [A]``; an id ``>= B`` is padding and is
    dropped): drafts the remaining k-1 MTP drafts, then scatters every per-request value."""
    model = nnx.merge(graphdef, state)
    B, N = st["out"].shape
    valid = slot_ids < B
    upd = {
        "block_table": block_rows,
        "keys": keys,
        "last": first,
        "pos": lens,
        "n_out": jnp.ones_like(lens),
        "limit": limits,
        "done": _isin(first, eos) | (limits <= 1),
        "out": jnp.zeros((slot_ids.shape[0], N), jnp.int32).at[:, 0].set(first),
        "rounds": jnp.zeros_like(lens),
        "accepted": jnp.zeros_like(lens),
    }
    if k:
        drafts, q, cache = _draft_chain(
            model, cache, d1, q1, mh, lens, block_rows, keys, valid,
            k=k, params=params, page_size=page_size, backend=backend,
        )  # fmt: skip
        upd["drafts"] = drafts
        if q is not None:
            upd["q"] = q
    st = {
        n: v.at[slot_ids].set(upd[n].astype(v.dtype), mode="drop") if n in upd else v for n, v in st.items()
    }
    return cache, st


def _plain_step(model, cache, st, eos, *, params, page_size, backend):
    active = ~st["done"]
    pos, n = st["pos"], st["n_out"]
    B, N = st["out"].shape
    batch = _decode_batch(st["block_table"], pos[:, None], page_size, backend, active)
    h, cache = model(st["last"], batch, cache)
    nxt = smp.sample(model.lm_logits(h), smp.position_keys(st["keys"], pos, smp.TAG_SAMPLE), params)
    out = st["out"].at[jnp.arange(B), jnp.where(active, n, N)].set(nxt, mode="drop")
    n_new = n + active
    fin = active & (_isin(nxt, eos) | (n_new >= st["limit"]))
    return cache, {
        **st,
        "out": out,
        "n_out": n_new,
        "done": st["done"] | fin,
        "pos": pos + active,
        "last": jnp.where(active, nxt, st["last"]),
    }


def _spec_round(model, cache, st, eos, *, k, params, page_size, backend):
    active = ~st["done"]
    pos, n, keys, bt, drafts = st["pos"], st["n_out"], st["keys"], st["block_table"], st["drafts"]
    B, N = st["out"].shape
    S = k + 1
    ar = jnp.arange(S, dtype=jnp.int32)
    rows = jnp.arange(B)
    toks = jnp.concatenate([st["last"][:, None], drafts], axis=1)  # [B, S]
    # one decode work (the sm90 schedule) for the verification and the MTP layer over the same k+1 positions
    batch = model.with_decode_work(_decode_batch(bt, pos[:, None] + ar[None, :], page_size, backend, active), cache)
    h, cache = model(toks.reshape(-1), batch, cache)
    logits = model.lm_logits(h).reshape(B, S, -1)
    if params.greedy:
        emitted = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        a = jnp.sum(jnp.cumprod((drafts == emitted[:, :k]).astype(jnp.int32), axis=1), axis=1)
    else:
        p = smp.probs(logits, params)
        u = jnp.stack(
            [
                jax.vmap(jax.random.uniform)(smp.position_keys(keys, pos, smp.TAG_ACCEPT + j))
                for j in range(k)
            ],
            axis=1,
        )
        a, emitted = smp.speculative_accept(
            drafts, st["q"], p, u, smp.position_keys(keys, pos, smp.TAG_RESIDUAL)
        )
    a = jnp.where(active, a, 0)
    # Emit tokens[:a + 1], cut after an EOS and at the request's limit.
    is_eos = _isin(emitted, eos) & (ar[None, :] <= a[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), S)
    n_emit = jnp.minimum(jnp.minimum(a + 1, first_eos + 1), st["limit"] - n)
    n_emit = jnp.where(active, n_emit, 0)
    idx = jnp.where(ar[None, :] < n_emit[:, None], n[:, None] + ar[None, :], N)
    out = st["out"].at[rows[:, None], idx].set(emitted, mode="drop")
    n_new = n + n_emit
    fin = active & ((first_eos < n_emit) | (n_new >= st["limit"]))
    new_pos = jnp.where(active, pos + a + 1, pos)
    new_last = jnp.where(active, emitted[rows, a], st["last"])
    # MTP over the same k+1 positions: input at pos+i is (h_{pos+i}, token_{pos+i+1}); row a drafts next.
    mh_all, mlog, cache = model.mtp_forward(emitted.reshape(-1), h, batch, cache)
    ml = mlog.reshape(B, S, -1)[rows, a]
    d1 = smp.sample(ml, smp.position_keys(keys, new_pos, smp.TAG_DRAFT), params)
    q1 = None if params.greedy else smp.probs(ml, params)
    mh = mh_all.reshape(B, S, -1)[rows, a]
    new_drafts, q, cache = _draft_chain(
        model, cache, d1, q1, mh, new_pos, bt, keys, active,
        k=k, params=params, page_size=page_size, backend=backend,
    )  # fmt: skip
    st = {
        **st,
        "out": out,
        "n_out": n_new,
        "done": st["done"] | fin,
        "pos": new_pos,
        "last": new_last,
        "drafts": new_drafts,
        "rounds": st["rounds"] + active,
        "accepted": st["accepted"] + a,
    }
    if q is not None:
        st["q"] = q
    return cache, st


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("backend", "page_size", "k", "params"),
    donate_argnums=(2, 3),
)
def _decode_loop(graphdef, state, cache, st, eos, max_steps, need_finish, *, backend, page_size, k, params):
    """Decode steps (k = 0) or speculative rounds over every slot until every slot is done, ``need_finish``
    slots have finished during this call, or ``max_steps`` steps ran -> ``(cache, st, steps)``."""
    model = nnx.merge(graphdef, state)
    done0 = st["done"]
    kw = {"params": params, "page_size": page_size, "backend": backend}

    def cond(c):
        _cache, s, i = c
        finished = jnp.sum((s["done"] & ~done0).astype(jnp.int32))
        return (i < max_steps) & jnp.any(~s["done"]) & (finished < need_finish)

    def body(c):
        cache, s, i = c
        if k:
            cache, s = _spec_round(model, cache, s, eos, k=k, **kw)
        else:
            cache, s = _plain_step(model, cache, s, eos, **kw)
        return cache, s, i + 1

    return jax.lax.while_loop(cond, body, (cache, st, jnp.int32(0)))
