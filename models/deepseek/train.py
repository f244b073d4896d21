"""Train a small DeepSeek-V3-architecture model with a real MTP head on the Python standard library.

``python -m tokenspeed_jax.models.deepseek.train --out DIR [--steps N --seed S ...]``

What it does (every step deterministic under ``--seed``; one XLA thread gives bit-identical runs):

1. **Corpus**: the ``.py`` files of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``; no ``site-packages``, no ``test``/``tests`` packages), available
   offline on every machine.  Split by file: a file is held out when ``sha1(relative path) % 20 == 0``
   (about 5 %), so the split does not depend on which other files a Python version ships.
2. **Tokenizer**: byte-level BPE trained with Hugging Face ``tokenizers`` on the training files only;
   ``<|bos|>`` is id 0 and ``<|eos|>`` id 1 (the config's ``bos_token_id`` / ``eos_token_id``); the
   post-processor prepends ``<|bos|>``.  Every file is encoded as ``<|bos|> ... <|eos|>`` and the files are
   concatenated into one token stream per split.
3. **Model**: the project's own modules (:class:`~tokenspeed_jax.models.deepseek.model.DeepseekV3`:
   MLA with the real 512/64 latent dims, dense + MoE layers with the noaux_tc sigmoid router, one MTP
   layer), float32 on the CPU, the xla attention backend.
4. **Loss** (DeepSeek-V3, section 2.2): main next-token cross entropy + ``lambda`` (``--mtp-lambda``, 0.3 as
   in DeepSeek-V3's first phase) times the MTP layer's next-next-token cross entropy.  As in the paper the
   MTP module shares the embedding and the output head with the main model; the checkpoint stores that
   head a second time as ``model.layers.{L}.shared_head.head.weight`` (the published layout keeps a copy).
   The MTP input at position ``i`` is ``eh_proj([enorm(emb(t_{i+1})) | hnorm(h_i)])`` with ``h_i`` the
   main model's final-norm output and the embedding zeroed at position 0, exactly what inference
   (:meth:`DeepseekV3.mtp_forward`) feeds it.
5. **Load balance**: DeepSeek-V3's auxiliary-loss-free strategy: after each step every router's
   ``e_score_correction_bias`` moves by ``--bias-rate`` towards balance
   (``b_i += gamma * sign(mean load - load_i)``); it gets no gradient.
6. **Optimiser**: optax AdamW (b2 0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to
   10 %, global-norm clipping at 1.0.  One jitted step (static shapes: ``[batch, seq_len]``), attention
   ``vmap``-ed per sequence (the packed xla reference would attend over the whole batch), MoE over all
   tokens of the batch.
7. **Output** (Hugging Face layout, loadable by :func:`~tokenspeed_jax.models.deepseek.load_checkpoint`):
   ``config.json``, ``model.safetensors`` (bfloat16, one shard), ``tokenizer.json``,
   ``tokenizer_config.json``, ``train_metrics.json`` and a model card ``README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tokenspeed_jax.models.deepseek.attention import AttentionBatch
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.model import DeepseekV3
from tokenspeed_jax.models.deepseek.moe import MoE
from tokenspeed_jax.models.deepseek.weights import SINGLE_FILE, model_to_hf_tensors, save_safetensors

BOS, EOS = "<|bos|>", "<|eos|>"
HELDOUT_MOD = 20  # a file is held out when sha1(relpath) % HELDOUT_MOD == 0


# ------------------------------------------------------------------------------------------- config
def tiny_config(vocab_size: int = 2048, seq_len: int = 256) -> DeepseekV3Config:
    """The shipped checkpoint's architecture: 2 main layers (1 dense + 1 MoE) + 1 MTP layer (MoE),
    hidden 128, one MLA head with DeepSeek-R1's attention dims (latent 512, rope 64, nope 128, v 128, so
    the MLA kernels run it), q LoRA rank 64, 8 routed experts in 2 groups (top-2, 1 group) + 1 shared."""
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        q_lora_rank=64,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=seq_len,
        rope_scaling=None,
        num_nextn_predict_layers=1,
        bos_token_id=0,
        eos_token_id=1,
    )


# ------------------------------------------------------------------------------------------- corpus
def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | None = None) -> tuple[list[str], list[str]]:
    """``(train, held_out)`` relative paths (sorted, '/'-separated) of the stdlib's ``.py`` files."""
    root = root or stdlib_dir()
    train, held = [], []
    for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(f, root).replace(os.sep, "/")
        parts = rel.split("/")
        if parts[0] == "site-packages" or any(p in ("test", "tests") for p in parts[:-1]):
            continue
        h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)
        (held if h % HELDOUT_MOD == 0 else train).append(rel)
    return train, held


def read_source(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ``<|bos|>`` = 0, ``<|eos|>`` = 1 and a ``<|bos|> $A`` post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """``<|bos|> file <|eos|>`` for every file, concatenated (int32)."""
    out = []
    for t in texts:
        out.append(np.asarray(tok.encode(t).ids + [1], np.int32))
    return np.concatenate(out)


def heldout_stream(tok, root: str | None = None) -> np.ndarray:
    """The held-out files encoded with ``tok`` (a ``tokenizers.Tokenizer``), as :func:`encode_stream`."""
    root = root or stdlib_dir()
    return encode_stream(tok, [read_source(root, f) for f in corpus_files(root)[1]])


def windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``[n, seq_len + 2]`` windows (inputs, next and next-next targets)."""
    idx = starts[:, None] + np.arange(seq_len + 2)[None, :]
    return stream[idx]


def heldout_windows(stream: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """``n`` evenly spaced, fixed held-out windows."""
    starts = np.linspace(0, len(stream) - seq_len - 2, n).astype(np.int64)
    return windows(stream, starts, seq_len)


# ------------------------------------------------------------------------------------------ forward
def _block(layer, h, batch, loads):
    """``DecoderLayer.__call__`` for ``h [B, L, hidden]``: attention per sequence (vmap), the MLP or MoE
    over all ``B * L`` tokens; appends each router's expert counts to ``loads``."""
    B, L, D = h.shape
    attn = jax.vmap(lambda x: layer.self_attn(x, batch, None, None)[0])
    h = h + attn(layer.input_layernorm(h))
    x = layer.post_attention_layernorm(h).reshape(B * L, D)
    if isinstance(layer.mlp, MoE):
        w, idx = layer.mlp.gate(x)
        y = layer.mlp.experts(x, w, idx) + layer.mlp.shared_experts(x)
        loads.append(jnp.bincount(idx.reshape(-1), length=layer.mlp.gate.weight.shape[0]))
    else:
        y = layer.mlp(x)
    return h + y.reshape(B, L, D)


def decoder_layers(model: DeepseekV3) -> list:
    """The main model's decoder layers, one module each, in order: the scanned stacks (``dense_layers``,
    ``moe_layers``: parameters with a leading layer axis) sliced per layer (differentiable views of the
    stacked parameters; :func:`forward` runs them as a Python loop)."""
    out = []
    for stack in (model.dense_layers, model.moe_layers):
        if stack is None:
            continue
        graphdef, state = nnx.split(stack)
        n = jax.tree.leaves(state)[0].shape[0]
        out += [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(n)]
    return out


def forward(model: DeepseekV3, ids: jax.Array, nxt: jax.Array, *, tied_head: bool = True):
    """Teacher-forced main and MTP logits: ``ids, nxt [B, L]`` (``nxt`` = ids shifted by one) ->
    ``(main logits [B, L, V], MTP logits [B, L, V], router loads [n_moe, E])``.  With ``tied_head`` (training)
    the MTP layer uses the main ``lm_head`` (shared output head, DeepSeek-V3), else its own
    ``shared_head.head`` (inference; the shipped checkpoint holds a copy of ``lm_head`` there)."""
    L = ids.shape[1]
    pos = jnp.arange(L, dtype=jnp.int32)
    batch = AttentionBatch(
        positions=pos, cu_seqlens_q=jnp.array([0, L], jnp.int32), mode="prefill", max_seqlen_q=L,
        backend="xla",
    )
    loads: list = []
    h = model.embed_tokens(ids)
    for layer in decoder_layers(model):
        h = _block(layer, h, batch, loads)
    hn = model.norm(h)
    logits = model.lm_logits(hn)
    mtp = model.mtp[0]
    emb = model.embed_tokens(nxt)
    emb = jnp.where((pos == 0)[None, :, None], jnp.zeros((), emb.dtype), emb)
    x = mtp.eh_proj(jnp.concatenate([mtp.enorm(emb), mtp.hnorm(hn)], axis=-1))
    x = _block(mtp, x, batch, loads)
    mtp_logits = model.lm_logits(mtp.shared_head.norm(x)) if tied_head else mtp.logits(x)
    return logits, mtp_logits, jnp.stack(loads)


def _ce(logits, targets):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, targets[..., None], axis=-1))


def losses(model, win: jax.Array):
    """``win [B, L + 2]`` -> ``(main CE, MTP CE, router loads)`` (natural log, per token)."""
    L = win.shape[1] - 2
    ids, y1, y2 = win[:, :L], win[:, 1 : L + 1], win[:, 2 : L + 2]
    logits, mtp_logits, loads = forward(model, ids, y1)
    return _ce(logits, y1), _ce(mtp_logits, y2), loads


def _frozen(path) -> bool:
    """Parameters without gradient: router biases (updated by the balance rule) and the MTP head (tied)."""
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return "e_score_correction_bias" in names or ("shared_head" in names and "head" in names)


def make_optimizer(state, *, lr: float, steps: int, warmup: int, weight_decay: float):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)
    labels = jax.tree_util.tree_map_with_path(
        lambda p, v: "frozen" if _frozen(p) else ("decay" if v.ndim >= 2 else "no_decay"), state
    )
    adam = functools.partial(optax.adamw, sched, b1=0.9, b2=0.95, eps=1e-8)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform(
            {
                "decay": adam(weight_decay=weight_decay),
                "no_decay": adam(weight_decay=0.0),
                "frozen": optax.set_to_zero(),
            },
            labels,
        ),
    )
    return tx


def make_steps(graphdef, tx, *, mtp_lambda: float, bias_rate: float):
    def loss_fn(state, win):
        model = nnx.merge(graphdef, state)
        main, mtp, loads = losses(model, win)
        return main + mtp_lambda * mtp, (main, mtp, loads)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(state, opt_state, win):
        import optax

        (loss, (main, mtp, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, win)
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
        # Auxiliary-loss-free balancing: b_i += gamma * sign(mean load - load_i), per router.
        model = nnx.merge(graphdef, state)
        # loads: one row per MoE layer, in forward's order: the moe_layers stack's layers, then the MTP layers
        ld = loads.astype(jnp.float32)
        step = bias_rate * jnp.sign(jnp.mean(ld, axis=-1, keepdims=True) - ld)
        routers = [] if model.moe_layers is None else [model.moe_layers.mlp.gate]  # bias [n_moe, E]
        routers += [layer.mlp.gate for layer in model.mtp if isinstance(layer.mlp, MoE)]  # bias [E]
        row = 0
        for r in routers:
            b = r.e_score_correction_bias[...]
            n = b.shape[0] if b.ndim == 2 else 1
            r.e_score_correction_bias.set_value(b + step[row : row + n].reshape(b.shape))
            row += n
        state = nnx.state(model)
        imbalance = jnp.max(loads, axis=-1) / jnp.mean(loads.astype(jnp.float32), axis=-1)
        return state, opt_state, {"loss": loss, "main": main, "mtp": mtp, "max_load": jnp.max(imbalance)}

    @jax.jit
    def eval_step(state, win):
        model = nnx.merge(graphdef, state)
        main, mtp, _ = losses(model, win)
        return main, mtp

    return train_step, eval_step


def evaluate(eval_step, state, wins: np.ndarray, batch: int) -> tuple[float, float]:
    mains, mtps = [], []
    for i in range(0, len(wins) - batch + 1, batch):
        m, t = eval_step(state, jnp.asarray(wins[i : i + batch]))
        mains.append(float(m))
        mtps.append(float(t))
    return float(np.mean(mains)), float(np.mean(mtps))


def heldout_losses(model: DeepseekV3, wins: np.ndarray, batch: int = 8) -> tuple[float, float]:
    """Mean ``(main CE, MTP CE)`` of a trained model (MTP head: its own ``shared_head``, i.e. the shipped
    copy of ``lm_head``) over ``wins [n, L + 2]`` (teacher-forced, xla attention backend)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, win):
        m = nnx.merge(graphdef, state)
        L = win.shape[1] - 2
        ids, y1, y2 = win[:, :L], win[:, 1 : L + 1], win[:, 2 : L + 2]
        logits, mtp_logits, _ = forward(m, ids, y1, tied_head=False)
        return _ce(logits, y1), _ce(mtp_logits, y2)

    mains, mtps = [], []
    for i in range(0, len(wins), batch):
        a, b = step(state, jnp.asarray(wins[i : i + batch]))
        mains.append(float(a) * len(wins[i : i + batch]))
        mtps.append(float(b) * len(wins[i : i + batch]))
    return sum(mains) / len(wins), sum(mtps) / len(wins)


# ------------------------------------------------------------------------------------------- output
def param_count(model) -> int:
    return sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def save(model, tok, out: str, metrics: dict) -> int:
    """Write the checkpoint (bf16 safetensors, one shard) and return its total size in bytes."""
    os.makedirs(out, exist_ok=True)
    tensors = {n: a.astype(ml_dtypes.bfloat16) for n, a in model_to_hf_tensors(model).items()}
    save_safetensors(tensors, os.path.join(out, SINGLE_FILE))
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": True,
                "model_max_length": model.config.max_position_embeddings,
            },
            f,
            indent=1,
        )
    with open(os.path.join(out, "train_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_model_card(out: str) -> str:
    """``README.md`` of a checkpoint written by :func:`main`, from its ``config.json`` and
    ``train_metrics.json`` (regenerate with ``--card-only``)."""
    with open(os.path.join(out, "train_metrics.json")) as f:
        m = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    a = m["args"]
    size = os.path.getsize(os.path.join(out, SINGLE_FILE))
    env = 'XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" RAYON_NUM_THREADS=1 '
    hist = "\n".join(
        f"| {h['step']} | {h['train_main']:.3f} | {h['train_mtp']:.3f} | {h['held_main']:.3f} | "
        f"{h['held_mtp']:.3f} | {h['max_load']:.2f} |"
        for h in m["history"]
        if "held_main" in h
    )
    name = os.path.basename(os.path.normpath(out))
    card = f"""# {name}

A small DeepSeek-V3-architecture causal LM with a trained multi-token-prediction (MTP) layer, trained on the
Python {m["python"]} standard library's source code.  It is the checkpoint tokenspeed-jax ships and uses by
default (`tokenspeed_jax.models.deepseek.checkpoints.default_checkpoint()`): small enough for the
repository, trained enough that greedy text is Python-like and the MTP layer's drafts are accepted.  It is
a demo and test model, not a useful code model.

| | |
|---|---|
| parameters | {m["parameters"]:,} ({m["trained_parameters"]:,} trained: the MTP layer's `shared_head.head` is a copy of `lm_head`, shared in training as in DeepSeek-V3) |
| size | `{SINGLE_FILE}` {size:,} bytes (bfloat16, one shard) |
| layers | {c["num_hidden_layers"]} main ({c["first_k_dense_replace"]} dense + {c["num_hidden_layers"] - c["first_k_dense_replace"]} MoE) + {c["num_nextn_predict_layers"]} MTP layer (MoE) |
| hidden | {c["hidden_size"]}; dense MLP {c["intermediate_size"]}; vocab {c["vocab_size"]} |
| attention | MLA, {c["num_attention_heads"]} head, q LoRA rank {c["q_lora_rank"]}, kv latent {c["kv_lora_rank"]}, rope {c["qk_rope_head_dim"]}, nope {c["qk_nope_head_dim"]}, v {c["v_head_dim"]} (DeepSeek-R1's attention dims: the MLA kernels run it) |
| MoE | {c["n_routed_experts"]} routed experts ({c["moe_intermediate_size"]} wide) in {c["n_group"]} groups, top-{c["num_experts_per_tok"]} in {c["topk_group"]} group, 1 shared expert; sigmoid `noaux_tc` router with correction bias |
| context | {c["max_position_embeddings"]} tokens (the training length; RoPE theta {c["rope_theta"]:g}, no YaRN) |
| tokenizer | byte-level BPE (HF `tokenizers`), `<\\|bos\\|>` = {c["bos_token_id"]}, `<\\|eos\\|>` = {c["eos_token_id"]}; `encode` prepends `<\\|bos\\|>` |

## Training

```
{env}taskset -c 1 {m["command"]}
```

(from a tokenspeed-jax working tree on top of commit `{m["commit"]}`), seed {a["seed"]}, {m["date"]}, on the CPU ({_cpu_model()}, one
core, shared with other jobs; jax {m["jax"]}): {a["steps"]} AdamW steps of {a["batch"]} x {a["seq_len"]}
tokens ({m["tokens_seen"]:,} tokens, {m["tokens_seen"] / m["train_tokens"]:.2f} epochs), lr {a["lr"]:g}
(warm-up {a["warmup"]}, cosine to 10 %), weight decay {a["weight_decay"]:g}, loss = main CE +
{a["mtp_lambda"]:g} x MTP CE (DeepSeek-V3's MTP loss), auxiliary-loss-free balancing with bias rate
{a["bias_rate"]:g}; {m["train_seconds"] / 60:.1f} min of training ({m["total_seconds"] / 60:.1f} min in
all).  The recipe: `models/deepseek/train.py` (`tokenspeed_jax.models.deepseek.train`, module docstring).

Corpus: the `.py` files of the standard library without `site-packages` and `test`/`tests` packages;
{m["train_files"]} training files ({m["train_tokens"]:,} tokens), {m["heldout_files"]} held-out files
({m["heldout_tokens"]:,} tokens; a file is held out when `sha1(relative path) % 20 == 0`).

## Loss (nats/token, {m["eval_windows"]} fixed windows of {a["seq_len"]} tokens each)

| | main (next token) | MTP (next-next token) |
|---|---|---|
| train | {m["train_loss"]:.4f} | {m["train_mtp_loss"]:.4f} |
| held-out | {m["heldout_loss"]:.4f} | {m["heldout_mtp_loss"]:.4f} |

Random weights: ln({c["vocab_size"]}) = {math.log(c["vocab_size"]):.2f}.  During training (train: mean of the
last logged steps; max load: busiest expert / mean, 4.0 would be one expert of top-2 of 8 taking all):

| step | train | train MTP | held-out | held-out MTP | max load |
|---|---|---|---|---|---|
{hist}

MTP acceptance rates and decode speed-ups: `docs/model.md`, "The shipped checkpoint".
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)
    return card


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - outside a git checkout
        return "unknown"


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-lambda", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: end)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--time-only", action="store_true", help="run the steps, write nothing (step timing)")
    ap.add_argument("--card-only", action="store_true", help="rewrite --out's README.md from its metrics")
    args = ap.parse_args(argv)
    if args.card_only:
        write_model_card(args.out)
        return {}

    t_start = time.time()
    root = stdlib_dir()
    train_files, held_files = corpus_files(root)
    train_texts = [read_source(root, f) for f in train_files]
    held_texts = [read_source(root, f) for f in held_files]
    tok = train_tokenizer(train_texts, args.vocab)
    train_stream = encode_stream(tok, train_texts)
    held_stream = encode_stream(tok, held_texts)
    print(
        f"corpus {root}: {len(train_files)} train files ({len(train_stream)} tokens), "
        f"{len(held_files)} held-out files ({len(held_stream)} tokens); tokenizer vocab "
        f"{tok.get_vocab_size()} ({time.time() - t_start:.1f} s)",
        flush=True,
    )

    config = tiny_config(tok.get_vocab_size(), args.seq_len)
    model = DeepseekV3.random(config, dtype=jnp.float32, seed=args.seed, std=args.init_std)
    n_params = param_count(model)
    n_trained = n_params - config.vocab_size * config.hidden_size  # the MTP head is the lm_head
    print(f"model: {n_params} parameters in the checkpoint ({n_trained} trained)", flush=True)

    graphdef, state = nnx.split(model)
    tx = make_optimizer(
        state, lr=args.lr, steps=args.steps, warmup=args.warmup, weight_decay=args.weight_decay
    )
    opt_state = tx.init(state)
    train_step, eval_step = make_steps(graphdef, tx, mtp_lambda=args.mtp_lambda, bias_rate=args.bias_rate)

    rng = np.random.default_rng(args.seed)
    held_wins = heldout_windows(held_stream, args.seq_len, args.eval_windows)
    hi = len(train_stream) - args.seq_len - 2
    history = []
    t0 = time.time()
    t_compiled = None
    t_eval = 0.0
    run = {"main": 0.0, "mtp": 0.0, "n": 0}
    for step in range(1, args.steps + 1):
        win = windows(train_stream, rng.integers(0, hi, args.batch), args.seq_len)
        state, opt_state, m = train_step(state, opt_state, jnp.asarray(win))
        if step == 1:
            jax.block_until_ready(m)
            t_compiled = time.time()
            print(f"step 1 (compile + run) {t_compiled - t0:.1f} s", flush=True)
        run["main"] += float(m["main"])
        run["mtp"] += float(m["mtp"])
        run["n"] += 1
        if step % args.log_every == 0 or step == args.steps:
            el = time.time() - t_compiled - t_eval
            per = el / max(step - 1, 1)
            rec = {
                "step": step,
                "train_main": run["main"] / run["n"],
                "train_mtp": run["mtp"] / run["n"],
                "max_load": float(m["max_load"]),
                "s_per_step": per,
            }
            run = {"main": 0.0, "mtp": 0.0, "n": 0}
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                te = time.time()
                rec["held_main"], rec["held_mtp"] = evaluate(eval_step, state, held_wins, args.batch)
                t_eval += time.time() - te
            history.append(rec)
            print(
                " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()),
                flush=True,
            )
    train_s = time.time() - t0
    if args.time_only:
        return {"s_per_step": history[-1]["s_per_step"] if history else None}

    held_main, held_mtp = evaluate(eval_step, state, held_wins, args.batch)
    train_eval_wins = heldout_windows(train_stream, args.seq_len, args.eval_windows)
    tr_main, tr_mtp = evaluate(eval_step, state, train_eval_wins, args.batch)
    model = nnx.merge(graphdef, state)
    # The MTP module's output head is the main head (shared in training); the published layout stores it.
    model.mtp[0].shared_head.head.kernel.set_value(model.lm_head.kernel[...])
    cmd = "python -m tokenspeed_jax.models.deepseek.train " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    metrics = {
        "command": cmd,
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "device": str(jax.devices()[0].device_kind),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "args": vars(args),
        "parameters": n_params,
        "trained_parameters": n_trained,
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_tokens": int(len(train_stream)),
        "heldout_tokens": int(len(held_stream)),
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "train_loss": tr_main,
        "train_mtp_loss": tr_mtp,
        "heldout_loss": held_main,
        "heldout_mtp_loss": held_mtp,
        "eval_windows": args.eval_windows,
        "history": history,
    }
    size = save(model, tok, args.out, metrics)
    write_model_card(args.out)
    print(
        f"train loss {tr_main:.4f} (MTP {tr_mtp:.4f}), held-out loss {held_main:.4f} (MTP {held_mtp:.4f}); "
        f"wrote {args.out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f} s",
        flush=True,
    )
    return metrics


if __name__ == "__main__":
    main()
