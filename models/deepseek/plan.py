"""Plan before load: bytes per device of weights, KV cache and peak activations for a config, mesh,
batch and context, from the abstract model (``nnx.eval_shape``, no memory) and the shardings the loader
will use (:mod:`.parallel`), so the weight figure is exactly the size of each device's shards.

``plan(config, mesh_shape, ...)`` returns a :class:`Plan`; ``Plan.check()`` raises ``ValueError`` naming
what to change when the layout does not fit.  ``tokenspeed-deepseek --plan`` prints it.

Model of the bytes (per device):

* weights: every parameter's bytes divided by the product of the mesh axes its PartitionSpec splits it
  over (FP8 kernels 1 byte + float32 block scales; embeddings / heads / norms / router in ``param_dtype``).
* KV cache: ``num_pages * num_layers * page_size * (kv_lora_rank + rope_dim) * itemsize`` for the pages
  of the requests of one data rank (``ceil(batch / data)`` requests of ``context`` tokens plus MTP
  lookahead), replicated over tensor and expert ranks.
* peak activations: the larger of a prefill step of ``prefill_tokens`` tokens per data rank and a decode
  step of ``batch / data`` requests x ``(num_speculative_tokens + 1)`` tokens; per step the live buffers
  of one scanned layer (hidden states, q / k / v of this rank's heads, the MoE's all-gathered tokens x
  top-k rows of ``[hidden]`` and ``[moe_intermediate]`` width, float32 partial sums), the per-block
  dequantised weights of the largest layer (FP8 kernels are dequantised inside the step) and the logits.
  It is an estimate of the live set, not XLA's buffer assignment; ``margin`` covers the rest.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

GiB = 1024**3
H200_BYTES = 143771 * 1024**2  # nvidia-smi's total for an H200 (140.4 GiB)


@dataclasses.dataclass
class Plan:
    mesh: dict[str, int]
    batch: int
    context: int
    prefill_tokens: int
    num_speculative_tokens: int
    kv_dtype: str
    weight_bytes: int
    weight_bytes_total: int
    kv_cache_bytes: int
    num_pages: int
    activation_bytes: int
    activation_detail: dict[str, int]
    device_bytes: int
    usable_fraction: float
    largest: list[tuple[str, int]]

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * self.usable_fraction)

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def advice(self) -> str:
        """What to change, biggest item first."""
        tips = []
        m = self.mesh
        over = -self.headroom_bytes
        if self.weight_bytes > 0.8 * self.usable_bytes:
            tips.append("use more devices on the mesh (experts split over all of data x tensor x expert; "
                        "attention weights over tensor), or FP8 weights")
        if self.kv_cache_bytes >= over or self.kv_cache_bytes > self.usable_bytes // 4:
            tips.append(f"lower --batch ({self.batch}) or --context ({self.context}), raise data "
                        f"(DP attention: {m['data']}) so each rank holds fewer requests' caches, or use "
                        "--kv-dtype float8_e4m3fn")
        if self.activation_bytes >= over or self.activation_bytes > self.usable_bytes // 4:
            tips.append(f"lower --prefill-tokens ({self.prefill_tokens} per data rank)")
        return "; ".join(tips)

    def check(self) -> Plan:
        if not self.fits:
            raise ValueError(
                f"plan: {_gib(self.total_bytes)} per device (weights {_gib(self.weight_bytes)}, KV cache "
                f"{_gib(self.kv_cache_bytes)}, activations {_gib(self.activation_bytes)}) does not fit "
                f"{_gib(self.usable_bytes)} usable on mesh {self.mesh}; " + self.advice()
            )
        return self

    def to_dict(self) -> dict:
        return {
            "mesh": self.mesh,
            "batch": self.batch,
            "context": self.context,
            "prefill_tokens_per_data_rank": self.prefill_tokens,
            "num_speculative_tokens": self.num_speculative_tokens,
            "kv_dtype": self.kv_dtype,
            "bytes_per_device": {
                "weights": self.weight_bytes,
                "kv_cache": self.kv_cache_bytes,
                "activations": self.activation_bytes,
                "total": self.total_bytes,
                "usable": self.usable_bytes,
                "headroom": self.headroom_bytes,
            },
            "activation_detail": self.activation_detail,
            "weight_bytes_all_devices": self.weight_bytes_total,
            "kv_cache_pages_per_data_rank": self.num_pages,
            "fits": self.fits,
        }

    def text(self) -> str:
        lines = [
            f"plan: mesh {self.mesh}, batch {self.batch}, context {self.context}, prefill "
            f"{self.prefill_tokens} tokens per data rank, MTP k = {self.num_speculative_tokens}, "
            f"KV cache {self.kv_dtype}",
            f"  weights      {_gib(self.weight_bytes):>12} per device "
            f"({_gib(self.weight_bytes_total)} in all)",
            f"  KV cache     {_gib(self.kv_cache_bytes):>12} per device "
            f"({self.num_pages} pages per data rank)",
            f"  activations  {_gib(self.activation_bytes):>12} per device (peak estimate: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in self.activation_detail.items()) + ")",
            f"  total        {_gib(self.total_bytes):>12} of {_gib(self.usable_bytes)} usable "
            f"({self.usable_fraction:.0%} of {_gib(self.device_bytes)}): "
            + (f"fits, headroom {_gib(self.headroom_bytes)}" if self.fits
               else f"DOES NOT FIT by {_gib(-self.headroom_bytes)}; " + self.advice()),
        ]
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def abstract_params(config, *, dtype=jnp.bfloat16, param_dtype=None):
    """``[(path, shape, dtype)]`` of the model's parameters, from ``nnx.eval_shape`` (no memory)."""
    from flax import nnx
    from tokenspeed_jax.models.deepseek.model import DeepseekV3

    pd = dtype if param_dtype is None else param_dtype
    m = nnx.eval_shape(lambda: DeepseekV3(config, dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0)))
    return [(p, tuple(v.shape), np.dtype(v.dtype)) for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))]


def shard_shape(shape, spec, mesh_shape: dict[str, int]) -> tuple[int, ...]:
    out = list(shape)
    for i, ax in enumerate(tuple(spec)):
        if ax is None:
            continue
        n = math.prod(mesh_shape[a] for a in (ax if isinstance(ax, tuple) else (ax,)))
        out[i] = -(-out[i] // n)
    return tuple(out)


class _FakeMesh:
    """Just ``.shape`` (param_spec needs only the axis sizes), so a plan needs no devices."""

    def __init__(self, shape):
        self.shape = dict(shape)


def plan(
    config,
    mesh_shape: dict[str, int],
    *,
    batch: int,
    context: int,
    prefill_tokens: int | None = None,
    num_speculative_tokens: int = 1,
    dtype=jnp.bfloat16,
    param_dtype=None,
    kv_dtype=None,
    page_size: int = 64,
    device_bytes: int = H200_BYTES,
    usable_fraction: float = 0.95,
) -> Plan:
    """Bytes per device (module docstring).  ``prefill_tokens`` (per data rank, default
    ``min(ceil(batch / data) * context, 8192)``) is the size of one prefill step.  A mesh the model cannot
    run on raises ``ValueError`` (:func:`~.parallel.check_mesh`)."""
    from tokenspeed_jax.models.deepseek.parallel import AXES, check_mesh, param_spec

    ms = {a: int(mesh_shape.get(a, 1)) for a in AXES}
    check_mesh(config, ms)  # a layout the model cannot run on is refused, whatever its bytes
    fake = _FakeMesh(ms)
    n_dev = math.prod(ms.values())
    c = config
    b = jnp.dtype(dtype).itemsize
    kv_dt = jnp.dtype(dtype if kv_dtype is None else kv_dtype)

    weights = total = 0
    per_param = []
    for p, shape, dt in abstract_params(c, dtype=dtype, param_dtype=param_dtype):
        spec = param_spec(p, shape, fake)
        nbytes = math.prod(shard_shape(shape, spec, ms)) * dt.itemsize
        weights += nbytes
        total += math.prod(shape) * dt.itemsize  # the model's size
        per_param.append((".".join(map(str, p)), nbytes))
    per_param.sort(key=lambda x: -x[1])

    d, t = ms["data"], ms["tensor"]
    req = -(-batch // d)
    k = num_speculative_tokens if c.num_nextn_predict_layers else 0
    lookahead = 2 * k + 1 if k else 0
    pages = req * -(-(context + lookahead) // page_size) + 1
    n_layers = c.num_hidden_layers + c.num_nextn_predict_layers
    kv_bytes = pages * n_layers * page_size * c.kv_cache_dim * kv_dt.itemsize

    pf = prefill_tokens if prefill_tokens is not None else min(req * context, 8192)
    H = -(-c.num_attention_heads // t)
    D, I, K = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    fp8 = c.quantization_config is not None

    def step(T: int) -> dict[str, int]:
        hidden = 6 * T * D * 4  # residual, norms, attention / MLP outputs (float32 upper bound)
        attn = T * H * (2 * c.qk_head_dim + 2 * c.v_head_dim) * b
        attn += T * ((c.q_lora_rank or 0) + c.kv_cache_dim) * 4  # latent q / kv rows
        Tg = T * d  # the MoE all-gathers the tokens of the data group
        moe = Tg * K * (2 * D * b + 3 * I * b + D * 4) + Tg * D * 4 if c.n_routed_experts else 0
        dense = T * c.intermediate_size * 3 * b
        return {"hidden": hidden, "attention": attn, "moe": moe, "dense_mlp": dense}

    pre = step(pf)
    dec = step(req * (k + 1))
    worst = pre if sum(pre.values()) >= sum(dec.values()) else dec
    # per-block dequantised weights of the largest layer's local experts / projections (FP8 kernels)
    deq = 0
    if fp8:
        e_local = -(-c.n_routed_experts // n_dev)
        deq = max(e_local * 3 * D * I * b, 3 * D * c.intermediate_size // t * b)
    logits = req * (k + 1) * c.vocab_size * 4 * 2  # lm_head + MTP head rows, float32
    detail = {**{f"{k_}": v for k_, v in worst.items()}, "dequantised_weights": deq, "logits": logits}
    act = sum(detail.values())
    return Plan(
        mesh=ms,
        batch=batch,
        context=context,
        prefill_tokens=pf,
        num_speculative_tokens=k,
        kv_dtype=kv_dt.name,
        weight_bytes=weights,
        weight_bytes_total=total,
        kv_cache_bytes=kv_bytes,
        num_pages=pages,
        activation_bytes=act,
        activation_detail=detail,
        device_bytes=device_bytes,
        usable_fraction=usable_fraction,
        largest=per_param[:5],
    )
