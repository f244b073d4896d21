"""Helpers shared by the model tests: a small random transformers DeepseekV3 and its checkpoint on disk."""

from __future__ import annotations

import numpy as np
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.weights import quantize_fp8_block, write_sharded

# The tiny preset with a non-trivial YaRN (mscale != mscale_all_dim exercises the cos/sin attention factor).
ROPE = {
    "type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def tiny_config_dict(**overrides) -> dict:
    c = DeepseekV3Config.preset("tiny").to_dict()
    c.pop("quantization_config", None)
    c.update(rope_scaling=dict(ROPE), max_position_embeddings=2560)
    c.update(overrides)
    return c


def make_hf_model(seed: int, **overrides):
    """A random fp32 transformers DeepseekV3ForCausalLM (eager attention) with weights of std 0.1 (more
    decisive logits than the default 0.02), random norm weights and correction bias."""
    import torch
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM

    d = tiny_config_dict(**overrides)
    hf_cfg = HFConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model, d


def hf_state(model) -> dict[str, np.ndarray]:
    """The published-name float32 tensors of a transformers model (per-expert names, as it saves them)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().numpy()
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{pre}{e}.up_proj.weight"] = v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def mtp_tensors(state: dict[str, np.ndarray], config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random DeepSeek-V3-layout MTP layer ``model.layers.{L}.*`` (a copy of the last layer's shapes plus
    enorm / hnorm / eh_proj / shared_head / embed_tokens)."""
    rng = np.random.default_rng(seed)
    L = config["num_hidden_layers"]
    H = config["hidden_size"]
    src = f"model.layers.{L - 1}."
    out = {}
    for k, v in state.items():
        if k.startswith(src):
            new = f"model.layers.{L}." + k[len(src) :]
            out[new] = (
                1 + 0.1 * rng.standard_normal(v.shape) if "norm" in k else 0.1 * rng.standard_normal(v.shape)
            ).astype(np.float32)
    p = f"model.layers.{L}."
    out[p + "enorm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    out[p + "hnorm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    out[p + "eh_proj.weight"] = (0.1 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    out[p + "shared_head.norm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    out[p + "shared_head.head.weight"] = (0.1 * rng.standard_normal((config["vocab_size"], H))).astype(
        np.float32
    )
    out[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].copy()
    return out


def quantize_state(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """DeepSeek's FP8 release format of ``state``: every 2-D projection weight except embeddings, heads and
    the router becomes e4m3 + ``weight_scale_inv``.  Returns ``(fp8 tensors, dequantised float32 state)``."""
    from tokenspeed_jax.models.deepseek.weights import dequantize_fp8_block

    q, deq = {}, {}
    for k, v in state.items():
        if (
            v.ndim == 2
            and "embed_tokens" not in k
            and not k.startswith("lm_head")
            and "shared_head.head" not in k
            and not k.endswith("mlp.gate.weight")
        ):
            w, s = quantize_fp8_block(v)
            q[k], q[k + "_scale_inv"] = w, s
            deq[k] = dequantize_fp8_block(w, s)
        else:
            q[k] = v
            deq[k] = v
    return q, deq


def write_checkpoint(path, tensors: dict[str, np.ndarray], config: dict, *, num_shards: int = 2) -> None:
    import json
    import os

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_sharded(tensors, str(path), num_shards=num_shards)
