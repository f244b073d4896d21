"""``DeepseekV3Config``: the frozen, hashable model configuration with Hugging Face ``config.json`` names.

The field names are those of DeepSeek-V3/R1's published ``config.json`` (and of
``transformers.DeepseekV3Config``), so ``DeepseekV3Config.from_json(path)`` reads a checkpoint directory's
config as is.  Both spellings of the RoPE settings are accepted: the published ``rope_theta`` +
``rope_scaling`` and newer transformers' ``rope_parameters`` (which ``save_pretrained`` writes).

Presets (``DeepseekV3Config.preset(name)``):

* ``deepseek-r1`` -- the published DeepSeek-R1 values (61 layers, 256 experts, FP8 128x128 blocks).
* ``small`` -- the CLI demo: 4 layers, hidden 512, 16 heads, 16 experts, vocab 4096.
* ``tiny`` -- tests: 2 layers (1 dense + 1 MoE), hidden 64, 2 heads, 8 experts, vocab 256.

Reading config.json (:meth:`DeepseekV3Config.from_dict`): the file is untrusted input.  It must be a JSON
object, and every known key must have its field's JSON type (ints, numbers, bools, strings, objects for
``rope_scaling`` / ``rope_parameters`` / ``quantization_config``) and a value in its range (sizes and
counts positive or non-negative, ``rope_theta > 1``, YaRN factors, betas and mscales finite and
non-negative); a wrong one raises ``ValueError`` naming the key.  Features the model does not implement
(``attention_bias``, ``tie_word_embeddings``) are refused, never ignored.  A missing (or null)
``rope_scaling`` and no ``rope_parameters`` means **no RoPE scaling**, as in transformers (the published R1
config spells its YaRN out; only the ``deepseek-r1`` preset has it built in); a null ``rope_scaling`` next to
``rope_parameters`` takes the latter, as transformers does.  Inside a YaRN ``rope_scaling`` a missing key
also means what it means to transformers, never R1's value: no ``mscale`` / ``mscale_all_dim`` (cos/sin
scaled by ``yarn_get_mscale(factor)``, softmax scale unchanged), ``original_max_position_embeddings`` =
``max_position_embeddings``; ``attention_factor`` and ``truncate`` are honoured, and a missing ``factor`` is
refused.  Unknown keys are ignored.

Every preset keeps the attention dims of the real model (kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128), which are what the MLA kernels are specialised for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention-magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` of config.json; only ``type = "yarn"`` (DeepSeek-V3/R1) is supported.

    The defaults are DeepSeek-R1's values (the ``deepseek-r1`` preset).  A config.json is read with
    transformers' meaning of a missing key instead (:meth:`DeepseekV3Config.from_dict`): ``mscale`` /
    ``mscale_all_dim`` / ``attention_factor`` ``None`` (cos/sin scaled by ``yarn_get_mscale(factor)``, softmax
    scale unchanged), ``original_max_position_embeddings`` the config's ``max_position_embeddings``."""

    type: str = "yarn"
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = 1.0
    mscale_all_dim: float | None = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            v = getattr(self, name)
            if v is not None or name in ("factor", "beta_fast", "beta_slow"):
                _check_number(f"rope_scaling.{name}", v)
                if v < 0:  # the YaRN correction range takes log(beta); 0 means the default
                    raise ValueError(f"rope_scaling.{name}: expected a non-negative number, got {v!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate: expected a bool (true/false), got {self.truncate!r:.80}")
        if not is_int(self.original_max_position_embeddings) or self.original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling.original_max_position_embeddings: expected a positive int, "
                             f"got {self.original_max_position_embeddings!r}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor: expected a positive number, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """``quantization_config`` of config.json (DeepSeek's FP8: e4m3 with 128x128 block scales)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)

    def __post_init__(self):
        if not isinstance(self.activation_scheme, str):
            raise ValueError(f"quantization_config.activation_scheme: expected a string, "
                             f"got {self.activation_scheme!r:.80}")
        b = self.weight_block_size
        if not isinstance(b, (tuple, list)) or len(b) != 2 or not all(is_int(x) and x >= 1 for x in b):
            raise ValueError(
                f"quantization_config.weight_block_size: expected two positive ints [out, in], got {b!r}"
            )
        object.__setattr__(self, "weight_block_size", tuple(b))


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool (True is not a size, a count or a token id)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _check_number(key: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key}: expected a finite number, got {v!r}")


def _rope_scaling_from_json(rtype: str, rs: dict[str, Any], max_position_embeddings) -> RopeScaling:
    """A config.json ``rope_scaling`` object read as transformers reads it: a missing (or null) key is
    absent, not DeepSeek-R1's value.  ``factor`` is required (null: ``max_position_embeddings /
    original_max_position_embeddings``); ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``; ``mscale`` / ``mscale_all_dim`` / ``attention_factor`` stay ``None``;
    ``beta_fast`` / ``beta_slow`` default to 32 / 1."""
    if rtype != "yarn":
        raise ValueError(f"rope_scaling: expected type 'yarn' or no scaling, got {rtype!r:.80}")
    if "factor" not in rs:
        raise ValueError("rope_scaling.factor: missing (YaRN needs its factor, as transformers does)")
    orig = rs.get("original_max_position_embeddings")
    orig = max_position_embeddings if orig is None else orig
    factor = rs.get("factor")
    if factor is None and is_int(orig) and orig > 0 and is_int(max_position_embeddings):
        factor = max_position_embeddings / orig
    return RopeScaling(
        type=rtype,
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=rs.get("beta_fast") or 32.0,
        beta_slow=rs.get("beta_slow") or 1.0,
        mscale=rs.get("mscale"),
        mscale_all_dim=rs.get("mscale_all_dim"),
        attention_factor=rs.get("attention_factor"),
        truncate=rs.get("truncate", True),
    )


# The JSON type of each DeepseekV3Config field (checked by from_dict before construction).
_JSON_TYPES = {"int": "an int", "float": "a number", "bool": "a bool (true/false)", "str": "a string",
               "int | None": "an int or null"}


def _check_json_type(key: str, annotation: str, v) -> None:
    ok = {
        "int": lambda: is_int(v),
        "int | None": lambda: v is None or is_int(v),
        "float": lambda: not isinstance(v, bool) and isinstance(v, (int, float)),
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str),
    }.get(annotation)
    if ok is not None and not ok():
        raise ValueError(f"{key}: expected {_JSON_TYPES[annotation]}, got {v!r:.80}")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    topk_method: str = "noaux_tc"
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    quantization_config: QuantizationConfig | None = None

    def __post_init__(self):
        for name in (
            "hidden_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "vocab_size",
            "num_hidden_layers",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        for name, low in (("intermediate_size", 1), ("moe_intermediate_size", 1), ("n_routed_experts", 1),
                          ("n_group", 1), ("num_experts_per_tok", 1), ("max_position_embeddings", 1),
                          ("n_shared_experts", 0), ("first_k_dense_replace", 0),
                          ("num_nextn_predict_layers", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r:.80}")
        if self.q_lora_rank is not None and (not is_int(self.q_lora_rank) or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank: expected a positive int or null, got {self.q_lora_rank!r:.80}")
        for name in ("attention_bias", "tie_word_embeddings"):  # not implemented: refused, never ignored
            if getattr(self, name) is not False:
                raise ValueError(f"{name}: expected false (not implemented by this model), "
                                 f"got {getattr(self, name)!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number, got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads: expected num_attention_heads = {self.num_attention_heads} (MLA), "
                f"got {self.num_key_value_heads}"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_group: expected a divisor of n_routed_experts = {self.n_routed_experts}, "
                f"got {self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected 1..n_group = {self.n_group}, got {self.topk_group}")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                "n_group: expected at least 2 experts per group (group score = top-2 sum), got "
                f"{self.n_routed_experts // self.n_group}"
            )
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok: expected <= experts in the selected groups, got "
                f"{self.num_experts_per_tok}"
            )
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise ValueError(
                f"scoring_func/topk_method: only DeepSeek-V3's 'sigmoid'/'noaux_tc' routing is "
                f"implemented, got {self.scoring_func!r}/{self.topk_method!r}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            _check_number(name, getattr(self, name))
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)!r}")
        if not self.rope_theta > 1:  # RoPE frequencies base ** (-2i / d); YaRN divides by log(base)
            raise ValueError(f"rope_theta: expected a number > 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling: expected a RopeScaling or None, got {self.rope_scaling!r:.80}")
        if self.rope_scaling is not None and self.rope_scaling.type != "yarn":
            raise ValueError(
                f"rope_scaling: expected type 'yarn' or no scaling, got {self.rope_scaling.type!r}"
            )

    # ------------------------------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank + qk_rope_head_dim`` (576 for R1)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5 * mscale^2`` with ``mscale = yarn_get_mscale(factor, mscale_all_dim)``
        (DeepSeek's reference and transformers' ``yarn_apply_mscale``)."""
        s = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            s = s * m * m
        return s

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.n_routed_experts > 0

    @property
    def fp8_block_size(self) -> tuple[int, int] | None:
        q = self.quantization_config
        return None if q is None else tuple(q.weight_block_size)

    # -------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV3Config:
        """From a ``config.json`` dict; unknown keys (architectures, torch_dtype, ...) are ignored, known
        keys are type-checked (module docstring), and a missing ``rope_scaling`` means no scaling."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(d).__name__}")
        d = dict(d)
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        rp = d.get("rope_parameters")
        if rp is not None and not isinstance(rp, dict):
            raise ValueError(f"rope_parameters: expected an object or null, got {rp!r:.80}")
        src = "rope_scaling"  # the key errors name: where the scaling came from
        if rp and d.get("rope_scaling") is None:  # transformers >= 5 spelling (null rope_scaling = absent)
            kw["rope_theta"] = rp.get("rope_theta", kw.get("rope_theta", 10000.0))
            rtype = rp.get("rope_type", rp.get("type", "default"))
            kw["rope_scaling"] = None if rtype == "default" else rp
            src = "rope_parameters"
        rs = kw.get("rope_scaling")  # missing: no scaling (transformers' default), not R1's YaRN
        if rs is not None and not isinstance(rs, dict):
            raise ValueError(f"rope_scaling: expected an object or null, got {rs!r:.80}")
        if isinstance(rs, dict):
            rs = dict(rs)
            rtype = rs.pop("rope_type", None) or rs.pop("type", "yarn")
            rs.pop("type", None)
            if not isinstance(rtype, str):
                raise ValueError(f"{src}.type: expected a string, got {rtype!r:.80}")
            if rtype not in ("yarn", "default"):
                raise ValueError(f"{src}.type: expected 'yarn' or 'default' (no scaling), got {rtype!r:.80}")
            try:
                rs = None if rtype == "default" else _rope_scaling_from_json(
                    rtype, rs, kw.get("max_position_embeddings", cls.max_position_embeddings))
            except ValueError as e:  # RopeScaling names its fields rope_scaling.*
                raise ValueError(str(e).replace("rope_scaling", src, 1)) from None
        kw["rope_scaling"] = rs
        qc = kw.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise ValueError(f"quantization_config: expected an object or null, got {qc!r:.80}")
        if isinstance(qc, dict):
            if qc.get("quant_method", "fp8") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
                raise ValueError(
                    f"quantization_config: only DeepSeek's fp8/e4m3 block quantisation is supported, got {qc}"
                )
            wbs = qc.get("weight_block_size", (128, 128))
            kw["quantization_config"] = QuantizationConfig(
                quant_method="fp8",
                fmt="e4m3",
                activation_scheme=qc.get("activation_scheme", "dynamic"),
                weight_block_size=tuple(wbs) if isinstance(wbs, list) else wbs,
            )
        for k in ("eos_token_id", "bos_token_id"):
            if isinstance(kw.get(k), list):
                kw[k] = kw[k][0] if kw[k] else None
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", cls.num_attention_heads)
        for k, v in kw.items():
            _check_json_type(k, fields[k], v)
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> DeepseekV3Config:
        """From ``config.json`` (a file or a checkpoint directory containing one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config.json: no such file {path!r}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config.json: {path!r} is not valid JSON ({e})") from None
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict (published field names, loadable by transformers' DeepseekV3Config)."""
        d = dataclasses.asdict(self)
        if self.rope_scaling is not None:  # absent keys stay absent (transformers reads them the same way)
            d["rope_scaling"] = {
                k: v
                for k, v in dataclasses.asdict(self.rope_scaling).items()
                if v is not None and not (k == "truncate" and v)
            }
        if self.quantization_config is not None:
            d["quantization_config"] = {
                **dataclasses.asdict(self.quantization_config),
                "weight_block_size": list(self.quantization_config.weight_block_size),
            }
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        return d

    def replace(self, **kw) -> DeepseekV3Config:
        return dataclasses.replace(self, **kw)

    @classmethod
    def preset(cls, name: str) -> DeepseekV3Config:
        if name not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return PRESETS[name]


PRESETS: dict[str, DeepseekV3Config] = {
    "deepseek-r1": DeepseekV3Config(quantization_config=QuantizationConfig()),
    "small": DeepseekV3Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=256,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
    ),
    "tiny": DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    ),
}
