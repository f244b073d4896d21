"""tokenspeed-jax: DeepSeek-style multi-head latent attention (MLA) for JAX.

Public ops (all plain functions, usable inside and outside ``jax.jit``; static configuration is
keyword-only):

* :func:`mla_decode` -- absorbed MLA decode / MTP (speculative) decode over a paged latent cache.
* :func:`mla_decode_work` -- the per-step work of ``mla_decode`` (the sm90 split-KV schedule), computed once
  per decode step and passed to every layer as ``mla_decode(..., work=)`` (a :class:`DecodeWork` pytree).
* :func:`mla_prefill` -- ragged varlen prefill attention (non-absorbed, e.g. 192/128).
* :func:`merge_attn_states` -- exact merge of two partial attentions (chunked context prefill).
* :func:`concat_and_cache_mla` -- write ``[kv_c | k_pe]`` rows into the paged latent cache.
* :func:`mla_kv_pack_quantize_fp8` -- pack and quantize prefill K/V to float8_e4m3fn.
* :func:`plan_mla_decode` -- the pure-Python planner of the decode kernels.
* :func:`explain` -- each backend's reason for one call, given the op's own arguments.
* :func:`export_for_gpu` -- ``jax.export`` for a CUDA GPU from any host (a CPU is enough).
* :func:`target_override` -- trace as if for a GPU architecture (``TOKENSPEED_JAX_TARGET`` does the same).

Backends are chosen per call (``backend="auto"`` or a name); see :mod:`tokenspeed_jax.backends`.
"""

from __future__ import annotations

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys


class _CheckoutSubpackages(_abc.MetaPathFinder):
    """Source-checkout layout: ``ffi/`` and ``models/`` sit beside this package at the top of the tree and
    pyproject maps them to ``tokenspeed_jax.ffi`` / ``tokenspeed_jax.models`` on install (an editable
    install maps them too).  When this package is imported from a checkout (PYTHONPATH, as on the GPU
    machine), this finder maps exactly those two names to the checkout's folders, ahead of any installed
    mapping, so a checkout never mixes with another tree's ``ffi``.  Nothing else of the checkout (tests,
    benchmarks, scripts) becomes part of the package; an installed wheel contains the subpackages itself
    and installs no finder."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, sub = fullname.partition(".")
        if prefix != __name__ or sub not in ("ffi", "models"):
            return None
        folder = _os.path.join(self.root, sub)
        return _util.spec_from_file_location(fullname, _os.path.join(folder, "__init__.py"),
                                             submodule_search_locations=[folder])


_pkg_dir = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_pkg_dir)
if not _os.path.isdir(_os.path.join(_pkg_dir, "ffi")) and _os.path.isfile(
    _os.path.join(_root, "ffi", "__init__.py")
) and not any(isinstance(f, _CheckoutSubpackages) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _CheckoutSubpackages(_root))

from tokenspeed_jax.cache import concat_and_cache_mla, mla_kv_pack_quantize_fp8  # noqa: E402
from tokenspeed_jax.decode import DecodeWork, mla_decode, mla_decode_work  # noqa: E402
from tokenspeed_jax.merge import merge_attn_states  # noqa: E402
from tokenspeed_jax.planner import DecodePlan, plan_mla_decode  # noqa: E402
from tokenspeed_jax.prefill import mla_prefill  # noqa: E402
from tokenspeed_jax.backends import available_backends, backend_reasons, get_backend  # noqa: E402
from tokenspeed_jax._explain import explain  # noqa: E402
from tokenspeed_jax.gpu_export import export_for_gpu  # noqa: E402
from tokenspeed_jax.runtime import current_target, target_override  # noqa: E402

from tokenspeed_jax._version import __version__  # noqa: E402

__all__ = [
    "DecodePlan",
    "DecodeWork",
    "__version__",
    "available_backends",
    "backend_reasons",
    "concat_and_cache_mla",
    "current_target",
    "explain",
    "export_for_gpu",
    "get_backend",
    "merge_attn_states",
    "mla_decode",
    "mla_decode_work",
    "mla_kv_pack_quantize_fp8",
    "mla_prefill",
    "plan_mla_decode",
    "target_override",
]
