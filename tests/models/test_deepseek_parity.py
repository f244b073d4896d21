"""Parity with Hugging Face transformers' DeepseekV3 (torch CPU, fp32) on a small random model saved in
the published safetensors layout, through our loader: logits, greedy generations, FP8 checkpoint."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.models import hf_util

torch = pytest.importorskip("torch")


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids], dtype=torch.long)).logits[0].double().numpy()


def hf_greedy(hf_model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(hf_logits(hf_model, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_logits_match_transformers(hf_checkpoint, model, model_seed):
    hf_model, *_ = hf_checkpoint
    ids = np.random.default_rng(model_seed + 3).integers(0, 256, 24).tolist()
    ref = hf_logits(hf_model, ids)
    got = np.asarray(model.logits(jnp.asarray(ids, jnp.int32)))
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_greedy_generation_matches_transformers(hf_checkpoint, prompts, greedy_ref):
    hf_model, *_ = hf_checkpoint
    for p, toks in zip(prompts, greedy_ref):
        assert toks == hf_greedy(hf_model, p, len(toks))


def test_generate_entry_point(model, prompts, greedy_ref):
    from tokenspeed_jax.models.deepseek import generate

    assert generate(model, prompts, 10, backend="xla") == greedy_ref


def test_fp8_block_checkpoint(hf_checkpoint, model_seed, tmp_path):
    """FP8 e4m3 + 128x128 weight_scale_inv checkpoint: our dequantised model equals transformers' model
    holding the dequantised weights, and stays close to the original."""
    from tokenspeed_jax.models.deepseek import load_checkpoint

    hf_model, cfg, tensors, _ = hf_checkpoint
    q, deq = hf_util.quantize_state(tensors)
    assert any(v.dtype.name == "float8_e4m3fn" for v in q.values())
    cfg8 = dict(
        cfg,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    hf_util.write_checkpoint(tmp_path, q, cfg8, num_shards=3)
    ours = load_checkpoint(tmp_path, dtype=jnp.float32, progress=False)
    # FP8 weights stay FP8 (e4m3 + block scales), dequantised inside the jitted step
    assert ours.config.quantization_config is not None
    attn = ours.moe_layers.self_attn
    assert attn.kv_b_proj.kernel.dtype == jnp.float8_e4m3fn and attn.kv_b_proj.kernel_scale_inv.dtype == jnp.float32
    assert ours.moe_layers.mlp.experts.gate_proj.dtype == jnp.float8_e4m3fn
    deq_model = load_checkpoint(tmp_path, dtype=jnp.float32, progress=False, fp8_weights=False)
    assert deq_model.config.quantization_config is None
    ref_model, _ = hf_util.make_hf_model(model_seed)
    sd = {
        k: torch.from_numpy(np.asarray(v, np.float32))
        for k, v in deq.items()
        if not k.startswith(f"model.layers.{cfg['num_hidden_layers']}.")
    }
    for k in list(sd):  # back to transformers' fused expert tensors
        if ".mlp.experts.0.gate_proj.weight" in k:
            pre = k.split("0.gate_proj.weight")[0]
            E = cfg["n_routed_experts"]
            sd[pre + "gate_up_proj"] = torch.stack(
                [
                    torch.cat([sd.pop(f"{pre}{e}.gate_proj.weight"), sd.pop(f"{pre}{e}.up_proj.weight")])
                    for e in range(E)
                ]
            )
            sd[pre + "down_proj"] = torch.stack([sd.pop(f"{pre}{e}.down_proj.weight") for e in range(E)])
    missing, unexpected = ref_model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    ids = np.random.default_rng(model_seed + 4).integers(0, 256, 24).tolist()
    ref = hf_logits(ref_model, ids)
    got = np.asarray(ours.logits(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    got_deq = np.asarray(deq_model.logits(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, got_deq, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    orig = hf_logits(hf_model, ids)
    # e4m3 weights are a few % off each; routing may flip for a token, so compare in norm only.
    assert np.linalg.norm(got - orig) < 0.3 * np.linalg.norm(orig)


def test_variant_q_proj_plain_rope_no_yarn(model_seed, tmp_path):
    """The other config branches: q_proj (q_lora_rank None, as DeepSeek-V2-Lite), non-interleaved RoPE
    and no rope scaling; checkpoint without MTP tensors (loads without the MTP layer)."""
    from tokenspeed_jax.models.deepseek import load_checkpoint

    hf_model, cfg = hf_util.make_hf_model(model_seed, q_lora_rank=None, rope_interleave=False, rope_scaling=None)
    hf_util.write_checkpoint(tmp_path, hf_util.hf_state(hf_model), cfg, num_shards=1)
    with pytest.warns(UserWarning, match="no MTP tensors"):
        ours = load_checkpoint(tmp_path, dtype=jnp.float32, progress=False)
    assert ours.config.q_lora_rank is None and ours.config.rope_scaling is None
    ids = np.random.default_rng(model_seed + 6).integers(0, 256, 24).tolist()
    ref = hf_logits(hf_model, ids)
    got = np.asarray(ours.logits(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
