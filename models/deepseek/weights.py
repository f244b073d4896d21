"""Hugging Face DeepSeek-V3/R1 checkpoint loading (and writing, for tests and demos).

``load_checkpoint(path, *, dtype)`` reads ``config.json`` and the safetensors shards listed by
``model.safetensors.index.json`` (or a single ``model.safetensors``) with the published parameter names
(``model.layers.{i}.self_attn.q_a_proj.weight``, ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``,
MTP layer ``model.layers.{num_hidden_layers}.eh_proj.weight``, ...).

Decisions (written down here once):

* Safetensors files are parsed directly (8-byte header length, JSON header, raw little-endian data) and
  memory-mapped with ``ml_dtypes`` dtypes, so bf16 and float8_e4m3fn tensors load without torch and
  without reading a whole shard into memory.  Shards are processed one at a time (tqdm progress bar);
  each tensor is converted to the parameter dtype and placed into the model as it is read.
* FP8 weights (``F8_E4M3`` with a sibling ``weight_scale_inv``, float32 ``[ceil(out/128), ceil(in/128)]``)
  are dequantised on load: ``w = e4m3 * scale_inv`` per 128x128 block (the block size comes from
  ``quantization_config.weight_block_size``).  An FP8 weight whose scale is in a later shard waits
  (memory-mapped) for it.
* Every problem raises :class:`CheckpointError` (a ``ValueError``) naming the tensor and the file:
  missing or unexpected tensors, wrong shapes (expected vs given), unsupported dtypes, FP8 weights
  without scales, and a corrupt or inconsistent index.
* Ignored names: ``*.rotary_emb.inv_freq`` and the MTP layers' ``embed_tokens.weight`` (a copy of the main
  embedding).  A checkpoint without any MTP tensor (e.g. one written by transformers, which drops MTP)
  loads with ``num_nextn_predict_layers = 0`` and a warning; a partial MTP layer is an error.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_FLOAT_WEIGHT = ("F32", "BF16", "F16", "F8_E4M3")
_IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq$"),)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model (message names the tensor, file, expected, given)."""


# ----------------------------------------------------------------------------------- safetensors I/O
class SafetensorsFile:
    """Header-parsed, memory-mapped safetensors file; ``get(name)`` returns a read-only numpy view."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(
                        f"{path}: not a safetensors file (shorter than its 8-byte header length)"
                    )
                (n,) = struct.unpack("<Q", raw)
                size = os.fstat(f.fileno()).st_size
                if n > size - 8:
                    raise CheckpointError(
                        f"{path}: corrupt safetensors header (length {n} > file size {size})"
                    )
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: shard file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + n
        self.size = size

    def keys(self):
        return self.header.keys()

    def __iter__(self):
        return iter(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise CheckpointError(f"{name} in {self.path}: unsupported safetensors dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - start != math.prod(shape) * dt.itemsize or self.data_start + end > self.size:
            raise CheckpointError(
                f"{name} in {self.path}: data offsets {start}..{end} do not match shape "
                f"{shape} x {info['dtype']} or the file size"
            )
        if math.prod(shape) == 0:
            return np.zeros(shape, dt)
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + start, shape=shape)


def save_safetensors(
    tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None
) -> None:
    """Write numpy arrays (any dtype in the table above, incl. ml_dtypes bf16 / e4m3) as safetensors."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [off, off + a.nbytes],
        }
        off += a.nbytes
        arrays.append(a)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for a in arrays:
            f.write(a.tobytes())


# --------------------------------------------------------------------------------------- FP8 blocks
def dequantize_fp8_block(
    w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)
) -> np.ndarray:
    """``w [out, in]`` e4m3 times ``scale_inv [ceil(out/bo), ceil(in/bi)]`` per block -> float32."""
    bo, bi = block
    o, i = w.shape
    exp = (-(-o // bo), -(-i // bi))
    if tuple(scale_inv.shape) != exp:
        raise CheckpointError(
            f"weight_scale_inv: expected shape {exp} for a {w.shape} weight with "
            f"{bo}x{bi} blocks, got {tuple(scale_inv.shape)}"
        )
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return np.asarray(w).astype(np.float32) * s


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's block quantisation: per ``block`` tile ``scale = amax / 448``, ``q = e4m3(w / scale)``;
    returns ``(q [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] float32)``."""
    bo, bi = block
    w = np.asarray(w, np.float32)
    o, i = w.shape
    no, ni = -(-o // bo), -(-i // bi)
    pad = np.zeros((no * bo, ni * bi), np.float32)
    pad[:o, :i] = w
    tiles = pad.reshape(no, bo, ni, bi)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = np.clip(tiles / scale[:, None, :, None], -448, 448).reshape(no * bo, ni * bi)[:o, :i]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


# ----------------------------------------------------------------------------------- name mapping
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _target(name: str, config: DeepseekV3Config, params: dict):
    """HF name -> ``(param path, expert index or None, transpose)`` or None if the name is unknown."""
    if name == "model.embed_tokens.weight":
        base, rest = (), "embed_tokens.weight"
    elif name == "model.norm.weight":
        base, rest = (), "norm.weight"
    elif name == "lm_head.weight":
        base, rest = (), "lm_head.weight"
    else:
        m = _LAYER.match(name)
        if not m:
            return None
        i, rest = int(m.group(1)), m.group(2)
        L = config.num_hidden_layers
        base = ("layers", i) if i < L else ("mtp", i - L)
        e = _EXPERT.match(rest)
        if e:
            path = base + ("mlp", "experts", e.group(2))
            return (path, int(e.group(1)), True) if path in params else None
    parts = tuple(rest.split("."))
    stem, leaf = parts[:-1], parts[-1]
    if leaf == "weight":
        for cand, tr in (
            (base + stem + ("kernel",), True),
            (base + stem + ("weight",), False),
            (base + stem + ("embedding",), False),
        ):
            if cand in params:
                return cand, None, tr
        return None
    cand = base + parts
    return (cand, None, False) if cand in params else None


def _expected_shape(path, expert, transpose, params) -> tuple[int, ...]:
    shape = tuple(params[path].shape)
    if expert is not None:
        shape = shape[1:]
    return shape[::-1] if transpose else shape


# ------------------------------------------------------------------------------------------ loading
def _open_index(path: str) -> dict[str, str]:
    """``{tensor name: shard file}`` from the index, or from a single ``model.safetensors``."""
    idx = os.path.join(path, INDEX_FILE)
    if os.path.isfile(idx):
        try:
            with open(idx) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{idx}: corrupt index, not valid JSON ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(
                f"{idx}: corrupt index, expected a 'weight_map' object mapping tensor names to shard files"
            )
        for shard in sorted(set(wm.values())):
            if os.path.basename(shard) != shard or not os.path.isfile(os.path.join(path, shard)):
                raise CheckpointError(
                    f"{idx}: corrupt index, shard {shard!r} (listed for "
                    f"{next(k for k, v in wm.items() if v == shard)!r}) does not exist in {path}"
                )
        return wm
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return {k: SINGLE_FILE for k in SafetensorsFile(single)}
    raise CheckpointError(f"{path}: expected {INDEX_FILE} or {SINGLE_FILE}, found neither")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    param_dtype=None,
    config: DeepseekV3Config | None = None,
    progress: bool = True,
):
    """Load a Hugging Face DeepSeek-V3/R1 checkpoint directory into a :class:`DeepseekV3` model.

    Args:
      path: directory with ``config.json`` and the safetensors shards.
      dtype: compute dtype of the model (bfloat16 on GPU, float32 for exact CPU tests).
      param_dtype: storage dtype of the weights (default: ``dtype``); FP8 weights are dequantised into it.
      config: overrides ``config.json``.
      progress: show a tqdm bar over shards.
    """
    from tokenspeed_jax.models.deepseek.model import DeepseekV3

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"path: expected a checkpoint directory, got {path!r}")
    param_dtype = dtype if param_dtype is None else param_dtype
    config = DeepseekV3Config.from_json(path) if config is None else config
    weight_map = _open_index(path)
    shards = {s: SafetensorsFile(os.path.join(path, s)) for s in sorted(set(weight_map.values()))}
    for name, shard in weight_map.items():
        if name not in shards[shard].header:
            raise CheckpointError(
                f"{os.path.join(path, INDEX_FILE)}: corrupt index, {name!r} is listed in "
                f"{shard!r} but that shard does not contain it"
            )
    names = {n for s, f in shards.items() for n in f}

    L, n_mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    if n_mtp and not any(n.startswith(f"model.layers.{L}.") for n in names):
        warnings.warn(
            f"{path}: no MTP tensors (model.layers.{L}.*); loading without the MTP layer "
            f"(num_nextn_predict_layers = 0)",
            stacklevel=2,
        )
        config = config.replace(num_nextn_predict_layers=0)
        n_mtp = 0
    ignored = [re.compile(rf"^model\.layers\.{L + j}\.embed_tokens\.weight$") for j in range(n_mtp)]
    ignored += list(_IGNORED)

    block = config.fp8_block_size or (128, 128)
    # Weights are dequantised on load, so the model itself is not quantised (and shares compiled code with
    # an unquantised model of the same shape).
    config = config.replace(quantization_config=None)
    model = nnx.eval_shape(lambda: DeepseekV3(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    variables = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    filled: dict[tuple, np.ndarray] = {}
    experts_seen: dict[tuple, set[int]] = {}

    targets = {}
    unexpected = []
    for n in sorted(names):
        if n.endswith(".weight_scale_inv") or any(r.match(n) for r in ignored):
            continue
        t = _target(n, config, variables)
        if t is None:
            unexpected.append(n)
        else:
            targets[n] = t
    if unexpected:
        where = {n: next(s for s, f in shards.items() if n in f.header) for n in unexpected[:5]}
        raise CheckpointError(
            f"{path}: {len(unexpected)} unexpected tensor(s) for this config, e.g. "
            + ", ".join(f"{n} (in {s})" for n, s in where.items())
        )
    for p, v in variables.items():
        is_expert = p[-2:-1] == ("experts",)
        if not is_expert and not any(t[0] == p for t in targets.values()):
            raise CheckpointError(
                f"{path}: missing tensor for parameter {'.'.join(map(str, p))} "
                f"(expected checkpoint tensor {_hf_name(p, None, L)})"
            )

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    order = list(shards.items())
    it = tqdm(order, desc="loading shards", unit="shard", disable=not progress) if tqdm else order
    pending: dict[str, tuple[np.ndarray, str]] = {}  # fp8 weights waiting for their scale
    scales: dict[str, np.ndarray] = {}
    for shard, f in it:
        for n in f:
            if n.endswith(".weight_scale_inv"):
                if f.dtype_name(n) != "F32":
                    raise CheckpointError(f"{n} in {shard}: expected dtype F32, got {f.dtype_name(n)}")
                wname = n[: -len("_scale_inv")]
                if wname not in names:
                    raise CheckpointError(
                        f"{n} in {shard}: unexpected scale, checkpoint has no tensor {wname}"
                    )
                scales[wname] = np.array(f.get(n))
                if wname in pending:
                    w, s0 = pending.pop(wname)
                    _place(
                        wname,
                        dequantize_fp8_block(w, scales.pop(wname), block),
                        s0,
                        targets,
                        variables,
                        filled,
                        experts_seen,
                        param_dtype,
                    )
                continue
            if n not in targets:
                continue
            dt = f.dtype_name(n)
            path_, expert, tr = targets[n]
            exp_shape = _expected_shape(path_, expert, tr, variables)
            if f.shape(n) != exp_shape:
                raise CheckpointError(f"{n} in {shard}: expected shape {exp_shape}, got {f.shape(n)}")
            want = _FLOAT_WEIGHT
            if dt not in want:
                raise CheckpointError(f"{n} in {shard}: expected dtype in {list(want)}, got {dt}")
            arr = f.get(n)
            if dt == "F8_E4M3":
                if n in scales:
                    arr = dequantize_fp8_block(arr, scales.pop(n), block)
                else:
                    pending[n] = (arr, shard)
                    continue
            _place(n, arr, shard, targets, variables, filled, experts_seen, param_dtype)
    if pending:
        n, (_, s) = next(iter(pending.items()))
        raise CheckpointError(
            f"{n} in {s}: FP8 (F8_E4M3) weight without {n}_scale_inv; {len(pending)} such weight(s)"
        )
    for p, seen in experts_seen.items():
        E = variables[p].shape[0]
        if len(seen) != E:
            e = min(set(range(E)) - seen)
            raise CheckpointError(f"{path}: missing tensor {_hf_name(p, e, L)}")
    for p in variables:
        if p[-2:-1] == ("experts",) and p not in experts_seen:
            raise CheckpointError(f"{path}: missing tensor {_hf_name(p, 0, L)}")

    for p, v in variables.items():
        v.set_value(jnp.asarray(filled.pop(p)))
    return model


def _place(name, arr, shard, targets, variables, filled, experts_seen, param_dtype):
    path_, expert, tr = targets[name]
    var = variables[path_]
    a = np.asarray(arr)
    if np.dtype(a.dtype) != np.float32 and np.dtype(param_dtype) == np.float32:
        a = a.astype(np.float32)
    a = a.T if tr else a
    tdt = np.dtype(var.dtype)
    if expert is None:
        filled[path_] = np.ascontiguousarray(a.astype(tdt))
    else:
        if path_ not in filled:
            filled[path_] = np.empty(var.shape, tdt)
            experts_seen[path_] = set()
        filled[path_][expert] = a.astype(tdt)
        experts_seen[path_].add(expert)


def _hf_name(path: tuple, expert: int | None = None, num_layers: int = 0) -> str:
    """Published name of our parameter ``path`` (MTP layer j is ``model.layers.{num_layers + j}``)."""
    p = list(map(str, path))
    if p[0] in ("layers", "mtp"):
        idx = int(p[1]) + (0 if p[0] == "layers" else num_layers)
        p = ["model", "layers", str(idx)] + p[2:]
    elif p[0] in ("embed_tokens", "norm"):
        p = ["model"] + p
    if expert is not None:
        p = p[:-1] + [str(expert), p[-1]]
    if p[-1] in ("kernel", "embedding"):
        p[-1] = "weight"
    elif p[-1] != "weight" and p[-1] != "e_score_correction_bias":
        p.append("weight")
    return ".".join(p)


# ------------------------------------------------------------------------------------------ writing
def model_to_hf_tensors(model, *, fp8: bool = False, dtype=None) -> dict[str, np.ndarray]:
    """Our parameters as a ``{published name: array (or e4m3 + scale)}`` dict.

    Arrays keep each parameter's own dtype (a bf16 model writes BF16, the float32 router stays F32) unless
    ``dtype`` is given, which converts every floating tensor that is not FP8-quantised to it.  With ``fp8``
    every linear weight except embeddings, heads and the router is block-quantised as DeepSeek ships them
    (``F8_E4M3`` + ``weight_scale_inv``)."""
    config = model.config
    out: dict[str, np.ndarray] = {}
    L = config.num_hidden_layers
    block = config.fp8_block_size or (128, 128)
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = np.asarray(jax.device_get(v.get_value()))
        tdt = np.dtype(a.dtype) if dtype is None else np.dtype(dtype)
        tr = p[-1] == "kernel" or p[-2:-1] == ("experts",)
        names_arrays = []
        if p[-2:-1] == ("experts",):
            for e in range(a.shape[0]):
                names_arrays.append((_hf_name(p, e, L), a[e].T))
        else:
            names_arrays.append((_hf_name(p, None, L), a.T if tr else a))
        for n, arr in names_arrays:
            quant = (
                fp8
                and arr.ndim == 2
                and "embed_tokens" not in n
                and not n.startswith("lm_head")
                and ".shared_head.head." not in n
                and not n.endswith("mlp.gate.weight")
            )
            if quant:
                q, s = quantize_fp8_block(arr, block)
                out[n], out[n + "_scale_inv"] = q, s
            else:
                out[n] = np.ascontiguousarray(arr.astype(tdt))
    return out


def save_checkpoint(
    model, path: str | os.PathLike, *, fp8: bool = False, dtype=None, num_shards: int = 2
) -> None:
    """Write ``config.json``, sharded safetensors and ``model.safetensors.index.json`` (published names).

    Tensors keep the model's parameter dtypes (bf16 stays bf16) unless ``dtype`` names another one
    (e.g. ``jnp.float32``); ``fp8=True`` writes DeepSeek's e4m3 + 128x128 ``weight_scale_inv`` format."""
    from tokenspeed_jax.models.deepseek.config import QuantizationConfig

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = model_to_hf_tensors(model, fp8=fp8, dtype=dtype)
    config = model.config.replace(quantization_config=QuantizationConfig() if fp8 else None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    write_sharded(tensors, path, num_shards=num_shards)


def write_sharded(tensors: dict[str, np.ndarray], path: str, *, num_shards: int = 2) -> None:
    """Split ``tensors`` over ``num_shards`` files (by sorted name) and write the index."""
    names = sorted(tensors)
    per = -(-len(names) // num_shards)
    weight_map = {}
    for k in range(num_shards):
        chunk = names[k * per : (k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_safetensors({n: tensors[n] for n in chunk}, os.path.join(path, fname))
        weight_map.update({n: fname for n in chunk})
    total = sum(int(t.nbytes) for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
