"""Generation as inference scripts use it (CPU, xla backend, fp32): EOS stops per request, continuous
batching equal to running each request alone, sampling masks and reproducibility, speculative sampling
by rejection sampling tested against plain sampling with chi-square tests, streaming, text round trips.

One small model for the whole module (the ``tiny`` preset with 1 main layer and a 64-token vocabulary;
its lm_head and MTP head are scaled so that next-token distributions are peaked and the MTP drafts
differ from the target distribution).  Every engine uses 2 slots and the same bucketed shapes, so the
decode loops compile once per (k, sampling parameters)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine, generate
from tokenspeed_jax.models.deepseek import sampling as smp
from tokenspeed_jax.models.deepseek.sampling import SamplingParams

NAN = float("nan")
V = 64
CFG = DeepseekV3Config.preset("tiny").replace(vocab_size=V, num_hidden_layers=1)
ALPHA = 1e-3  # significance of every chi-square test (fixed seeds: the outcome is deterministic)
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(0, V, n).tolist() for n in (6, 3, 8, 5, 7)]  # + LIMITS: one 16-token page
LIMITS = [8, 5, 8, 3, 6]
SAMPLING = {"temperature": 0.8, "top_k": 20, "top_p": 0.95}
N_SAMPLES, SAMPLE_SLOTS = 2048, 256  # chi-square samples (requests), decoded 256 at a time


@pytest.fixture(scope="module")
def model():
    m = DeepseekV3.random(CFG, dtype=jnp.float32, seed=3)
    for head in (m.lm_head, m.mtp[0].shared_head.head):  # logit std ~2: peaked, non-degenerate
        head.kernel.set_value(head.kernel[...] * 12.5)
    return m


def engine(model, **kw):
    kw = {"backend": "xla", "cache_fill": NAN, "compilation_cache": False, "max_slots": 2, **kw}
    return Engine(model, **kw)


@pytest.fixture(scope="module")
def alone(model):
    """Greedy tokens of each request run alone (no EOS)."""
    eng = engine(model)
    return [eng.generate([p], m, eos_token_id=[]).tokens[0] for p, m in zip(PROMPTS, LIMITS)]


# ------------------------------------------------------------------------------ batching / EOS
def test_continuous_batching_equals_alone(model, alone):
    out = engine(model).generate(PROMPTS, LIMITS, eos_token_id=[])
    assert out.tokens == alone
    assert [len(t) for t in out.tokens] == LIMITS and out.stop_reasons == ["length"] * 5
    assert out.decode_calls > 2  # requests were admitted as slots freed up
    static = engine(model, batching="static", shuffle_pages=True, seed=4).generate(
        PROMPTS, LIMITS, eos_token_id=[]
    )
    assert static.tokens == alone
    spec = engine(model, shuffle_pages=True, seed=5).generate(
        PROMPTS, LIMITS, eos_token_id=[], num_speculative_tokens=1
    )
    assert spec.tokens == alone  # greedy MTP == greedy, fp32, under continuous batching
    assert spec.draft_tokens > 0


def test_refill_at_admits_in_groups(model, alone):
    """``refill_at=2`` on 2 slots: the loop returns once both slots have finished while 2 or more requests are
    pending (then once the last one's slot has), so fewer decode calls than one per finished request, and each
    request's tokens are unchanged."""
    one = engine(model, refill_at=1).generate(PROMPTS, LIMITS, eos_token_id=[])
    two = engine(model, refill_at=2, shuffle_pages=True, seed=6).generate(PROMPTS, LIMITS, eos_token_id=[])
    assert one.tokens == alone and two.tokens == alone
    assert two.decode_calls < one.decode_calls, (two.decode_calls, one.decode_calls)
    with pytest.raises(ValueError, match="refill_at"):
        engine(model, refill_at=0)


def cut(tokens, eos):
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("k", [0, 1])
def test_eos_stops_each_request(model, alone, k):
    eos = [alone[0][2], alone[2][4]]
    out = engine(model).generate(PROMPTS, LIMITS, eos_token_id=eos, num_speculative_tokens=k)
    want = [cut(t, eos) for t in alone]
    assert out.tokens == want  # EOS included, nothing after it
    assert out.stop_reasons == ["eos" if w[-1] in eos else "length" for w in want]
    assert "eos" in out.stop_reasons
    # Finished requests stop costing steps: when every request stops at once the loop stops too.
    first = [t[0] for t in alone]
    early = engine(model).generate(PROMPTS, 8, eos_token_id=first, num_speculative_tokens=k)
    assert early.tokens == [[t] for t in first] and early.decode_steps == 0
    assert engine(model).generate(PROMPTS[:1], 8, eos_token_id=None).stop_reasons  # config's EOS: runs


def test_stream_callback_and_iterator(model, alone):
    events = []
    out = engine(model).generate(PROMPTS, LIMITS, eos_token_id=[], stream=events.append)
    assert out.tokens == alone
    got = [[] for _ in PROMPTS]
    for e in events:
        assert not got[e.request] or e.tokens  # every event carries new tokens
        got[e.request] += e.tokens
    assert got == alone
    assert sum(e.finished for e in events) == len(PROMPTS)
    assert max(len(e.tokens) for e in events) == 1  # one step per event with plain decode
    it = engine(model).stream(PROMPTS[:2], 4, eos_token_id=[])
    firsts = [next(it) for _ in range(2)]
    assert [e.tokens for e in firsts] == [alone[0][:1], alone[1][:1]]


# ---------------------------------------------------------------------------------- sampling
def test_top_k_top_p_masks():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]]))
    keep = lambda **kw: np.isfinite(np.asarray(smp.filter_logits(logits, SamplingParams(1.0, **kw))))
    np.testing.assert_array_equal(keep(top_k=2), [[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(keep(top_p=0.6), [[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]])  # 0.5 < 0.6 <= 0.7
    np.testing.assert_array_equal(keep(top_p=0.7), [[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(keep(top_p=0.71), [[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(keep(top_p=0.01), [[1, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(keep(top_k=3, top_p=0.6), [[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    # top-p renormalises after top-k (transformers' order): top_k=2 leaves 0.5/0.7 = 0.71 for the first.
    np.testing.assert_array_equal(keep(top_k=2, top_p=0.7), [[1, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    p = np.asarray(smp.probs(logits, SamplingParams(0.5, top_k=3)))
    ref = np.array([0.5, 0.2, 0.15]) ** 2
    np.testing.assert_allclose(p[0, :3], ref / ref.sum(), rtol=1e-5)
    assert p[0, 3:].sum() == 0
    np.testing.assert_array_equal(np.asarray(smp.probs(logits, SamplingParams())), np.eye(5)[[0, 4]])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, top_k=-1)
    for t in (-0.5, float("inf"), float("nan")):  # not silently greedy / uniform
        with pytest.raises(ValueError, match="^temperature: expected a finite number >= 0"):
            SamplingParams(t)
    assert SamplingParams(1.0, top_k=np.int64(3)) == SamplingParams(1.0, top_k=3)


def test_sampling_reproducible_under_a_seed(model):
    # The chi-square test's engine shape (256 slots, 4 new tokens): one compilation for both tests.
    prompts, kw = [p[:4] for p in PROMPTS], {"eos_token_id": [], **SAMPLING}
    eng = engine(model, max_slots=SAMPLE_SLOTS)
    a = eng.generate(prompts, 4, seed=7, **kw)
    assert a.tokens == eng.generate(prompts, 4, seed=7, **kw).tokens
    # Keys are per request index and position: the other requests of the batch do not matter.
    assert eng.generate(prompts[:2], 4, seed=7, **kw).tokens == a.tokens[:2]
    assert eng.generate(prompts, 4, seed=8, **kw).tokens != a.tokens


def chi2_gof(counts, expected, min_expected=5.0):
    """Pearson's chi-square p-value of ``counts`` against ``expected`` (cells with a small expectation
    pooled into one)."""
    counts, expected = np.asarray(counts, float), np.asarray(expected, float)
    small = expected < min_expected
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    if e[-1] == 0:
        c, e = c[:-1], e[:-1]
    return stats.chisquare(c, e * c.sum() / e.sum()).pvalue


def chi2_two_sample(x, y, n_cells):
    """Chi-square p-value of 'samples x and y come from the same distribution' (contingency table)."""
    t = np.stack([np.bincount(x, minlength=n_cells), np.bincount(y, minlength=n_cells)])
    t = t[:, t.sum(0) > 0]
    return stats.chi2_contingency(t)[1]


def test_speculative_accept_unit_distribution():
    """The acceptance rule alone: the first emitted token is distributed as p[0] for any q (and the
    drafts themselves, which are distributed as q, fail the same test: the test has power)."""
    rng = np.random.default_rng(0)
    k, n, v = 2, 20000, 6
    p = rng.dirichlet(np.ones(v) * 0.7, size=k + 1)
    q = rng.dirichlet(np.ones(v) * 0.7, size=k)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    drafts = jax.random.categorical(keys[0], jnp.log(jnp.asarray(q)), shape=(n, k)).astype(jnp.int32)
    u = jax.random.uniform(keys[1], (n, k))
    a, toks = smp.speculative_accept(
        drafts,
        jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, k, v)),
        jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, k + 1, v)),
        u,
        jax.random.split(keys[2], n),
    )
    first = np.asarray(toks[:, 0])
    assert chi2_gof(np.bincount(first, minlength=v), p[0] * n) > ALPHA
    assert chi2_gof(np.bincount(np.asarray(drafts[:, 0]), minlength=v), p[0] * n) < ALPHA
    # Acceptance rate of the first draft is sum(min(p, q)).
    acc = float(np.mean(np.asarray(a) >= 1))
    assert abs(acc - np.minimum(p[0], q[0]).sum()) < 0.02


@pytest.mark.slow  # two decode-loop compilations of their own (256 slots; sampled MTP k = 2)
def test_speculative_sampling_matches_plain_sampling(model):
    """Speculative (k = 2, MTP drafts) vs plain sampling (temperature 0.8, top-k 20, top-p 0.95) of the
    next 4 tokens of one prompt, N_SAMPLES requests each: (t1, t2) (prefill, then the first draft's
    acceptance or residual) against the exact distribution from the model's full-sequence logits, and
    t3, t4 (second draft, residual or bonus) between the two samplers; chi-square at ALPHA each."""
    n = N_SAMPLES
    prompt = PROMPTS[0][:4]
    kw = {"eos_token_id": [], "seed": 11, **SAMPLING}
    eng = engine(model, max_slots=SAMPLE_SLOTS)
    plain = np.array(eng.generate([prompt] * n, 4, **kw).tokens)
    spec_out = eng.generate([prompt] * n, 4, num_speculative_tokens=2, **kw)
    spec = np.array(spec_out.tokens)
    assert 0.02 < spec_out.acceptance_rate < 0.95  # drafts differ from the target, and are used
    sp = SamplingParams(**SAMPLING)
    p1 = np.asarray(smp.probs(model.logits(jnp.asarray(prompt))[-1], sp))
    seqs = jnp.asarray([prompt + [t] for t in range(V)], jnp.int32)
    p2 = np.stack([np.asarray(smp.probs(model.logits(s)[-1], sp)) for s in seqs])  # [t1, t2]
    joint = (p1[:, None] * p2).reshape(-1)
    for name, toks in (("plain", plain), ("spec", spec)):
        counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
        pv = chi2_gof(counts, joint * n)
        assert pv > ALPHA, (name, pv)
    for j in (2, 3):
        pv = chi2_two_sample(plain[:, j], spec[:, j], V)
        assert pv > ALPHA, (j, pv)


# ---------------------------------------------------------------------------------------- text
def make_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["hello world", "the quick brown fox", "jumps over the lazy dog", "hello there"] * 4
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=["<bos>", "<eos>", "<unk>"])
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    assert tok.get_vocab_size() <= V and tok.token_to_id("<bos>") == 0
    tok.save(str(path))
    return path


def test_text_round_trip(model, tmp_path):
    from tokenspeed_jax.models.deepseek import load_tokenizer

    make_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path / "missing") is None
    for s in ("hello world", "the lazy fox jumps over the dog"):
        ids = tok.encode(s)
        assert ids[0] == 0 and tok.decode(ids) == s
    texts = ["hello world", "the quick brown fox"]
    got = generate(
        model, texts, 6, tokenizer=tok, eos_token_id=[], backend="xla", max_slots=2, compilation_cache=False
    )
    ids = engine(model).generate([tok.encode(t) for t in texts], 6, eos_token_id=[]).tokens
    assert got == [tok.decode(t) for t in ids] and all(isinstance(t, str) for t in got)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ["hello"], 2, backend="xla", compilation_cache=False)


def test_requests_stop_at_the_context_length():
    """Prompt + output stop at max_position_embeddings (stop reason "length"); a prompt that fills the
    context is refused, naming it."""
    ctx = 12
    m = DeepseekV3.random(CFG.replace(max_position_embeddings=ctx), dtype=jnp.float32, seed=3)
    eng = engine(m)
    out = eng.generate(PROMPTS[:2], [20, 4], eos_token_id=[])  # 6 + 20 > 12: 6 new tokens
    assert [len(t) for t in out.tokens] == [ctx - 6, 4] and out.stop_reasons == ["length"] * 2
    assert out.tokens == eng.generate(PROMPTS[:2], [6, 4], eos_token_id=[]).tokens
    with pytest.raises(ValueError, match=r"^prompts\[1\]: 12 tokens, the model's context \(max_position_embeddings\) is 12"):
        eng.generate([[1], [2] * 12], 2)


def test_generate_argument_errors(model):
    eng = engine(model)
    for bad, what in (
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": [2]}, "max_new_tokens"),
        ({"num_speculative_tokens": 16}, "num_speculative_tokens"),
        ({"top_p": 0.0, "temperature": 1.0}, "top_p"),
    ):
        kw = {"max_new_tokens": 2, **bad}
        with pytest.raises(ValueError, match=what):
            eng.generate(PROMPTS[:2], kw.pop("max_new_tokens"), **kw)
    for bad, what in (
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"num_speculative_tokens": 1.5}, "num_speculative_tokens"),
    ):
        kw = {"max_new_tokens": 2, **bad}
        with pytest.raises(ValueError, match=f"^{what}: expected"):
            eng.generate(PROMPTS[:2], kw.pop("max_new_tokens"), **kw)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: expected integer token ids, got 3.7 at index 0"):
        eng.generate([[1, 2], [3.7, 4.0]], 2)  # not truncated to 3
    # NumPy prompts and counts are ints like any other
    two = [PROMPTS[0][:3], PROMPTS[1][:3]]
    assert eng.generate(np.array(two), np.int64(2)).tokens == eng.generate(two, 2).tokens
    with pytest.raises(ValueError, match="prompts"):
        eng.generate([[1, V]], 2)
    with pytest.raises(ValueError, match="prompts"):
        eng.generate([], 2)
