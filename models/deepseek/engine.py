"""Inference engine: paged KV cache, batched (optionally chunked) prefill, greedy / sampled decode and MTP
speculative decode, every device step a ``jax.jit`` function and every decode loop inside one jit.

Flow of :meth:`Engine.generate` for prompts of different lengths:

1. Pages are allocated per request (``PageAllocator``; ``shuffle_pages=True`` hands them out in random
   order) for ``prompt + max_new_tokens (+ 2k + 1 with k speculative tokens)`` positions.
2. Prefill packs the prompts back to back (``cu_seqlens``; the packed length is padded to a multiple of
   ``token_bucket`` so few shapes compile).  With ``prefill_chunk=C`` each round feeds at most C tokens of
   every request and attends the earlier chunks from the paged cache (chunked context prefill).  The MTP
   layer is prefilled on the same chunks (its input at position i is ``(h_i, token_{i+1})``), giving the
   first draft.
3. Decode: plain decode runs ``max_new_tokens - 1`` steps of ``mla_decode`` with S = 1 in one
   ``lax.fori_loop``.  Speculative decode (greedy only) runs a ``lax.while_loop`` of rounds: verify
   ``[last token, d_1..d_k]`` at k+1 positions in one ``mla_decode`` call with S = k+1, accept the longest
   prefix of drafts equal to the greedy tokens plus one bonus token, run the MTP layer over the same
   k+1 positions (one S = k+1 call) and chain k-1 more MTP steps for the next drafts.  Cache rows written
   past the accepted length are never read before they are rewritten, so greedy speculative decoding
   gives exactly the tokens of greedy plain decoding (up to floating-point ties).

Decisions: generation always runs ``max_new_tokens`` (no EOS stop, so batch shapes stay static and the
equivalence tests are exact); sampled decoding (temperature / top-k) is for plain decode only, speculative
sampling (rejection sampling) is not implemented.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenspeed_jax.models.deepseek.attention import AttentionBatch
from tokenspeed_jax.models.deepseek.cache import KVCache, PageAllocator
from tokenspeed_jax.models.deepseek.model import check_token_ids
from tokenspeed_jax.models.deepseek.parallel import ShardedPages, data_size


def _slots(block_table, pos, page_size):
    """Cache slots of positions ``pos [B, S]`` through ``block_table [B, P]``."""
    page = jnp.take_along_axis(block_table, jnp.clip(pos // page_size, 0, block_table.shape[1] - 1), axis=1)
    return page * page_size + pos % page_size


def _decode_batch(block_table, pos, page_size, backend):
    """Decode metadata for tokens at positions ``pos [B, S]`` (request-major)."""
    _B, S = pos.shape
    return AttentionBatch(
        positions=pos.reshape(-1),
        slot_mapping=_slots(block_table, pos, page_size).reshape(-1),
        block_table=block_table,
        seq_lens=pos[:, -1] + 1,
        mode="decode",
        q_len=S,
        backend=backend,
    )


# ----------------------------------------------------------------------------------- jitted steps
@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("backend", "context_capacity", "use_mtp", "max_seqlen"),
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
    *,
    backend,
    context_capacity,
    use_mtp,
    max_seqlen,
):
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
    d1 = jnp.zeros(last_row.shape, jnp.int32)
    mh = jnp.zeros((last_row.shape[0], h.shape[-1]), h.dtype)
    if use_mtp:
        g0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        nxt = jnp.where(is_last, g0[row_req], next_ids)
        mh_all, mlog, cache = model.mtp_forward(nxt, h, batch, cache)
        d1 = jnp.argmax(mlog[last_row], axis=-1).astype(jnp.int32)
        mh = mh_all[last_row]
    return cache, logits, d1, mh


@functools.partial(jax.jit, static_argnums=0, static_argnames=("backend", "page_size"), donate_argnums=2)
def _decode_step(graphdef, state, cache, tokens, pos, block_table, *, backend, page_size):
    """Teacher-forced decode of ``tokens [B, S]`` at positions ``pos [B, S]`` -> logits ``[B, S, V]``."""
    model = nnx.merge(graphdef, state)
    batch = _decode_batch(block_table, pos, page_size, backend)
    h, cache = model(tokens.reshape(-1), batch, cache)
    return cache, model.lm_logits(h).reshape(tokens.shape + (-1,))


def _sample(logits, key, temperature, top_k):
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("backend", "page_size", "steps", "temperature", "top_k"),
    donate_argnums=2,
)
def _plain_loop(
    graphdef, state, cache, first, pos0, block_table, key, *, backend, page_size, steps, temperature, top_k
):
    """``steps`` decode steps (S = 1) from tokens ``first [B]`` at positions ``pos0 [B]``."""
    model = nnx.merge(graphdef, state)
    B = first.shape[0]
    out = jnp.zeros((B, steps), jnp.int32)

    def body(i, carry):
        cache, tok, out, key = carry
        key, sub = jax.random.split(key)
        batch = _decode_batch(block_table, (pos0 + i)[:, None], page_size, backend)
        h, cache = model(tok, batch, cache)
        nxt = _sample(model.lm_logits(h), sub, temperature, top_k)
        return cache, nxt, out.at[:, i].set(nxt), key

    cache, _, out, _ = jax.lax.fori_loop(0, steps, body, (cache, first, out, key))
    return cache, out


def _draft_chain(model, cache, d1, mh, new_pos, block_table, k, page_size, backend):
    """Drafts ``[B, k]``: ``d1`` then k-1 chained MTP steps (position ``new_pos + j - 1`` for draft j+1)."""
    drafts, tok, h = [d1], d1, mh
    for j in range(1, k):
        batch = _decode_batch(block_table, (new_pos + j - 1)[:, None], page_size, backend)
        h, logits, cache = model.mtp_forward(tok, h, batch, cache)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1), cache


@functools.partial(
    jax.jit, static_argnums=0, static_argnames=("backend", "page_size", "k", "max_new"), donate_argnums=2
)
def _spec_loop(graphdef, state, cache, first, d1, mh, pos0, block_table, *, backend, page_size, k, max_new):
    """Greedy MTP speculative decode (module docstring).  ``first [B]`` is the first generated token at
    positions ``pos0 [B]``; returns ``(cache, tokens [B, max_new + k + 1], rounds [B], accepted [B])``."""
    model = nnx.merge(graphdef, state)
    B = first.shape[0]
    S = k + 1
    N = max_new + S
    drafts, cache = _draft_chain(model, cache, d1, mh, pos0, block_table, k, page_size, backend)
    out = jnp.zeros((B, N), jnp.int32).at[:, 0].set(first)
    carry = (
        cache,
        first,
        drafts,
        pos0,
        out,
        jnp.ones((B,), jnp.int32),
        jnp.zeros((B,), jnp.int32),
        jnp.zeros((B,), jnp.int32),
    )
    ar = jnp.arange(S, dtype=jnp.int32)
    rows = jnp.arange(B)

    def cond(c):
        return jnp.any(c[5] < max_new)

    def body(c):
        cache, last, drafts, pos, out, n_out, rounds, accepted = c
        active = n_out < max_new
        toks = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, S]
        posm = pos[:, None] + ar[None, :]
        batch = _decode_batch(block_table, posm, page_size, backend)
        h, cache = model(toks.reshape(-1), batch, cache)
        g = jnp.argmax(model.lm_logits(h), axis=-1).astype(jnp.int32).reshape(B, S)
        a = jnp.sum(jnp.cumprod((drafts == g[:, :k]).astype(jnp.int32), axis=1), axis=1)  # accepted drafts
        a = jnp.where(active, a, 0)
        idx = jnp.where((ar[None, :] <= a[:, None]) & active[:, None], n_out[:, None] + ar[None, :], N)
        out = out.at[rows[:, None], idx].set(g, mode="drop")
        new_pos = jnp.where(active, pos + a + 1, pos)
        new_last = jnp.where(active, g[rows, a], last)
        # MTP over the same k+1 positions: input at pos+i is (h_{pos+i}, g_i); row a drafts the next token.
        mh_all, mlog, cache = model.mtp_forward(g.reshape(-1), h, batch, cache)
        mlog = mlog.reshape(B, S, -1)
        d1 = jnp.argmax(mlog[rows, a], axis=-1).astype(jnp.int32)
        mh = mh_all.reshape(B, S, -1)[rows, a]
        drafts, cache = _draft_chain(model, cache, d1, mh, new_pos, block_table, k, page_size, backend)
        return (
            cache,
            new_last,
            drafts,
            new_pos,
            out,
            n_out + jnp.where(active, a + 1, 0),
            rounds + active.astype(jnp.int32),
            accepted + a,
        )

    cache, _, _, _, out, _, rounds, accepted = jax.lax.while_loop(cond, body, carry)
    return cache, out, rounds, accepted


# ------------------------------------------------------------------------------------------- engine
@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


class Engine:
    """Owns one model's parameters (split once), a paged cache and a page allocator.

    Args:
      model: a :class:`~tokenspeed_jax.models.deepseek.model.DeepseekV3`.
      page_size: tokens per cache page (a power of two in 16..256, the decode kernels' constraint).
      kv_dtype: cache dtype (default the model's compute dtype; ``jnp.float8_e4m3fn`` for an FP8 cache
        with scale ``k_scale``).
      backend: attention backend for every tokenspeed op ("auto", "xla", "sm90", ...).
      prefill_chunk: chunked context prefill with at most this many tokens per request per round.
      shuffle_pages, seed: hand out pages in random order (tests).
      token_bucket: packed prefill lengths are padded to a multiple of this.
      cache_fill: initial cache value (NaN in tests: rows never written must never be read).
    """

    def __init__(
        self,
        model,
        *,
        page_size: int = 16,
        kv_dtype=None,
        k_scale: float = 1.0,
        backend: str = "auto",
        prefill_chunk: int | None = None,
        shuffle_pages: bool = False,
        seed: int = 0,
        token_bucket: int = 16,
        cache_fill: float = 0.0,
    ):
        self.model = model
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)
        self.page_size = page_size
        self.kv_dtype = jnp.dtype(model.dtype if kv_dtype is None else kv_dtype)
        self.k_scale = k_scale
        self.backend = backend
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: expected a positive int or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.shuffle_pages = shuffle_pages
        self.seed = seed
        self.token_bucket = token_bucket
        self.cache_fill = cache_fill
        self.cache: KVCache | None = None
        self.allocator: PageAllocator | None = None

    # ------------------------------------------------------------------------------ setup
    def reset(self, lengths: list[int]) -> None:
        """Fresh cache and allocator with room for requests of the given total lengths."""
        ps = self.page_size
        self.max_pages = max(-(-n // ps) for n in lengths)
        mesh = getattr(self.model, "mesh", None)
        if data_size(mesh) > 1:  # DP attention: each data rank owns its requests' pages (local ids)
            self.allocator = ShardedPages(
                lengths, ps, data_size(mesh), shuffle=self.shuffle_pages, seed=self.seed
            )
            num_pages = self.allocator.num_pages
        else:
            num_pages = sum(-(-n // ps) for n in lengths) + 1
            self.allocator = PageAllocator(num_pages, ps, shuffle=self.shuffle_pages, seed=self.seed)
            for r, n in enumerate(lengths):
                self.allocator.allocate(r, n)
        self.block_table = jnp.asarray(self.allocator.block_table(list(range(len(lengths))), self.max_pages))
        self.cache = KVCache.create(
            self.config,
            num_pages=num_pages,
            page_size=ps,
            dtype=self.kv_dtype,
            k_scale=self.k_scale,
            fill=self.cache_fill,
            mesh=mesh,
        )

    def _bucket(self, n: int) -> int:
        b = self.token_bucket
        return max(b, -(-n // b) * b)

    # ---------------------------------------------------------------------------- prefill
    def prefill(self, prompts: list[list[int]], *, use_mtp: bool = False):
        """Prefill every prompt (chunked if configured) -> ``(last logits [B, V], first draft [B],
        MTP hidden [B, hidden])``; ``reset`` must have been called."""
        B = len(prompts)
        lens = [len(p) for p in prompts]
        if min(lens) < 1:
            raise ValueError("prompts: expected every prompt to have at least one token")
        for i, p in enumerate(prompts):
            check_token_ids(np.asarray(list(p), np.int64), self.config.vocab_size, f"prompts[{i}]")
        C = self.prefill_chunk or max(lens)
        rounds = -(-max(lens) // C)
        outs = [None] * B
        for r in range(rounds):
            starts = [min(r * C, n) for n in lens]
            ends = [min((r + 1) * C, n) for n in lens]
            counts = [e - s for s, e in zip(starts, ends)]
            # DP attention: requests of data rank d are packed in slab d (rows d*Tl ..), with their own
            # offsets (cu = n concatenated [B/n + 1] arrays); n = 1 is the ordinary packed batch.
            nd = data_size(getattr(self.model, "mesh", None))
            Bl = B // nd
            Tl = self._bucket(max(sum(counts[d * Bl : (d + 1) * Bl]) for d in range(nd)))
            T = nd * Tl
            ids = np.zeros(T, np.int32)
            nxt = np.zeros(T, np.int32)
            positions = np.zeros(T, np.int32)
            slots = np.full(T, -1, np.int32)
            is_last = np.zeros(T, bool)
            row_req = np.zeros(T, np.int32)
            last_row = np.zeros(B, np.int32)
            cu = np.zeros(nd * (Bl + 1), np.int32)
            o = 0
            for b, (s, e) in enumerate(zip(starts, ends)):
                if b % Bl == 0:
                    o = (b // Bl) * Tl
                n = e - s
                ids[o : o + n] = prompts[b][s:e]
                nxt[o : o + n] = list(prompts[b][s + 1 : e + 1]) + [0] * (n - len(prompts[b][s + 1 : e + 1]))
                positions[o : o + n] = np.arange(s, e)
                slots[o : o + n] = self.allocator.slots(b, np.arange(s, e))
                row_req[o : o + n] = b
                if n and e == lens[b]:
                    is_last[o + n - 1] = True
                last_row[b] = o + n - 1 if n else 0
                o += n
                cu[(b // Bl) * (Bl + 1) + b % Bl + 1] = o - (b // Bl) * Tl
            ctx = np.asarray(starts, np.int32)
            cap = self._bucket(int(ctx.sum())) if r > 0 else 0
            self.cache, logits, d1, mh = _prefill_step(
                self.graphdef,
                self.state,
                self.cache,
                jnp.asarray(ids),
                jnp.asarray(positions),
                jnp.asarray(slots),
                jnp.asarray(cu),
                jnp.asarray(nxt),
                jnp.asarray(is_last),
                jnp.asarray(row_req),
                jnp.asarray(last_row),
                self.block_table,
                jnp.asarray(ctx),
                backend=self.backend,
                context_capacity=cap,
                use_mtp=use_mtp,
                max_seqlen=self._bucket(max(counts)),
            )
            done = [b for b in range(B) if counts[b] and ends[b] == lens[b]]
            if done:
                sel = jnp.asarray(np.array(done, np.int32))
                part = (logits[sel], d1[sel], mh[sel])
                for i, b in enumerate(done):
                    outs[b] = tuple(x[i] for x in part)
        logits, d1, mh = (jnp.stack([o[i] for o in outs]) for i in range(3))
        return logits, d1, mh

    def decode(self, tokens, positions) -> jax.Array:
        """Teacher-forced decode: ``tokens [B, S]`` at ``positions [B, S]`` -> logits ``[B, S, V]`` float32
        (one ``mla_decode`` call per layer with this S); writes the tokens into the cache."""
        check_token_ids(np.asarray(tokens), self.config.vocab_size, "tokens")
        self.cache, logits = _decode_step(
            self.graphdef,
            self.state,
            self.cache,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            self.block_table,
            backend=self.backend,
            page_size=self.page_size,
        )
        return logits

    # --------------------------------------------------------------------------- generate
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        num_speculative_tokens: int = 0,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> GenerateOutput:
        """Generate ``max_new_tokens`` tokens for every prompt (greedy unless ``temperature > 0``)."""
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        k = int(num_speculative_tokens)
        if k < 0 or k + 1 > 16:
            raise ValueError(f"num_speculative_tokens: expected 0..15 (mla_decode takes S <= 16), got {k}")
        if k and not self.config.num_nextn_predict_layers:
            raise ValueError(
                "num_speculative_tokens: the model has no MTP layer (num_nextn_predict_layers = 0)"
            )
        if k and temperature > 0:
            raise NotImplementedError(
                "temperature: speculative decoding is greedy only (no rejection sampling)"
            )
        for i, p in enumerate(prompts):
            check_token_ids(np.asarray(list(p), np.int64), self.config.vocab_size, f"prompts[{i}]")
        prompts = [[int(t) for t in p] for p in prompts]
        n_real = len(prompts)
        # DP attention: pad with one-token requests to whole data ranks
        prompts = prompts + [[0]] * (-n_real % data_size(getattr(self.model, "mesh", None)))
        lens = [len(p) for p in prompts]
        extra = max_new_tokens + (2 * k + 1 if k else 0)
        self.reset([n + extra for n in lens])
        t0 = time.perf_counter()
        logits, d1, mh = self.prefill(prompts, use_mtp=bool(k))
        key = jax.random.PRNGKey(seed)
        key, sub = jax.random.split(key)
        first = _sample(logits, sub, temperature, top_k)
        first.block_until_ready()
        t1 = time.perf_counter()
        pos0 = jnp.asarray(np.asarray(lens, np.int32))
        res = GenerateOutput(tokens=[], prefill_tokens=sum(lens[:n_real]), prefill_s=t1 - t0)
        if k:
            self.cache, out, rounds, accepted = _spec_loop(
                self.graphdef,
                self.state,
                self.cache,
                first,
                d1,
                mh,
                pos0,
                self.block_table,
                backend=self.backend,
                page_size=self.page_size,
                k=k,
                max_new=max_new_tokens,
            )
            out = np.asarray(out)
            res.draft_tokens = int(np.asarray(rounds).sum()) * k
            res.accepted_tokens = int(np.asarray(accepted).sum())
        elif max_new_tokens > 1:
            self.cache, rest = _plain_loop(
                self.graphdef,
                self.state,
                self.cache,
                first,
                pos0,
                self.block_table,
                key,
                backend=self.backend,
                page_size=self.page_size,
                steps=max_new_tokens - 1,
                temperature=float(temperature),
                top_k=top_k,
            )
            out = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
        else:
            out = np.asarray(first)[:, None]
        res.decode_s = time.perf_counter() - t1
        res.decode_tokens = n_real * (max_new_tokens - 1)
        res.tokens = [list(map(int, row[:max_new_tokens])) for row in out][:n_real]
        return res


def generate(model, prompts, max_new_tokens: int, *, num_speculative_tokens: int = 0, **engine_kwargs):
    """Greedy generation: ``max_new_tokens`` new token ids per prompt (list of lists).

    ``num_speculative_tokens = k > 0`` uses MTP speculative decoding with k drafts per round (same tokens
    as plain greedy decoding).  ``engine_kwargs`` go to :class:`Engine` (page_size, backend, kv_dtype,
    prefill_chunk, ...)."""
    eng = Engine(model, **engine_kwargs)
    return eng.generate(
        [list(p) for p in prompts], max_new_tokens, num_speculative_tokens=num_speculative_tokens
    ).tokens
