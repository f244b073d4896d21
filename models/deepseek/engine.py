"""Inference engine: paged KV cache, a fixed number of decode slots with continuous batching, batched
(optionally chunked) prefill, greedy / sampled decode, MTP speculative decode (greedy or rejection
sampling), EOS stops and streaming.  Every device step is a ``jax.jit`` function with static shapes and
every decode loop runs inside one jit.

Flow of :meth:`Engine.generate` (``R`` requests, ``B`` slots: ``max_slots``, default ``R``):

1. **Admission** (host): a free slot takes the next pending request when the page allocator has room
   for ``prompt + max_new_tokens (+ 2k + 1 with k speculative tokens)`` positions.  With
   ``batching="continuous"`` (default) this happens whenever a request finishes and its pages return to
   the allocator; with ``batching="static"`` only when every slot is free (the classic batch-by-batch
   baseline, kept for the benchmark).
2. **Prefill** of the admitted requests, packed back to back (``cu_seqlens``; the packed length and the
   number of requests are padded to buckets so few shapes compile).  With ``prefill_chunk=C`` each
   round feeds at most C tokens of every request and attends the earlier chunks from the paged cache.
   The first token is sampled inside the prefill step; with MTP the MTP layer is prefilled on the same
   chunks (its input at position i is ``(h_i, token_{i+1})``, the sampled first token at the last
   position), giving the first draft; ``_admit`` drafts the other k-1 and writes the request into its
   slot's row of the device-side slot state.
3. **Decode loop** (``_decode_loop``, one ``lax.while_loop`` in one jit over all ``B`` slots): plain
   decode samples one token per step (S = 1); speculative decode verifies ``[last, d_1..d_k]`` in one
   ``mla_decode`` call with S = k+1, accepts drafts (greedy: the longest prefix equal to the argmax
   tokens; sampling: rejection sampling, :func:`~tokenspeed_jax.models.deepseek.sampling.speculative_accept`),
   emits the accepted drafts plus one corrected / bonus token, runs the MTP layer over the same k+1
   positions and chains k-1 more MTP steps for the next drafts.  A slot finishes at an EOS token or at
   its ``max_new_tokens``; the loop returns to the host once ``refill_at`` slots have finished while
   requests are pending (continuous batching; default an eighth of the slots), or when every slot is done.  ``stream`` runs the same loop one step
   per call.

DP attention (a model on a mesh with ``data = n > 1``, :mod:`~tokenspeed_jax.models.deepseek.parallel`):
the ``B`` slots (a multiple of n) are split into n groups of ``B / n``, slot ``s`` belonging to data rank
``s // (B / n)``, and each rank has its own page allocator over its share ``num_pages / n`` of the cache
(:class:`~tokenspeed_jax.models.deepseek.parallel.ShardedPages`; block tables and slots hold shard-local
page ids).  Admission puts the next request on the rank with a free slot and room for it that serves the
fewest requests (then the most free pages); its pages come from that rank.  The prefill batch of an
admission holds ``A / n`` entries per rank (rank d's admitted requests, padded with empty ones) packed
as per-rank slabs, and the decode loop's rows are the slots in order, so attention (prefill, decode and
the cache writes) runs per rank under ``shard_map`` on local data while the dense / MoE layers see the
whole batch.  With ``n = 1`` all of this is the ordinary single allocator and slot order.

Decisions:

* **EOS is included** in the returned tokens (as transformers' ``generate`` does): a request's tokens end
  with its EOS id when it stopped there, ``stop_reasons`` says ``"eos"`` or ``"length"``.
* **Finished requests stop emitting at once and stop costing compute when the loop returns**: within one
  ``_decode_loop`` call the batch shape is static, so a finished slot still runs through the model
  (masked: it writes no cache rows and emits nothing) until the loop exits; the loop exits when every
  slot is done (no step runs for a batch whose requests all stopped) or, with pending requests, once
  ``refill_at`` have finished, and the freed slots get the next requests.
* **Inactive slots** write nothing (slot mapping -1) and read whatever their block-table row points at;
  their outputs are discarded.
* Cache rows written past the accepted length are never read before they are rewritten, so greedy
  speculative decoding gives exactly the tokens of greedy plain decoding in fp32 (up to floating-point
  ties; bf16 near-ties: ``docs/model.md``).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenspeed_jax.models.deepseek import sampling as smp
from tokenspeed_jax.models.deepseek.cache import KVCache
from tokenspeed_jax.models.deepseek.config import is_int
from tokenspeed_jax.models.deepseek.model import check_token_ids
from tokenspeed_jax.models.deepseek.parallel import ShardedPages, data_size
from tokenspeed_jax.models.deepseek.sampling import SamplingParams
from tokenspeed_jax.models.deepseek.compile_cache import enable_compilation_cache
from tokenspeed_jax.models.deepseek.steps import (  # noqa: F401  (_decode_step / _prefill_step: tests, benchmarks)
    GREEDY,
    _admit,
    _decode_loop,
    _decode_step,
    _prefill_step,
    init_slot_state,
)


# ------------------------------------------------------------------------------------------- engine
@dataclasses.dataclass
class TokenEvent:
    """Tokens a request produced in one step (``stream`` callback / :meth:`Engine.stream` item)."""

    request: int
    tokens: list[int]
    finished: bool


@dataclasses.dataclass
class GenerateOutput:
    """Per-request tokens (EOS included when a request stopped there) and timing.

    ``prefill_s`` is the time of the prefill + admission calls, ``decode_s`` of the decode loops,
    ``wall_s`` of the whole call; ``decode_tokens`` counts the tokens after each request's first;
    ``decode_steps`` the decode steps (speculative rounds) the loops ran, ``decode_calls`` the loops."""

    tokens: list[list[int]]
    stop_reasons: list[str] = dataclasses.field(default_factory=list)
    texts: list[str] | None = None
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    decode_calls: int = 0
    decode_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def _pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


class Engine:
    """Owns one model's parameters (split once), a paged cache, a page allocator and the decode slots.

    Args:
      model: a :class:`~tokenspeed_jax.models.deepseek.model.DeepseekV3`.
      page_size: tokens per cache page (a power of two in 16..256, the decode kernels' constraint).
      kv_dtype: cache dtype (default the model's compute dtype; ``jnp.float8_e4m3fn`` for an FP8 cache
        with scale ``k_scale``).
      backend: attention backend for every tokenspeed op ("auto", "xla", "sm90", ...).
      prefill_chunk: chunked context prefill with at most this many tokens per request per round.
      max_slots: requests decoded together (static batch of the decode loop); default: all requests of
        a ``generate`` call (rounded up to a multiple of the mesh's data axis).  More requests than slots
        are admitted as slots free up.  With DP attention a multiple of ``data``: ``max_slots / data``
        slots per data rank.
      batching: ``"continuous"`` admits a request whenever a slot and its pages are free;
        ``"static"`` only when every slot is free (batch after batch).
      refill_at: continuous batching: the decode loop returns to the host to admit pending requests once
        this many slots have finished (at most the number pending; default ``max(1, slots // 8)``).  Each
        return costs a host round trip and a prefill call, several decode steps of a small model, while a
        finished slot idles until the return: admitting in groups keeps both small (one slot at a time ran
        below static batching on the H200, ``docs/model.md``).
      num_pages: pages in the cache (default: room for ``max_slots`` of the longest request).  With DP
        attention the pages of all data ranks, a multiple of ``data``: each rank holds ``num_pages / data``
        (default: room for its ``max_slots / data`` slots of the longest request, plus one page).
      tokenizer: a :class:`~tokenspeed_jax.models.deepseek.tokenizer.Tokenizer` (text prompts, ``texts``).
      compilation_cache: enable JAX's persistent compilation cache (:func:`enable_compilation_cache`);
        ``False`` leaves JAX's configuration alone.
      shuffle_pages, seed: hand out pages in random order (tests).
      token_bucket: packed prefill lengths are padded to ``token_bucket`` times a power of two.
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
        max_slots: int | None = None,
        batching: str = "continuous",
        refill_at: int | None = None,
        num_pages: int | None = None,
        tokenizer=None,
        compilation_cache: bool = True,
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
        if max_slots is not None and max_slots < 1:
            raise ValueError(f"max_slots: expected a positive int or None, got {max_slots}")
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching: expected 'continuous' or 'static', got {batching!r}")
        if refill_at is not None and (isinstance(refill_at, bool) or not isinstance(refill_at, int) or refill_at < 1):
            raise ValueError(f"refill_at: expected a positive int or None, got {refill_at!r}")
        self.data = data_size(getattr(model, "mesh", None))
        if max_slots is not None and max_slots % self.data:
            raise ValueError(
                f"max_slots: DP attention (mesh data = {self.data}) gives every data rank max_slots / data "
                f"slots, expected a multiple of {self.data}, got {max_slots}"
            )
        if num_pages is not None and (num_pages < 1 or num_pages % self.data):
            raise ValueError(
                f"num_pages: expected a positive multiple of the mesh's data axis ({self.data}: every data "
                f"rank holds num_pages / data pages), got {num_pages}"
            )
        self.prefill_chunk = prefill_chunk
        self.max_slots = max_slots
        self.batching = batching
        self.refill_at = refill_at
        self.num_pages = num_pages
        self.tokenizer = tokenizer
        self.compilation_cache_dir = enable_compilation_cache() if compilation_cache else None
        self.shuffle_pages = shuffle_pages
        self.seed = seed
        self.token_bucket = token_bucket
        self.cache_fill = cache_fill
        self.cache: KVCache | None = None
        self.allocator: ShardedPages | None = None

    # ------------------------------------------------------------------------------ setup
    def _new_cache(self) -> None:
        """A cache of the allocator's pages (all data ranks), created with its sharding on a mesh."""
        self.cache = KVCache.create(
            self.config,
            num_pages=self.allocator.num_pages,
            page_size=self.page_size,
            dtype=self.kv_dtype,
            k_scale=self.k_scale,
            fill=self.cache_fill,
            mesh=getattr(self.model, "mesh", None),
        )

    def reset(self, lengths: list[int]) -> None:
        """Fresh cache and allocator holding requests ``0..R-1`` of the given total lengths (low-level
        API of :meth:`prefill` / :meth:`decode`); with DP attention request ``b`` lives on data rank
        ``b // (R / data)``."""
        ps, n, R = self.page_size, self.data, len(lengths)
        if R % n:
            raise ValueError(
                f"lengths: DP attention (mesh data = {n}) puts R / data requests on every data rank, "
                f"expected a multiple of {n} requests, got {R}"
            )
        per = R // n
        pages = [-(-m // ps) for m in lengths]
        self.max_pages = max(pages)
        local = max(sum(pages[d * per : (d + 1) * per]) for d in range(n)) + 1
        self.allocator = ShardedPages(local, ps, n, shuffle=self.shuffle_pages, seed=self.seed)
        for r, m in enumerate(lengths):
            self.allocator.allocate(r, m, r // per)
        self.block_table = jnp.asarray(self.allocator.block_table(list(range(R)), self.max_pages))
        self._new_cache()

    def _bucket(self, n: int) -> int:
        """``token_bucket`` times the next power of two (few distinct prefill shapes)."""
        b = self.token_bucket
        return b * _pow2_at_least(-(-n // b))

    # ---------------------------------------------------------------------------- prefill
    def _prefill(self, prompts, requests, keys, *, use_mtp, params):
        """Prefill ``prompts`` of allocator ``requests`` (``None`` with an empty prompt: a padding entry)
        -> per-entry ``(logits, first, d1, q1, mh, block rows)``.  With DP attention entry ``b`` of the
        ``B`` entries must live on data rank ``b // (B / data)`` (its slab below)."""
        B = len(prompts)
        lens = [len(p) for p in prompts]
        block_rows = jnp.asarray(self.allocator.block_table(list(requests), self.max_pages))
        C = self.prefill_chunk or max(lens)
        rounds = -(-max(lens) // C)
        outs: list = [None] * B
        for r in range(rounds):
            starts = [min(r * C, n) for n in lens]
            ends = [min((r + 1) * C, n) for n in lens]
            counts = [e - s for s, e in zip(starts, ends)]
            # DP attention: requests of data rank d are packed in slab d (rows d*Tl ..), with their own
            # offsets (cu = n concatenated [B/n + 1] arrays); n = 1 is the ordinary packed batch.
            nd = self.data
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
                if n:
                    ids[o : o + n] = prompts[b][s:e]
                    ahead = list(prompts[b][s + 1 : e + 1])
                    nxt[o : o + n] = ahead + [0] * (n - len(ahead))
                    positions[o : o + n] = np.arange(s, e)
                    slots[o : o + n] = self.allocator.slots(requests[b], np.arange(s, e))
                    row_req[o : o + n] = b
                    if e == lens[b]:
                        is_last[o + n - 1] = True
                last_row[b] = o + n - 1 if n else 0
                o += n
                cu[(b // Bl) * (Bl + 1) + b % Bl + 1] = o - (b // Bl) * Tl
            ctx = np.asarray(starts, np.int32)
            cap = self._bucket(int(ctx.sum())) if r > 0 else 0
            self.cache, logits, first, d1, q1, mh = _prefill_step(
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
                block_rows,
                jnp.asarray(ctx),
                keys,
                backend=self.backend,
                context_capacity=cap,
                use_mtp=use_mtp,
                max_seqlen=self._bucket(max(counts)),
                params=params,
            )
            if rounds == 1:
                return logits, first, d1, q1, mh, block_rows
            done = [b for b in range(B) if counts[b] and ends[b] == lens[b]]
            if done:
                sel = jnp.asarray(np.array(done, np.int32))
                part = [None if x is None else x[sel] for x in (logits, first, d1, q1, mh)]
                for i, b in enumerate(done):
                    outs[b] = [None if x is None else x[i] for x in part]
        res = []
        for i in range(5):
            vals = [o[i] if o is not None else None for o in outs]
            ref = next(v for v in vals if v is not None) if any(v is not None for v in vals) else None
            res.append(
                None if ref is None else jnp.stack([jnp.zeros_like(ref) if v is None else v for v in vals])
            )
        return (*res, block_rows)

    def prefill(self, prompts: list[list[int]], *, use_mtp: bool = False):
        """Prefill every prompt (chunked if configured) -> ``(last logits [B, V], first draft [B],
        MTP hidden [B, hidden])`` (greedy draft); :meth:`reset` must have been called."""
        if min(len(p) for p in prompts) < 1:
            raise ValueError("prompts: expected every prompt to have at least one token")
        for i, p in enumerate(prompts):
            check_token_ids(np.asarray(p, np.int64), self.config.vocab_size, f"prompts[{i}]")
        if len(prompts) != self.block_table.shape[0]:
            raise ValueError(
                f"prompts: expected the {self.block_table.shape[0]} requests of reset(), got {len(prompts)}"
            )
        keys = jnp.zeros((len(prompts), 2), jnp.uint32)
        logits, _first, d1, _q1, mh, _ = self._prefill(
            prompts, list(range(len(prompts))), keys, use_mtp=use_mtp, params=GREEDY
        )
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
    def _check(self, prompts, max_new_tokens, num_speculative_tokens, eos_token_id):
        if isinstance(prompts, str | bytes) or len(prompts) == 0:
            raise ValueError("prompts: expected a non-empty list of prompts (token-id lists or strings)")
        if any(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError(
                    "prompts: text prompts need a tokenizer (Engine(..., tokenizer=load_tokenizer(dir)))"
                )
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        V = self.config.vocab_size
        checked = []
        for i, p in enumerate(prompts):
            p = list(np.asarray(p)) if hasattr(p, "shape") else list(p)  # arrays: NumPy scalars
            if not p:
                raise ValueError(
                    f"prompts: expected every prompt to have at least one token, prompt {i} is empty"
                )
            # Ints only (a float, bool or string id is refused, never truncated or parsed), range-checked
            # as Python ints first: an id past int64 must name the prompt, not overflow in NumPy.
            for j, t in enumerate(p):
                if not is_int(t):
                    raise ValueError(f"prompts[{i}]: expected integer token ids, got {t!r:.40} at index {j}")
                if not 0 <= t < V:  # check_token_ids' message, for ids of any size
                    raise ValueError(f"prompts[{i}]: token id {int(t)} at index {j} is outside the vocabulary "
                                     f"[0, {V})")
            checked.append([int(t) for t in p])
        prompts = checked
        if is_int(max_new_tokens):
            limits = [max_new_tokens] * len(prompts)
        else:
            try:
                limits = list(max_new_tokens)
            except TypeError:
                limits = None
        if limits is None or len(limits) != len(prompts) or any(not is_int(m) or m < 1 for m in limits):
            raise ValueError(
                f"max_new_tokens: expected an int >= 1 or one per prompt, got {max_new_tokens!r:.80}"
            )
        limits = [int(m) for m in limits]
        if not is_int(num_speculative_tokens):
            raise ValueError(f"num_speculative_tokens: expected an int, got {num_speculative_tokens!r:.40}")
        ctx = self.config.max_position_embeddings  # a sequence (prompt + output) fits the context
        for i, p in enumerate(prompts):
            if len(p) >= ctx:
                raise ValueError(
                    f"prompts[{i}]: {len(p)} tokens, the model's context (max_position_embeddings) is {ctx}: "
                    f"expected a prompt of at most {ctx - 1} tokens"
                )
        limits = [min(m, ctx - len(p)) for p, m in zip(prompts, limits)]
        k = int(num_speculative_tokens)
        if k < 0 or k + 1 > 16:
            raise ValueError(f"num_speculative_tokens: expected 0..15 (mla_decode takes S <= 16), got {k}")
        if k and not self.config.num_nextn_predict_layers:
            raise ValueError(
                "num_speculative_tokens: the model has no MTP layer (num_nextn_predict_layers = 0)"
            )
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id
        if eos_token_id is None:
            eos = []
        elif is_int(eos_token_id):
            eos = [eos_token_id]
        else:
            try:
                eos = list(eos_token_id)
            except TypeError:
                eos = [eos_token_id]  # not iterable: reported just below
        if isinstance(eos_token_id, str | bytes) or not all(is_int(e) for e in eos):
            raise ValueError(f"eos_token_id: expected an int, a list of ints or None, got {eos_token_id!r:.80}")
        return prompts, [int(m) for m in limits], k, [int(e) for e in eos]

    def stream(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int | Sequence[int],
        *,
        num_speculative_tokens: int = 0,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_token_id: int | Sequence[int] | None = None,
        step_events: bool = True,
    ) -> Iterator[TokenEvent]:
        """Iterator variant of :meth:`generate`: yields a :class:`TokenEvent` per request and step as the
        tokens are produced (the decode loop returns to the host after every step); its return value
        (``StopIteration.value``) is the :class:`GenerateOutput`.  ``step_events=False`` runs whole loops
        and yields only when requests finish (what :meth:`generate` uses)."""
        prompts, limits, k, eos = self._check(prompts, max_new_tokens, num_speculative_tokens, eos_token_id)
        self._drafts = self._accepted = 0  # per-slot counters are summed as requests finish (_harvest)
        params = SamplingParams(float(temperature), top_k or None, top_p)
        if params.greedy:  # top-k / top-p do not matter: one compilation for every greedy call
            params = GREEDY
        R = len(prompts)
        nd = self.data
        B = self.max_slots or nd * -(-R // nd)  # DP attention: whole data ranks of slots
        Bl = B // nd  # slot s lives on data rank s // Bl
        extra = 2 * k + 1 if k else 0
        totals = [len(p) + m + extra for p, m in zip(prompts, limits)]
        ps = self.page_size
        need = -(-max(totals) // ps)
        self.max_pages = _pow2_at_least(need)  # block-table width in buckets: few decode-loop shapes
        local = self.num_pages // nd if self.num_pages else Bl * need + 1  # pages per data rank
        if need > local:
            raise ValueError(
                f"num_pages: a request needs {need} pages of {ps} tokens, the cache has {local}"
                + (f" per data rank (num_pages / data = {self.num_pages} / {nd})" if nd > 1 else "")
            )
        self.allocator = ShardedPages(local, ps, nd, shuffle=self.shuffle_pages, seed=self.seed)
        self._new_cache()
        N = _pow2_at_least(max(limits) + k + 1, 8)
        st = init_slot_state(B, self.max_pages, N, k=k, vocab=self.config.vocab_size, params=params)
        eos_arr = jnp.asarray(np.array(eos or [-1], np.int32))
        req_keys = np.asarray(smp.request_keys(seed, jnp.arange(R)))
        skw = {"backend": self.backend, "page_size": ps, "k": k, "params": params}

        pending = collections.deque(range(R))
        slot_req = [-1] * B
        sent = [0] * R
        tokens: list[list[int] | None] = [None] * R
        res = GenerateOutput(tokens=[], prefill_tokens=sum(len(p) for p in prompts))
        t_start = time.perf_counter()
        while True:
            # ---- admission (host): free slots take pending requests (FIFO) while pages last
            admitted = []
            if self.batching == "continuous" or all(r < 0 for r in slot_req):
                while pending:
                    s = self._pick_slot(slot_req, Bl, self.allocator.pages_for(totals[pending[0]]))
                    if s is None:
                        break
                    r = pending.popleft()
                    self.allocator.allocate(r, totals[r], s // Bl)
                    slot_req[s] = r
                    admitted.append((s, r))
            if admitted:
                t0 = time.perf_counter()
                # the prefill batch: A / nd entries per data rank, rank d's admitted requests first in
                # its part (entry b on rank b // (A / nd), as the slabs and the decode rows need)
                per_rank = [[(s, r) for s, r in admitted if s // Bl == d] for d in range(nd)]
                Al = min(_pow2_at_least(max(len(a) for a in per_rank)), Bl)
                entries = [a[i] if i < len(a) else None for a in per_rank for i in range(Al)]
                reqs = [None if e is None else e[1] for e in entries]
                keys = np.stack([req_keys[r] if r is not None else np.zeros(2, np.uint32) for r in reqs])
                _logits, first, d1, q1, mh, rows = self._prefill(
                    [[] if r is None else prompts[r] for r in reqs], reqs, jnp.asarray(keys),
                    use_mtp=bool(k), params=params,
                )  # fmt: skip

                def ints(f, fill):
                    return jnp.asarray(np.array([fill if e is None else f(*e) for e in entries], np.int32))

                self.cache, st = _admit(
                    self.graphdef, self.state, self.cache, st,
                    ints(lambda s, r: s, B), rows, jnp.asarray(keys),
                    first, d1, q1, mh,
                    ints(lambda s, r: len(prompts[r]), 1), ints(lambda s, r: limits[r], 1),
                    eos_arr, **skw,
                )  # fmt: skip
                jax.block_until_ready(st["done"])
                res.prefill_s += time.perf_counter() - t0
                if step_events:
                    yield from self._harvest(st, slot_req, sent, tokens, limits, eos, stream=True, free=False)
            if not any(r >= 0 for r in slot_req):
                if pending:  # cannot happen: every request fits the cache alone (checked above)
                    raise RuntimeError("admission: no request could be admitted")
                break
            if self.batching == "continuous" and pending:
                need = min(len(pending), self.refill_at or max(1, B // 8))
            else:
                need = B + 1
            t0 = time.perf_counter()
            self.cache, st, steps = _decode_loop(
                self.graphdef, self.state, self.cache, st, eos_arr,
                jnp.int32(1 if step_events else 2**30), jnp.int32(need), **skw,
            )  # fmt: skip
            jax.block_until_ready(st["done"])
            res.decode_s += time.perf_counter() - t0
            res.decode_calls += 1
            res.decode_steps += int(steps)
            yield from self._harvest(st, slot_req, sent, tokens, limits, eos, stream=step_events, free=True)
        res.wall_s = time.perf_counter() - t_start
        res.tokens = tokens
        res.stop_reasons = ["eos" if t and t[-1] in eos else "length" for t in tokens]
        res.decode_tokens = sum(len(t) - 1 for t in tokens)
        res.draft_tokens = self._drafts * k
        res.accepted_tokens = self._accepted
        if self.tokenizer is not None:
            res.texts = [self.tokenizer.decode(t) for t in tokens]
        return res

    def _pick_slot(self, slot_req: list[int], per_rank: int, pages: int) -> int | None:
        """The free slot the next request takes, or None when none fits: among the data ranks with a
        free slot and ``pages`` free pages, the one serving the fewest requests (then the one with the
        most free pages, then the lowest rank), and its lowest free slot.  One rank (no DP attention):
        the lowest free slot when the cache has room."""
        best = None
        for d in range(self.data):
            mine = slot_req[d * per_rank : (d + 1) * per_rank]
            free = self.allocator.free_pages(d)
            if -1 not in mine or free < pages:
                continue
            key = (sum(r >= 0 for r in mine), -free, d)
            if best is None or key < best[0]:
                best = (key, d * per_rank + mine.index(-1))
        return None if best is None else best[1]

    def _harvest(self, st, slot_req, sent, tokens, limits, eos, *, stream, free):
        """Host side after a device call: emit new tokens (streaming), collect and free finished slots."""
        h = jax.device_get({n: st[n] for n in ("done", "n_out", "out", "rounds", "accepted")})
        for s, r in enumerate(slot_req):
            if r < 0:
                continue
            n, done = int(h["n_out"][s]), bool(h["done"][s])
            if stream and n > sent[r]:
                yield TokenEvent(r, h["out"][s, sent[r] : n].tolist(), done)
                sent[r] = n
            if done and free:
                tokens[r] = h["out"][s, :n].tolist()
                self._drafts += int(h["rounds"][s])
                self._accepted += int(h["accepted"][s])
                if not stream and n > sent[r]:
                    yield TokenEvent(r, h["out"][s, sent[r] : n].tolist(), True)
                    sent[r] = n
                self.allocator.free(r)
                slot_req[s] = -1

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int | Sequence[int],
        *,
        num_speculative_tokens: int = 0,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_token_id: int | Sequence[int] | None = None,
        stream: Callable[[TokenEvent], None] | None = None,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` (an int, or one per prompt) tokens per prompt.

        A request stops at the model's context, ``max_position_embeddings`` tokens of prompt and output
        (stop reason ``"length"``, as vLLM caps a request at its maximum model length); a prompt of
        ``max_position_embeddings`` tokens or more raises ``ValueError``.

        Args:
          prompts: token-id lists, or strings (encoded by the engine's tokenizer).
          num_speculative_tokens: k > 0 drafts k tokens per round with the MTP layer (greedy: same tokens
            as plain greedy decoding; sampling: rejection sampling, same distribution as plain sampling).
          temperature, top_k, top_p: :class:`~tokenspeed_jax.models.deepseek.sampling.SamplingParams`
            (``temperature = 0``: greedy).
          seed: sampling seed; request i uses key ``fold_in(PRNGKey(seed), i)``.
          eos_token_id: an id or a list of ids that stop a request (included in its tokens); None: the
            config's ``eos_token_id``; ``[]``: never stop early.
          stream: called with a :class:`TokenEvent` per request and step as tokens are produced (the
            decode loop then returns to the host after every step).
        """
        kw = {
            "num_speculative_tokens": num_speculative_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
            "eos_token_id": eos_token_id,
        }
        it = self.stream(prompts, max_new_tokens, step_events=stream is not None, **kw)
        while True:
            try:
                ev = next(it)
            except StopIteration as e:
                return e.value
            if stream is not None:
                stream(ev)


def generate(
    model,
    prompts: Sequence[Sequence[int] | str],
    max_new_tokens: int | Sequence[int],
    *,
    eos_token_id: int | Sequence[int] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    num_speculative_tokens: int = 0,
    stream: Callable[[TokenEvent], None] | None = None,
    tokenizer=None,
    **engine_kwargs,
) -> list[list[int]] | list[str]:
    """Generate for each prompt; returns token-id lists (EOS included when a request stopped there), or
    texts when every prompt is a string (decoded by ``tokenizer``, special tokens skipped).

    See :meth:`Engine.generate` for the arguments; ``engine_kwargs`` go to :class:`Engine` (page_size,
    backend, kv_dtype, prefill_chunk, max_slots, compilation_cache, ...)."""
    eng = Engine(model, tokenizer=tokenizer, **engine_kwargs)
    out = eng.generate(
        list(prompts),
        max_new_tokens,
        eos_token_id=eos_token_id,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_speculative_tokens=num_speculative_tokens,
        stream=stream,
    )
    if prompts and all(isinstance(p, str) for p in prompts):
        return out.texts
    return out.tokens
