"""Hostile checkpoints (issue 34): corrupt safetensors headers and data, FP8 block sizes, config.json
types, symbolic links and path tricks, and a config.json without ``rope_scaling`` against transformers.
Every failure must be a ``CheckpointError`` / ``ValueError`` naming the tensor (or key) and the file."""

# ruff: noqa: E501  (tables of cases read best one per line)

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.weights import (
    CheckpointError,
    SafetensorsFile,
    checkpoint_file,
    dequantize_fp8_block,
    load_checkpoint,
    quantize_fp8_block,
    save_checkpoint,
    save_safetensors,
)


def raw_file(path, header, data: bytes = b"", *, length: int | None = None, header_bytes: bytes | None = None):
    """A safetensors file with an arbitrary (possibly hostile) header."""
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb) if length is None else length))
        f.write(hb)
        f.write(data)
    return str(path)


W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
DATA = np.arange(4, dtype=np.float32).tobytes() + np.arange(4, dtype=np.float32).tobytes()

# (case, header, regex the message must match); every message must also name the file.
HEADERS = [
    ("entry without dtype", {"w": {"shape": [2, 2], "data_offsets": [0, 16]}}, r"^w in .*: corrupt header entry, no 'dtype'"),
    ("entry without data_offsets", {"w": {"dtype": "F32", "shape": [2, 2]}}, r"^w in .*: corrupt header entry, no 'data_offsets'"),
    ("entry without shape", {"w": {"dtype": "F32", "data_offsets": [0, 16]}}, r"^w in .*: corrupt header entry, no 'shape'"),
    ("int in place of an entry", {"w": 7}, r"^w in .*: corrupt header entry, expected an object, got 7"),
    ("list in place of an entry", {"w": [1, 2]}, r"^w in .*: corrupt header entry, expected an object"),
    ("unknown dtype", {"w": {**W, "dtype": "F4"}}, r"^w in .*: unsupported safetensors dtype 'F4'"),
    ("dtype not a string", {"w": {**W, "dtype": 3}}, r"^w in .*: unsupported safetensors dtype 3"),
    ("float offsets", {"w": {**W, "data_offsets": [0.0, 16.0]}}, r"^w in .*: corrupt data_offsets \[0.0, 16.0\]"),
    ("bool offsets", {"w": {**W, "data_offsets": [False, 16]}}, r"^w in .*: corrupt data_offsets"),
    ("three offsets", {"w": {**W, "data_offsets": [0, 8, 16]}}, r"^w in .*: corrupt data_offsets"),
    ("negative offsets", {"w": {**W, "data_offsets": [-16, 0]}}, r"^w in .*: data offsets -16..0 do not match"),
    ("offsets into the header", {"w": {**W, "data_offsets": [-24, -8]}}, r"^w in .*: data offsets -24..-8 do not match"),
    ("offsets past the file", {"w": {**W, "data_offsets": [24, 40]}}, r"^w in .*: data offsets 24..40 do not match .*the file's 32 data bytes"),
    ("size != prod(shape) x itemsize", {"w": {**W, "shape": [2, 3]}}, r"^w in .*: data offsets 0..16 do not match shape \(2, 3\) x F32 \(24 bytes\)"),
    ("negative shape", {"w_scale_inv": {**W, "shape": [-1, 4]}}, r"^w_scale_inv in .*: corrupt shape \[-1, 4\]"),
    ("float shape", {"w": {**W, "shape": [2.0, 2]}}, r"^w in .*: corrupt shape"),
    ("shape not a list", {"w": {**W, "shape": 4}}, r"^w in .*: corrupt shape 4"),
    ("huge shape", {"w": {**W, "shape": [2**40, 2**40]}}, r"^w in .*: data offsets 0..16 do not match"),
    ("overlapping tensors", {"a": W, "b": {**W, "data_offsets": [8, 24]}}, r"^b in .*: data offsets 8..24 overlap those of a \(0..16\)"),
    ("duplicate ranges", {"a": W, "b": W}, r"^b in .*: data offsets 0..16 overlap those of a"),
    ("__metadata__ a list", {"__metadata__": [1], "w": W}, r": corrupt safetensors header, __metadata__ must be an object"),
    ("JSON array header", [W], r": corrupt safetensors header, expected a JSON object, got list"),
    ("JSON string header", "w", r": corrupt safetensors header, expected a JSON object, got str"),
]


@pytest.mark.parametrize("case,header,pattern", HEADERS, ids=[c[0] for c in HEADERS])
def test_corrupt_header_entries(tmp_path, case, header, pattern):
    path = raw_file(tmp_path / "x.safetensors", header, DATA)
    with pytest.raises(CheckpointError, match=pattern) as e:
        f = SafetensorsFile(path)
        for n in f:  # if opening passed, reading must not (it never does: checked on open)
            f.get(n)
    assert path in str(e.value)


def test_offsets_overlapping_the_header_never_load(tmp_path):
    """The issue's silent case: offsets [-16, -16 + n] would read header bytes as weights."""
    good = raw_file(tmp_path / "g.safetensors", {"w": W}, DATA[:16])
    np.testing.assert_array_equal(SafetensorsFile(good).get("w"), np.arange(4, dtype=np.float32).reshape(2, 2))
    bad = raw_file(tmp_path / "b.safetensors", {"w": {**W, "data_offsets": [-16, 0]}}, DATA[:16])
    with pytest.raises(CheckpointError, match=r"^w in .*b\.safetensors: data offsets -16..0"):
        SafetensorsFile(bad)


@pytest.mark.parametrize("case,build,pattern", [
    ("empty file", lambda p: open(p, "wb").close(), r"not a safetensors file \(shorter than its 8-byte"),
    ("header length past the file", lambda p: raw_file(p, {"w": W}, DATA, length=10**6), r"corrupt safetensors header \(length 1000000 > file size"),
    ("header length past the format's limit", lambda p: raw_file(p, {"w": W}, DATA, length=2**63), r"corrupt safetensors header \(length"),
    ("header not UTF-8", lambda p: raw_file(p, None, DATA, header_bytes=b"\xff\xfe{}"), r"corrupt safetensors header \("),
    ("header not JSON", lambda p: raw_file(p, None, DATA, header_bytes=b"{'w': 1}"), r"corrupt safetensors header \("),
    ("deeply nested header", lambda p: raw_file(p, None, DATA, header_bytes=b"[" * 100000 + b"]" * 100000), r"corrupt safetensors header"),
    ("truncated data", lambda p: raw_file(p, {"a": W, "b": {**W, "data_offsets": [16, 32]}}, DATA[:20]), r"^b in .*: data offsets 16..32 do not match"),
    # a name given twice: json keeps the last entry, so the first (here into the header) was never checked
    ("duplicate tensor name", lambda p: raw_file(p, None, DATA, header_bytes=b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [-8, 8]}, "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}'), r"corrupt safetensors header \(key 'w' appears twice\)"),
    ("duplicate key inside an entry", lambda p: raw_file(p, None, DATA, header_bytes=b'{"w": {"dtype": "F32", "dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 16]}}'), r"key 'dtype' appears twice"),
    ("a directory", lambda p: os.makedirs(p), r"cannot read the shard"),
])
def test_corrupt_files(tmp_path, case, build, pattern):
    path = str(tmp_path / "x.safetensors")
    build(path)
    with pytest.raises(CheckpointError, match=pattern) as e:
        SafetensorsFile(path)
    assert path in str(e.value)


def test_every_known_dtype_and_empty_tensors_still_load(tmp_path):
    import ml_dtypes

    t = {"u16": np.arange(3, dtype=np.uint16), "u32": np.arange(3, dtype=np.uint32), "e": np.zeros((0, 4), np.float32),
         "bf": np.ones((2,), ml_dtypes.bfloat16), "e2": np.zeros((3, 0), np.int8)}
    save_safetensors(t, str(tmp_path / "x.safetensors"))
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    for n, a in t.items():
        np.testing.assert_array_equal(np.asarray(f.get(n)), a)
        assert f.get(n).dtype == a.dtype


# ----------------------------------------------------------------------------- checkpoints on disk
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenspeed_jax.models.deepseek.model import DeepseekV3

    model = DeepseekV3.random(DeepseekV3Config.preset("tiny").replace(num_nextn_predict_layers=0), seed=3)
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(model, path, num_shards=2)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _load(path):
    return load_checkpoint(path, dtype=jnp.float32, progress=False)


def test_zero_block_size_is_a_clear_error(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    for bad, shown in (([0, 0], r"\(0, 0\)"), ([128], r"\(128,\)"), ([128, -1], r"\(128, -1\)"), ("x", "'x'"), ([1.5, 128], r"\(1.5, 128\)")):
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": bad}
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=rf"config.json: quantization_config.weight_block_size: expected two positive ints \[out, in\], got {shown}"):
            _load(path)


def test_block_larger_than_the_weight(tiny_dir, tmp_path):
    """A ``weight_block_size`` past a weight's dims is one block (one scale) for it; the FP8 helpers used to
    allocate arrays of the block's size (``[2**40, 2**40]``: numpy "array is too big")."""
    from tokenspeed_jax.models.deepseek.layers import dequantize

    w = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    q, s = quantize_fp8_block(w, (2**40, 2**40))
    q2, s2 = quantize_fp8_block(w, (5, 7))
    np.testing.assert_array_equal(q.view(np.uint8), q2.view(np.uint8))
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(dequantize_fp8_block(q, s, (2**40, 2**40)), dequantize_fp8_block(q, s, (5, 7)))
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(q.T), jnp.asarray(s.T), jnp.float32, (2**40, 2**40))),
                                  dequantize_fp8_block(q, s, (5, 7)).T)
    path = _copy(tiny_dir, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [2**40, 2**40]}
    (path / "config.json").write_text(json.dumps(cfg))
    m = load_checkpoint(path, dtype=jnp.float32, progress=False, fp8_weights=True)  # quantises on load
    assert m.config.fp8_block_size == (2**40, 2**40)


CONFIG_ATTACKS = [
    ("a list", lambda d: [d], r"config.json: expected a JSON object, got list"),
    ("a string", lambda d: "x", r"config.json: expected a JSON object, got str"),
    ("list rope_scaling", lambda d: {**d, "rope_scaling": [1, 2]}, r"rope_scaling: expected an object or null, got \[1, 2\]"),
    ("string rope_scaling", lambda d: {**d, "rope_scaling": "yarn"}, r"rope_scaling: expected an object or null"),
    ("rope_scaling factor a string", lambda d: {**d, "rope_scaling": {"type": "yarn", "factor": "40"}}, r"rope_scaling.factor: expected a finite number, got '40'"),
    ("rope_scaling factor 0", lambda d: {**d, "rope_scaling": {"type": "yarn", "factor": 0}}, r"rope_scaling.factor: expected a positive number, got 0"),
    ("rope_parameters a list", lambda d: {**{k: v for k, v in d.items() if k != "rope_scaling"}, "rope_parameters": [1]}, r"rope_parameters: expected an object or null"),
    ("rms_norm_eps a string", lambda d: {**d, "rms_norm_eps": "x"}, r"rms_norm_eps: expected a number, got 'x'"),
    ("rms_norm_eps negative", lambda d: {**d, "rms_norm_eps": -1e-6}, r"rms_norm_eps: expected a positive number"),
    ("rope_theta NaN", lambda d: {**d, "rope_theta": float("nan")}, r"rope_theta: expected a finite number"),
    ("hidden_size a float", lambda d: {**d, "hidden_size": 64.0}, r"hidden_size: expected an int, got 64.0"),
    ("num_hidden_layers a bool", lambda d: {**d, "num_hidden_layers": True}, r"num_hidden_layers: expected an int, got True"),
    ("q_lora_rank a string", lambda d: {**d, "q_lora_rank": "32"}, r"q_lora_rank: expected an int or null, got '32'"),
    ("norm_topk_prob a string", lambda d: {**d, "norm_topk_prob": "yes"}, r"norm_topk_prob: expected a bool"),
    ("hidden_act a list", lambda d: {**d, "hidden_act": ["silu"]}, r"hidden_act: expected a string"),
    ("quantization_config a list", lambda d: {**d, "quantization_config": [128, 128]}, r"quantization_config: expected an object or null"),
    # values (re-run): these raised ZeroDivisionError / a math domain error building the model, or loaded
    ("n_group 0", lambda d: {**d, "n_group": 0}, r"n_group: expected an int >= 1, got 0"),
    ("rope_theta 1 with YaRN", lambda d: {**d, "rope_theta": 1.0, "rope_scaling": {"type": "yarn", "factor": 8}}, r"rope_theta: expected a number > 1, got 1.0"),
    ("rope_scaling beta_fast negative", lambda d: {**d, "rope_scaling": {"type": "yarn", "factor": 8, "beta_fast": -1}}, r"rope_scaling.beta_fast: expected a non-negative number, got -1"),
    ("rope_scaling mscale_all_dim negative", lambda d: {**d, "rope_scaling": {"type": "yarn", "factor": 8, "mscale_all_dim": -4.8}}, r"rope_scaling.mscale_all_dim: expected a non-negative"),
    ("rope_parameters factor a string", lambda d: {**{k: v for k, v in d.items() if k != "rope_scaling"}, "rope_parameters": {"rope_type": "yarn", "factor": "8"}}, r"rope_parameters.factor: expected a finite number, got '8'"),
    ("rope_parameters type linear", lambda d: {**{k: v for k, v in d.items() if k != "rope_scaling"}, "rope_parameters": {"rope_type": "linear", "factor": 8}}, r"rope_parameters.type: expected 'yarn' or 'default'"),
    ("num_experts_per_tok 0", lambda d: {**d, "num_experts_per_tok": 0}, r"num_experts_per_tok: expected an int >= 1, got 0"),
    ("intermediate_size negative", lambda d: {**d, "intermediate_size": -128}, r"intermediate_size: expected an int >= 1, got -128"),
    ("first_k_dense_replace negative", lambda d: {**d, "first_k_dense_replace": -1}, r"first_k_dense_replace: expected an int >= 0, got -1"),
    ("num_nextn_predict_layers negative", lambda d: {**d, "num_nextn_predict_layers": -1}, r"num_nextn_predict_layers: expected an int >= 0"),
    ("max_position_embeddings 0", lambda d: {**d, "max_position_embeddings": 0}, r"max_position_embeddings: expected an int >= 1"),
    ("q_lora_rank 0", lambda d: {**d, "q_lora_rank": 0}, r"q_lora_rank: expected a positive int or null, got 0"),
    ("attention_bias true (not implemented)", lambda d: {**d, "attention_bias": True}, r"attention_bias: expected false \(not implemented"),
    ("tie_word_embeddings true (not implemented)", lambda d: {**d, "tie_word_embeddings": True}, r"tie_word_embeddings: expected false"),
    ("activation_scheme an int", lambda d: {**d, "quantization_config": {"quant_method": "fp8", "activation_scheme": 5}}, r"quantization_config.activation_scheme: expected a string"),
]


@pytest.mark.parametrize("case,mutate,pattern", CONFIG_ATTACKS, ids=[c[0] for c in CONFIG_ATTACKS])
def test_config_json_types(tmp_path, case, mutate, pattern):
    d = DeepseekV3Config.preset("tiny").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(mutate(d)))
    with pytest.raises(ValueError, match=pattern) as e:
        DeepseekV3Config.from_json(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_null_rope_scaling_next_to_rope_parameters_takes_them():
    """transformers reads ``rope_scaling: null`` as absent and takes ``rope_parameters`` (here YaRN); it used
    to be read as "no scaling", a silently different model."""
    base = DeepseekV3Config.preset("tiny").to_dict()
    yarn = {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0}
    want = DeepseekV3Config.from_dict({**base, "rope_scaling": {"type": "yarn", **yarn}})
    got = DeepseekV3Config.from_dict({**base, "rope_scaling": None, "rope_theta": None,
                                      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}})
    assert got.rope_scaling == want.rope_scaling and got.rope_theta == want.rope_theta
    assert got.softmax_scale == want.softmax_scale != DeepseekV3Config.from_dict({**base, "rope_scaling": None}).softmax_scale
    # a non-null rope_scaling wins over rope_parameters, as in transformers
    both = DeepseekV3Config.from_dict({**base, "rope_scaling": {"type": "yarn", **yarn}, "rope_parameters": {"rope_type": "default"}})
    assert both.rope_scaling == want.rope_scaling


def test_config_json_not_json(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="config.json: .* is not valid JSON"):
        DeepseekV3Config.from_json(tmp_path)


# ------------------------------------------------------------------------------- links and paths
def test_link_policy_inside_directory_loads(tiny_dir, tmp_path):
    """Links that resolve inside the checkpoint directory (e.g. a renamed shard) are followed."""
    path = _copy(tiny_dir, tmp_path / "c")
    shard = "model-00001-of-00002.safetensors"
    os.rename(path / shard, path / "real.bin")
    os.symlink("real.bin", path / shard)
    ref = _load(tiny_dir)
    m = _load(path)
    assert m.config == ref.config


def test_link_outside_directory_is_refused(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path / "c")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = "model-00002-of-00002.safetensors"
    shutil.move(str(path / shard), str(outside / shard))
    os.symlink(outside / shard, path / shard)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path / shard))}: resolves to .*elsewhere.*outside the checkpoint directory"):
        _load(path)
    # the same for config.json and the index
    for name in ("config.json", "model.safetensors.index.json"):
        p2 = _copy(tiny_dir, tmp_path / f"d-{name}")
        shutil.move(str(p2 / name), str(outside / name))
        os.symlink(outside / name, p2 / name)
        with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: resolves to .*outside the checkpoint"):
            _load(p2)


def test_link_chain_escaping_through_an_inside_link_is_refused(tiny_dir, tmp_path):
    """A link to an inside link that points outside resolves outside: refused."""
    path = _copy(tiny_dir, tmp_path / "c")
    outside = tmp_path / "o"
    outside.mkdir()
    shard = "model-00001-of-00002.safetensors"
    shutil.move(str(path / shard), str(outside / shard))
    os.symlink(outside / shard, path / "hop")
    os.symlink("hop", path / shard)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        _load(path)


def test_hugging_face_cache_layout_loads(tiny_dir, tmp_path):
    """``models--ORG--NAME/snapshots/REV/*`` are links to ``../../blobs/SHA``: allowed (same cache repo);
    a link from the snapshot to another repo's blobs is not."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(tiny_dir))):
        shutil.copy(tiny_dir / name, blobs / f"sha{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"sha{i}"), snap / name)
    m = _load(snap)
    assert m.config.num_hidden_layers == 2
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    name = "model-00002-of-00002.safetensors"
    target = os.path.realpath(snap / name)
    shutil.move(target, other / "x")
    os.remove(snap / name)
    os.symlink(other / "x", snap / name)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        _load(snap)


def test_tokenizer_link_follows_the_checkpoint_policy(tiny_dir, tmp_path):
    """``load_tokenizer(dir)`` reads ``tokenizer.json`` under the same link policy as the shards: a link
    resolving outside the checkpoint was followed (and the file parsed)."""
    from tokenspeed_jax.models.deepseek.tokenizer import load_tokenizer

    path = _copy(tiny_dir, tmp_path / "c")
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "a tokenizer"}')
    os.symlink(secret, path / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: resolves to .*secret.json, outside the checkpoint"):
        load_tokenizer(path)
    os.remove(path / "tokenizer.json")
    assert load_tokenizer(path) is None
    shutil.copy(secret, path / "tok.json")
    os.symlink("tok.json", path / "tokenizer.json")  # inside: followed (then refused as a tokenizer)
    with pytest.raises(ValueError, match=r"tokenizer.json: cannot load"):
        load_tokenizer(path)


def test_index_cannot_name_a_path(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path / "c")
    idx = path / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    shutil.copy(path / "model-00001-of-00002.safetensors", tmp_path / "up.safetensors")
    for bad in ("../up.safetensors", str(tmp_path / "up.safetensors"), "./model-00001-of-00002.safetensors"):
        d = json.loads(json.dumps(data))
        d["weight_map"] = {k: (bad if v.startswith("model-00001") else v) for k, v in d["weight_map"].items()}
        idx.write_text(json.dumps(d))
        with pytest.raises(CheckpointError, match=rf"shard {re.escape(repr(bad))} .*does not exist"):
            _load(path)


def test_checkpoint_file_names(tmp_path):
    for bad in ("", ".", "..", "../x", "a/b", "/etc/passwd"):
        with pytest.raises(CheckpointError, match="expected a plain file name"):
            checkpoint_file(str(tmp_path), bad)
    assert checkpoint_file(str(tmp_path), "x") == os.path.join(str(tmp_path), "x")


# --------------------------------------------------------------- 11. no rope_scaling = no scaling
def _rope_as_in_transformers(d):
    """Our cos/sin frequencies, cos/sin factor and softmax scale for config dict ``d`` equal transformers'."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenspeed_jax.models.deepseek.rope import rope_frequencies
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M

    ours = DeepseekV3Config.from_dict(d)
    hf = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    attn = M.DeepseekV3Attention(hf, layer_idx=0)
    rot = M.DeepseekV3RotaryEmbedding(hf)
    inv, factor = rope_frequencies(ours)
    assert ours.softmax_scale == pytest.approx(attn.scaling, rel=1e-6)
    np.testing.assert_allclose(inv, rot.inv_freq.to(torch.float64).numpy(), rtol=1e-6)
    assert factor == pytest.approx(float(rot.attention_scaling), rel=1e-6)
    return ours


def test_missing_rope_scaling_means_no_scaling_as_in_transformers():
    base = DeepseekV3Config.preset("tiny").to_dict()
    with_yarn = {**base, "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                 "max_position_embeddings": 512}
    without = {k: v for k, v in with_yarn.items() if k != "rope_scaling"}
    for d in (without, with_yarn):  # the yarn one is the control: both spellings must agree with transformers
        _rope_as_in_transformers(d)
    assert DeepseekV3Config.from_dict(without).rope_scaling is None
    assert DeepseekV3Config.from_dict(without).softmax_scale == pytest.approx(192**-0.5)


# ------------------------------------------------------------------- token ids and generate's arguments
@pytest.fixture(scope="module")
def tiny_engine():
    from tokenspeed_jax.models.deepseek.engine import Engine
    from tokenspeed_jax.models.deepseek.model import DeepseekV3

    return Engine(DeepseekV3.random(DeepseekV3Config.preset("tiny"), seed=1), backend="xla")


@pytest.mark.parametrize("kwargs,pattern", [
    # ids were int()-converted: 1.7 -> 1, "12" -> 12, True -> 1 loaded silently; 2**64 / inf raised OverflowError
    ({"prompts": [[1.7, 2]]}, r"^prompts\[0\]: expected integer token ids, got 1.7 at index 0"),
    ({"prompts": [[3, "12"]]}, r"^prompts\[0\]: expected integer token ids, got '12' at index 1"),
    ({"prompts": [[5], [True, 3]]}, r"^prompts\[1\]: expected integer token ids, got True"),
    ({"prompts": [np.array([1.0, 2.0])]}, r"^prompts\[0\]: expected integer token ids"),
    ({"prompts": [[2**64]]}, r"^prompts\[0\]: token id 18446744073709551616 at index 0 is outside the vocabulary \[0, 256\)"),
    ({"prompts": [[float("inf")]]}, r"^prompts\[0\]: expected integer token ids, got inf"),
    ({"prompts": [[float("nan")]]}, r"^prompts\[0\]: expected integer token ids, got nan"),
    ({"max_new_tokens": True}, r"^max_new_tokens: expected an int >= 1 or one per prompt, got True"),
    ({"max_new_tokens": 2.5}, r"^max_new_tokens: expected an int >= 1"),
    ({"num_speculative_tokens": 1.9}, r"^num_speculative_tokens: expected an int, got 1.9"),
    ({"num_speculative_tokens": "x"}, r"^num_speculative_tokens: expected an int"),
    ({"eos_token_id": 1.5}, r"^eos_token_id: expected an int, a list of ints or None, got 1.5"),
    ({"eos_token_id": "x"}, r"^eos_token_id: expected an int"),
    ({"eos_token_id": [1.5]}, r"^eos_token_id: expected an int"),
])
def test_generate_refuses_non_integer_ids_and_counts(tiny_engine, kwargs, pattern):
    args = {"prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        tiny_engine.generate(args.pop("prompts"), args.pop("max_new_tokens"), **args)


def test_generate_accepts_numpy_ints(tiny_engine):
    """NumPy / JAX integer arrays and scalars stay valid prompts, counts and EOS ids (only _check runs)."""
    prompts, limits, k, eos = tiny_engine._check([np.array([1, 2], np.int32), jnp.array([3], jnp.int32)],
                                                 np.int64(3), np.int32(0), np.array([1, 2]))
    assert prompts == [[1, 2], [3]] and limits == [3, 3] and k == 0 and eos == [1, 2]


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},  # no mscale keys
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale_all_dim": 0.707},
        {"type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0},  # no original length
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False,
         "mscale": 1.0, "mscale_all_dim": 0.8},
    ],
)
def test_yarn_keys_missing_mean_what_they_mean_in_transformers(rope_scaling):
    """A YaRN ``rope_scaling`` without some keys reads them as transformers does (absent), not as R1's values;
    ``attention_factor`` and ``truncate`` are honoured; config.json written back reads the same."""
    d = {**DeepseekV3Config.preset("tiny").to_dict(), "rope_scaling": rope_scaling, "max_position_embeddings": 512}
    ours = _rope_as_in_transformers(d)
    assert DeepseekV3Config.from_dict(ours.to_dict()) == ours


def test_yarn_without_factor_is_refused():
    d = {**DeepseekV3Config.preset("tiny").to_dict(), "rope_scaling": {"type": "yarn", "mscale": 1.0}}
    with pytest.raises(ValueError, match="rope_scaling.factor: missing"):
        DeepseekV3Config.from_dict(d)
