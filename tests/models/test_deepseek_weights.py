"""Checkpoint loader: round trip, config parsing, and clear errors for broken checkpoints."""

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tokenspeed_jax.models.deepseek import CheckpointError, DeepseekV3Config, load_checkpoint
from tokenspeed_jax.models.deepseek.weights import (
    SafetensorsFile,
    dequantize_fp8_block,
    quantize_fp8_block,
    save_safetensors,
)

from tests.models import hf_util


def put(path, text):
    with open(path, "w") as f:
        f.write(text)


def _write(path, tensors, cfg, **kw):
    hf_util.write_checkpoint(path, tensors, cfg, **kw)
    return path


def test_safetensors_round_trip_all_dtypes(tmp_path, rng):
    t = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "c": rng.standard_normal((2, 2)).astype(ml_dtypes.float8_e4m3fn),
        "d": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    save_safetensors(t, str(tmp_path / "x.safetensors"))
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    for k, v in t.items():
        got = f.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got.view(np.uint8), v.view(np.uint8))
    # The reference reader agrees with our writer (on the dtypes numpy has).
    import safetensors.numpy

    save_safetensors({"a": t["a"], "d": t["d"]}, str(tmp_path / "y.safetensors"))
    ref = safetensors.numpy.load_file(str(tmp_path / "y.safetensors"))
    np.testing.assert_array_equal(ref["a"], t["a"])
    np.testing.assert_array_equal(ref["d"], t["d"])


def test_fp8_block_quantisation(rng):
    w = rng.standard_normal((300, 200)).astype(np.float32) * rng.uniform(0.01, 10, (300, 1)).astype(
        np.float32
    )
    q, s = quantize_fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 2) and s.dtype == np.float32
    d = dequantize_fp8_block(q, s)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of each block's scale-normalised value.
    bound = np.repeat(np.repeat(s, 128, 0), 128, 1)[:300, :200] * 448 * 2.0**-4
    assert np.all(np.abs(d - w) <= np.maximum(np.abs(w) * 2.0**-4, bound * 2.0**-6) + 1e-30)
    with pytest.raises(CheckpointError, match="weight_scale_inv: expected shape"):
        dequantize_fp8_block(q, s[:, :1])


def test_config_from_published_and_transformers_json(tmp_path):
    r1 = DeepseekV3Config.preset("deepseek-r1")
    assert (r1.kv_lora_rank, r1.qk_rope_head_dim, r1.qk_nope_head_dim, r1.v_head_dim) == (512, 64, 128, 128)
    assert r1.fp8_block_size == (128, 128) and r1.num_nextn_predict_layers == 1
    assert r1.softmax_scale == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    d = r1.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert DeepseekV3Config.from_json(tmp_path) == r1
    new_style = dict(hf_util.tiny_config_dict())
    rs = new_style.pop("rope_scaling")
    new_style["rope_parameters"] = {**rs, "rope_type": "yarn", "rope_theta": 10000.0}
    new_style.pop("rope_theta")
    old = DeepseekV3Config.from_dict(hf_util.tiny_config_dict())
    assert DeepseekV3Config.from_dict(new_style) == old
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DeepseekV3Config.from_dict({**hf_util.tiny_config_dict(), "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="preset"):
        DeepseekV3Config.preset("nope")


@pytest.fixture
def tiny_ckpt(hf_checkpoint):
    _, cfg, tensors, path = hf_checkpoint
    return cfg, dict(tensors), path


def test_save_load_round_trip(model, tmp_path):
    from tokenspeed_jax.models.deepseek import save_checkpoint

    save_checkpoint(model, tmp_path, num_shards=3)
    again = load_checkpoint(tmp_path, dtype=jnp.float32, progress=False)
    from flax import nnx

    a = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(np.asarray(a[p][...]), np.asarray(b[p][...]))


def test_missing_tensor(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    del t["model.layers.1.self_attn.kv_b_proj.weight"]
    with pytest.raises(
        CheckpointError, match=r"missing tensor .*model\.layers\.1\.self_attn\.kv_b_proj\.weight"
    ):
        load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)


def test_missing_expert(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"
    ):
        load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)


def test_unexpected_tensor(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    t["model.layers.0.self_attn.bogus.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.bogus\.weight"
    ):
        load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)


def test_wrong_shape(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    t["model.layers.0.self_attn.o_proj.weight"] = np.zeros((64, 255), np.float32)
    with pytest.raises(
        CheckpointError,
        match=r"o_proj\.weight in model-.*expected shape \(64, 256\), "
        r"got \(64, 255\)",
    ):
        load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)


def test_wrong_dtype(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    t["model.norm.weight"] = np.ones(64, np.int32)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight in .*expected dtype in .*got I32"):
        load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)


def test_fp8_weight_without_scale(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    q, _ = quantize_fp8_block(t["model.layers.0.mlp.up_proj.weight"])
    t["model.layers.0.mlp.up_proj.weight"] = q
    with pytest.raises(CheckpointError, match=r"up_proj\.weight .*without .*weight_scale_inv"):
        load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)


def test_corrupt_index(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    path = _write(tmp_path, t, cfg)
    idx = os.path.join(path, "model.safetensors.index.json")
    with open(idx) as f:
        good = f.read()
    put(idx, good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="corrupt index, not valid JSON"):
        load_checkpoint(path, dtype=jnp.float32, progress=False)
    data = json.loads(good)
    data["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    put(idx, json.dumps(data))
    with pytest.raises(CheckpointError, match=r"shard 'model-00009-of-00009.safetensors'.*does not exist"):
        load_checkpoint(path, dtype=jnp.float32, progress=False)
    data = json.loads(good)
    name = next(k for k, v in data["weight_map"].items() if v.startswith("model-00001"))
    data["weight_map"][name] = "model-00002-of-00002.safetensors"
    put(idx, json.dumps(data))
    with pytest.raises(CheckpointError, match=f"{name}.* listed in .*does not contain it"):
        load_checkpoint(path, dtype=jnp.float32, progress=False)
    put(idx, json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="expected a 'weight_map'"):
        load_checkpoint(path, dtype=jnp.float32, progress=False)


def test_truncated_shard(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    path = _write(tmp_path, t, cfg)
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match="do not match shape"):
        load_checkpoint(path, dtype=jnp.float32, progress=False)


def test_checkpoint_without_mtp_loads_without_mtp_layer(tiny_ckpt, tmp_path):
    cfg, t, _ = tiny_ckpt
    L = cfg["num_hidden_layers"]
    t = {k: v for k, v in t.items() if not k.startswith(f"model.layers.{L}.")}
    with pytest.warns(UserWarning, match="no MTP tensors"):
        m = load_checkpoint(_write(tmp_path, t, cfg), dtype=jnp.float32, progress=False)
    assert m.config.num_nextn_predict_layers == 0 and len(m.mtp) == 0


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="expected a checkpoint directory"):
        load_checkpoint(tmp_path / "nope", dtype=jnp.float32)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_save_keeps_dtype_or_converts(tmp_path):
    """A bf16 model is written as BF16 (the float32 router bias stays F32); ``dtype=`` converts."""
    from tokenspeed_jax.models.deepseek import DeepseekV3, save_checkpoint

    m = DeepseekV3.random(DeepseekV3Config.preset("tiny"), dtype=jnp.bfloat16)
    save_checkpoint(m, tmp_path / "bf16", num_shards=1)
    f = SafetensorsFile(str(tmp_path / "bf16" / "model-00001-of-00001.safetensors"))
    assert f.dtype_name("model.layers.0.self_attn.q_a_proj.weight") == "BF16"
    assert f.dtype_name("model.layers.1.mlp.experts.3.down_proj.weight") == "BF16"
    assert f.dtype_name("model.layers.1.mlp.gate.e_score_correction_bias") == "F32"
    again = load_checkpoint(tmp_path / "bf16", dtype=jnp.bfloat16, progress=False)
    ids = jnp.arange(9, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(again.logits(ids)), np.asarray(m.logits(ids)))
    save_checkpoint(m, tmp_path / "f32", num_shards=1, dtype=jnp.float32)
    f = SafetensorsFile(str(tmp_path / "f32" / "model-00001-of-00001.safetensors"))
    assert f.dtype_name("model.layers.0.self_attn.q_a_proj.weight") == "F32"
    # a dtype the loader cannot read back (or raw e4m3 without block scales) is refused before writing
    for bad in (jnp.int8, jnp.float8_e4m3fn, "float64"):
        with pytest.raises(ValueError, match=r"^dtype: expected float32, bfloat16 or float16 .*fp8=True"):
            save_checkpoint(m, tmp_path / "bad", dtype=bad)
    assert not (tmp_path / "bad").exists()
