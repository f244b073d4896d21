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
* Safetensors headers are untrusted: every entry is checked when a shard is opened
  (:class:`SafetensorsFile`), so a corrupt header is a ``CheckpointError``, never header bytes read as
  weights.
* Symbolic links (:func:`checkpoint_file`): ``config.json``, the index, every shard and ``tokenizer.json``
  (:func:`~tokenspeed_jax.models.deepseek.tokenizer.load_tokenizer`) may be links (Hugging
  Face cache snapshots are made of them: ``models--ORG--NAME/snapshots/REV/x -> ../../blobs/SHA``) as long
  as the file they resolve to lies inside the checkpoint directory (after resolving the directory's own
  links), or, for a directory that is a cache snapshot (``.../models--*/snapshots/REV``), inside that
  ``models--*`` repository folder.  A link anywhere else is refused, and so is a shard name that is not a
  plain file name (``../x``, ``sub/x``): the index cannot make the loader read an arbitrary file.
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
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config, is_int

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
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
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
    """Header-parsed, memory-mapped safetensors file; ``get(name)`` returns a read-only numpy view.

    The header is untrusted input and every entry is checked when the file is opened, so a corrupt or
    hostile file raises :class:`CheckpointError` naming the tensor and the file instead of a KeyError,
    TypeError or numpy error later (or, worse, loading header bytes as weights): the header must be a JSON
    object of at most ``MAX_HEADER_BYTES``; ``__metadata__``, if present, an object; every other entry an
    object with ``dtype`` a known safetensors dtype name, ``shape`` a list of non-negative ints and
    ``data_offsets`` two ints ``0 <= start <= end <= data bytes`` (offsets count from the end of the
    header, so none can point into it) with ``end - start = prod(shape) * itemsize``; no two tensors'
    byte ranges overlap; no key appears twice in any JSON object of the header.  A path that cannot be
    read (a directory, no permission) is a ``CheckpointError`` too."""

    MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit

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
                if n > size - 8 or n > self.MAX_HEADER_BYTES:
                    raise CheckpointError(
                        f"{path}: corrupt safetensors header (length {n} > file size {size} or "
                        f"> {self.MAX_HEADER_BYTES})"
                    )
                header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: shard file not found") from None
        except OSError as e:  # a directory, no permission, an I/O error
            raise CheckpointError(f"{path}: cannot read the shard ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, _DuplicateKey) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(
                f"{path}: corrupt safetensors header, expected a JSON object, got {type(header).__name__}"
            )
        meta = header.pop("__metadata__", None)
        if meta is not None and not isinstance(meta, dict):
            raise CheckpointError(
                f"{path}: corrupt safetensors header, __metadata__ must be an object, "
                f"got {type(meta).__name__}"
            )
        self.header = header
        self.data_start = 8 + n
        self.size = size
        spans = sorted((self._check_entry(name, info), name) for name, info in header.items())
        for ((s0, e0), n0), ((s1, e1), n1) in zip(spans, spans[1:]):
            if s1 < e0 and s1 < e1:  # empty tensors (start == end) overlap nothing
                raise CheckpointError(
                    f"{n1} in {path}: data offsets {s1}..{e1} overlap those of {n0} ({s0}..{e0})"
                )

    def _check_entry(self, name, info) -> tuple[int, int]:
        where = f"{name} in {self.path}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: corrupt header entry, expected an object, got {info!r:.80}")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise CheckpointError(f"{where}: corrupt header entry, no {key!r}")
        dt = info["dtype"]
        if not isinstance(dt, str) or dt not in _DTYPES:
            raise CheckpointError(
                f"{where}: unsupported safetensors dtype {dt!r:.40} (known: {sorted(_DTYPES)})"
            )
        shape, offs = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(
                f"{where}: corrupt shape {shape!r:.80}, expected a list of non-negative ints"
            )
        if not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs):
            raise CheckpointError(f"{where}: corrupt data_offsets {offs!r:.80}, expected [start, end] ints")
        start, end = offs
        nbytes = math.prod(shape) * _DTYPES[dt].itemsize
        avail = self.size - self.data_start
        if not 0 <= start <= end <= avail or end - start != nbytes:
            raise CheckpointError(
                f"{where}: data offsets {start}..{end} do not match shape {tuple(shape)} x {dt} "
                f"({nbytes} bytes) or the file's {avail} data bytes"
            )
        return start, end

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
        info = self.header[name]  # checked in __init__
        dt = _DTYPES[info["dtype"]]
        start, _ = info["data_offsets"]
        shape = tuple(info["shape"])
        if math.prod(shape) == 0:
            return np.zeros(shape, dt)
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + start, shape=shape)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    """``json.loads`` object hook: a key given twice is corrupt (``json`` would keep the last one silently, so
    the first entry would never be checked, and another reader may keep the first)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"key {k!r:.80} appears twice")
        out[k] = v
    return out


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
    bo, bi = min(bo, max(o, 1)), min(bi, max(i, 1))  # a block larger than the weight covers the weight
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return np.asarray(w).astype(np.float32) * s


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's block quantisation: per ``block`` tile ``scale = amax / 448``, ``q = e4m3(w / scale)``;
    returns ``(q [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] float32)``."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    bo, bi = min(block[0], max(o, 1)), min(block[1], max(i, 1))  # a block past the weight: one scale for it
    no, ni = -(-o // bo), -(-i // bi)
    pad = np.zeros((no * bo, ni * bi), np.float32)
    pad[:o, :i] = w
    tiles = pad.reshape(no, bo, ni, bi)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = np.clip(tiles / scale[:, None, :, None], -448, 448).reshape(no * bo, ni * bi)[:o, :i]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


# ----------------------------------------------------------------------------------- name mapping
_STACKS = ("dense_layers", "moe_layers")


def _leaf_name(leaf: str, expert: int | None) -> str:
    """Our leaf -> the published name's tail (``kernel`` -> ``weight``, an expert's ``gate_proj`` ->
    ``{e}.gate_proj.weight``, ``*_scale_inv`` -> ``weight_scale_inv``)."""
    if expert is not None:
        if leaf.endswith("_scale_inv"):
            return f"{expert}.{leaf[: -len('_scale_inv')]}.weight_scale_inv"
        return f"{expert}.{leaf}.weight"
    if leaf in ("kernel", "embedding", "weight"):
        return "weight"
    if leaf == "kernel_scale_inv":
        return "weight_scale_inv"
    return leaf


def _hf_name(
    path: tuple, index: tuple = (), config: DeepseekV3Config | None = None, num_dense: int = 0
) -> str:
    """Published name of element ``index`` (leading stacked axes: layer, then expert) of parameter ``path``.

    ``dense_layers`` element l is ``model.layers.{l}``, ``moe_layers`` element l is
    ``model.layers.{num_dense + l}``, MTP layer j is ``model.layers.{num_hidden_layers + j}``."""
    p = [str(x) for x in path]
    index = list(index)
    if p[0] in _STACKS:
        layer = index.pop(0) + (num_dense if p[0] == "moe_layers" else 0)
        p = ["model", "layers", str(layer)] + p[1:]
    elif p[0] == "mtp":
        p = ["model", "layers", str(config.num_hidden_layers + int(p[1]))] + p[2:]
    elif p[0] in ("embed_tokens", "norm"):
        p = ["model"] + p
    expert = index.pop(0) if index else None
    return ".".join(p[:-1] + [_leaf_name(p[-1], expert)])


def _lead(path: tuple) -> int:
    """Number of leading stacked axes of a parameter (layer axis, expert axis)."""
    return int(path[0] in _STACKS) + int(path[-2:-1] == ("experts",))


def _transposed(path: tuple) -> bool:
    leaf = path[-1]
    return leaf in ("kernel", "kernel_scale_inv") or path[-2:-1] == ("experts",)


def param_names(model_or_state, config: DeepseekV3Config, num_dense: int) -> dict[str, tuple]:
    """``{published name: (param path, leading index, transpose)}`` for every parameter element."""
    out = {}
    for p, v in model_or_state:
        n = _lead(p)
        for idx in np.ndindex(*v.shape[:n]):
            out[_hf_name(p, idx, config, num_dense)] = (p, tuple(int(i) for i in idx), _transposed(p))
    return out


# ------------------------------------------------------------------------------------------ loading
def checkpoint_file(root: str, name: str) -> str:
    """``root/name`` if the link policy (module docstring) allows it, else :class:`CheckpointError`.

    ``name`` must be a plain file name; the file it resolves to (``os.path.realpath``) must lie inside
    ``realpath(root)`` or, when ``root`` is a Hugging Face cache snapshot ``.../models--*/snapshots/REV``
    (checked on the path as given and as resolved), inside that ``models--*`` folder."""
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
        raise CheckpointError(f"{root}: expected a plain file name inside the checkpoint, got {name!r}")
    full = os.path.join(root, name)
    real = os.path.realpath(full)
    allowed = {os.path.realpath(root)}
    for r in (os.path.abspath(root), os.path.realpath(root)):
        snaps, rev = os.path.split(r)
        repo, snap_dir = os.path.split(snaps)
        if rev and snap_dir == "snapshots" and os.path.basename(repo).startswith("models--"):
            allowed.add(os.path.realpath(repo))
    if not any(real == a or real.startswith(a.rstrip(os.sep) + os.sep) for a in allowed):
        raise CheckpointError(
            f"{full}: resolves to {real}, outside the checkpoint directory; refused (links must stay inside "
            f"the checkpoint directory or its Hugging Face cache repository: {sorted(allowed)})"
        )
    return full


def _open_index(path: str) -> dict[str, str]:
    """``{tensor name: shard file}`` from the index, or from a single ``model.safetensors``."""
    idx = os.path.join(path, INDEX_FILE)
    if os.path.isfile(idx):
        checkpoint_file(path, INDEX_FILE)
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
            checkpoint_file(path, shard)
        return wm
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return {k: SINGLE_FILE for k in SafetensorsFile(checkpoint_file(path, SINGLE_FILE))}
    raise CheckpointError(f"{path}: expected {INDEX_FILE} or {SINGLE_FILE}, found neither")


class _Lazy:
    """How to read one parameter (or any slice of it) from the memory-mapped shards: per leading index,
    the tensor name, its file and how to convert it (``raw`` cast, ``dequant`` FP8 -> float, ``quant_w`` /
    ``quant_s`` float -> FP8 kernel / scale).  ``read(slices)`` returns exactly that slice, reading only the
    tensors (and, for row / column slices, only the rows) it covers."""

    def __init__(self, path, shape, dtype, transpose, block):
        self.path, self.shape, self.dtype, self.transpose, self.block = path, shape, dtype, transpose, block
        self.lead = _lead(path)
        self.entries: dict[tuple, tuple] = {}

    def _tensor(self, idx, trailing):
        kind, f, name, sf, sname = self.entries[idx]
        if kind == "raw":
            a = f.get(name)
            a = a.T if self.transpose else a
            return np.asarray(a[trailing]).astype(self.dtype)
        w = f.get(name)
        if kind == "dequant":
            a = dequantize_fp8_block(w, np.asarray(sf.get(sname)), self.block)
            a = a.T if self.transpose else a
            return a[trailing].astype(self.dtype)
        # quant_w / quant_s: quantise the float checkpoint tensor with the kernel's (transposed) blocks
        wt = np.asarray(w, np.float32).T
        q, s = quantize_fp8_block(wt, self.block[::-1])
        return (q if kind == "quant_w" else s)[trailing].astype(self.dtype)

    def read(self, slices) -> np.ndarray:
        slices = tuple(slices) + (slice(None),) * (len(self.shape) - len(tuple(slices)))
        lead, trailing = slices[: self.lead], slices[self.lead :]
        ranges = [range(*s.indices(n)) for s, n in zip(lead, self.shape[: self.lead])]
        out = None
        for idx in np.ndindex(*[len(r) for r in ranges]):
            a = self._tensor(tuple(r[i] for r, i in zip(ranges, idx)), trailing)
            if out is None:
                out = np.empty(tuple(len(r) for r in ranges) + a.shape, a.dtype)
            out[idx] = a
        return out


def load_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    param_dtype=None,
    config: DeepseekV3Config | None = None,
    progress: bool = True,
    fp8_weights: bool | None = None,
    mesh=None,
):
    """Load a Hugging Face DeepSeek-V3/R1 checkpoint directory into a :class:`DeepseekV3` model.

    Args:
      path: directory with ``config.json`` and the safetensors shards.
      dtype: compute dtype of the model (bfloat16 on GPU, float32 for exact CPU tests).
      param_dtype: storage dtype of the non-FP8 weights (default: ``dtype``).
      config: overrides ``config.json``.
      progress: show a tqdm bar over parameters.
      fp8_weights: keep an FP8 block checkpoint's projection weights as e4m3 + ``*_scale_inv`` (the
        default, ``None``, when ``config.json`` has a ``quantization_config``); ``False`` dequantises them
        into ``param_dtype`` on load; ``True`` also block-quantises a float checkpoint.
      mesh: a ``jax.sharding.Mesh`` (axes data / tensor / expert, :mod:`.parallel`): every parameter is
        created with its ``NamedSharding`` and each device's shard is read from the memory-mapped files
        (``jax.make_array_from_callback``), so the full model is never assembled on one device or host
        buffer.  Without a mesh the parameters go to the default device.
    """
    from tokenspeed_jax.models.deepseek.config import QuantizationConfig
    from tokenspeed_jax.models.deepseek.model import DeepseekV3
    from tokenspeed_jax.models.deepseek.parallel import check_mesh, param_sharding

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"path: expected a checkpoint directory, got {path!r}")
    param_dtype = dtype if param_dtype is None else param_dtype
    config = DeepseekV3Config.from_json(checkpoint_file(path, "config.json")) if config is None else config
    if mesh is not None:
        check_mesh(config, mesh)
    weight_map = _open_index(path)
    shards = {s: SafetensorsFile(os.path.join(path, s)) for s in sorted(set(weight_map.values()))}
    for name, shard in weight_map.items():
        if name not in shards[shard].header:
            raise CheckpointError(
                f"{os.path.join(path, INDEX_FILE)}: corrupt index, {name!r} is listed in "
                f"{shard!r} but that shard does not contain it"
            )
    where = {n: s for s, f in shards.items() for n in f}

    L, n_mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    if n_mtp and not any(n.startswith(f"model.layers.{L}.") for n in where):
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
    keep = config.quantization_config is not None if fp8_weights is None else bool(fp8_weights)
    config = config.replace(quantization_config=QuantizationConfig(weight_block_size=block) if keep else None)
    model = nnx.eval_shape(lambda: DeepseekV3(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    names = param_names(variables.items(), config, model.num_dense)
    scale_params = {n for n, t in names.items() if t[0][-1].endswith("_scale_inv")}

    unexpected = [
        n
        for n in sorted(where)
        if n not in names
        and not n.endswith(".weight_scale_inv")
        and not any(r.match(n) for r in ignored)
    ]
    if unexpected:
        raise CheckpointError(
            f"{path}: {len(unexpected)} unexpected tensor(s) for this config, e.g. "
            + ", ".join(f"{n} (in {where[n]})" for n in unexpected[:5])
        )
    lazy = {
        p: _Lazy(p, tuple(v.shape), np.dtype(v.dtype), _transposed(p), block) for p, v in variables.items()
    }
    for n, (p, idx, tr) in names.items():
        if n in scale_params:
            continue
        if n not in where:
            pname = ".".join(map(str, p))
            raise CheckpointError(f"{path}: missing tensor {n} (parameter {pname}{list(idx)})")
        shard = where[n]
        f = shards[shard]
        dt = f.dtype_name(n)
        v = variables[p]
        exp_shape = tuple(v.shape[len(idx) :])
        exp_shape = exp_shape[::-1] if tr else exp_shape
        if f.shape(n) != exp_shape:
            raise CheckpointError(f"{n} in {shard}: expected shape {exp_shape}, got {f.shape(n)}")
        if dt not in _FLOAT_WEIGHT:
            raise CheckpointError(f"{n} in {shard}: expected dtype in {list(_FLOAT_WEIGHT)}, got {dt}")
        sname = n + "_scale_inv"
        is_fp8_param = np.dtype(v.dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
        if dt == "F8_E4M3":
            if sname not in where:
                n_bad = sum(
                    1
                    for m in where
                    if m in names
                    and m + "_scale_inv" not in where
                    and shards[where[m]].dtype_name(m) == "F8_E4M3"
                )
                raise CheckpointError(
                    f"{n} in {shard}: FP8 (F8_E4M3) weight without {sname}; {n_bad} such weight(s)"
                )
            sf = shards[where[sname]]
            if sf.dtype_name(sname) != "F32":
                raise CheckpointError(
                    f"{sname} in {where[sname]}: expected dtype F32, got {sf.dtype_name(sname)}"
                )
            o, i = f.shape(n)
            exp_s = (-(-o // block[0]), -(-i // block[1]))
            if sf.shape(sname) != exp_s:
                raise CheckpointError(
                    f"{sname} in {where[sname]}: expected shape {exp_s} for a {(o, i)} weight with "
                    f"{block[0]}x{block[1]} blocks, got {sf.shape(sname)}"
                )
            kind = "raw" if is_fp8_param else "dequant"
        else:
            sf = None
            kind = "quant_w" if is_fp8_param else "raw"
        lazy[p].entries[idx] = (kind, f, n, sf, sname)
        if is_fp8_param:
            sp = p[:-1] + (p[-1] + "_scale_inv",)
            lazy[sp].entries[idx] = ("raw" if kind == "raw" else "quant_s",) + (
                (sf, sname, None, None) if kind == "raw" else (f, n, None, None)
            )
    for n in where:
        if n.endswith(".weight_scale_inv") and n[: -len("_scale_inv")] not in where:
            raise CheckpointError(
                f"{n} in {where[n]}: unexpected scale, checkpoint has no tensor {n[: -len('_scale_inv')]}"
            )

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    items = list(variables.items())
    it = tqdm(items, desc="loading parameters", unit="param", disable=not progress) if tqdm else items
    for p, v in it:
        sharding = param_sharding(p, tuple(v.shape), mesh)
        src = lazy[p]
        v.set_value(jax.make_array_from_callback(tuple(v.shape), sharding, lambda s, src=src: src.read(s)))
    model.mesh = mesh
    return model


# ------------------------------------------------------------------------------------------ writing
def _save_dtype(dtype) -> np.dtype:
    """``save_checkpoint``'s ``dtype``: a float dtype the loader reads back (FP8 goes through ``fp8=True``,
    which writes the block scales with it)."""
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        dt = None
    if dt is None or dt.name not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            "dtype: expected float32, bfloat16 or float16 (fp8=True writes DeepSeek's e4m3 blocks with their "
            f"scales), got {dtype!r}"
        )
    return dt


def model_to_hf_tensors(model, *, fp8: bool = False, dtype=None) -> dict[str, np.ndarray]:
    """Our parameters as a ``{published name: array (or e4m3 + scale)}`` dict.

    Arrays keep each parameter's own dtype (a bf16 model writes BF16, the float32 router stays F32, an FP8
    model writes its e4m3 weights and scales as they are) unless ``dtype`` is given, which converts every
    floating tensor that is not FP8 to it.  With ``fp8`` every linear weight except embeddings, heads and
    the router is block-quantised as DeepSeek ships them (``F8_E4M3`` + ``weight_scale_inv``)."""
    if dtype is not None:
        dtype = _save_dtype(dtype)
    config = model.config
    out: dict[str, np.ndarray] = {}
    block = config.fp8_block_size or (128, 128)
    state = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    for p, v in state:
        a = np.asarray(jax.device_get(v.get_value()))
        n_lead = _lead(p)
        tr = _transposed(p)
        for idx in np.ndindex(*a.shape[:n_lead]):
            n = _hf_name(p, idx, config, model.num_dense)
            arr = a[idx].T if tr else a[idx]
            if np.dtype(arr.dtype) == e4m3 or p[-1].endswith("_scale_inv"):
                out[n] = np.ascontiguousarray(arr)
                continue
            tdt = np.dtype(arr.dtype) if dtype is None else np.dtype(dtype)
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
    (float32, bfloat16 or float16; anything else raises ``ValueError`` before writing); ``fp8=True`` writes
    DeepSeek's e4m3 + 128x128 ``weight_scale_inv`` format."""
    from tokenspeed_jax.models.deepseek.config import QuantizationConfig

    path = os.fspath(path)
    if dtype is not None:
        _save_dtype(dtype)  # refuse before creating the directory
    os.makedirs(path, exist_ok=True)
    tensors = model_to_hf_tensors(model, fp8=fp8, dtype=dtype)
    quantized = fp8 or model.config.quantization_config is not None
    config = model.config.replace(
        quantization_config=(model.config.quantization_config or QuantizationConfig()) if quantized else None
    )
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
