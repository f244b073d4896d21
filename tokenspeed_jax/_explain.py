"""``tokenspeed_jax.explain``: each backend's answer for one call, given the op's own arguments."""

from __future__ import annotations

import inspect
from typing import Any

from tokenspeed_jax import decode as _d
from tokenspeed_jax import prefill as _p
from tokenspeed_jax.backends import backend_reasons

__all__ = ["explain"]


def explain(op: Any, *arrays: Any, **kwargs: Any) -> dict[str, str | None]:
    """Each backend's answer for one call: ``{name: None if it can run the call else the reason}``.

    ``op`` is ``"decode"`` / ``"prefill"`` (or :func:`~tokenspeed_jax.mla_decode` /
    :func:`~tokenspeed_jax.mla_prefill`); ``arrays`` and ``kwargs`` are the op's own arguments (arrays or
    ``jax.ShapeDtypeStruct``), validated as the op validates them.  The dict is ordered by preference, so
    the first ``None`` is the backend ``backend="auto"`` picks for the target traced now.

    >>> tokenspeed_jax.explain("decode", q, kv_cache, block_table, seq_lens, softmax_scale=0.04)
    {'sm100': 'needs a CUDA Blackwell GPU ...', 'sm90': '...', 'xla': None}
    """
    name = getattr(op, "__name__", op)
    if name in ("decode", "mla_decode"):
        fn, op = _d.mla_decode, "decode"
    elif name in ("prefill", "mla_prefill"):
        fn, op = _p.mla_prefill, "prefill"
    else:
        raise ValueError(f"op: expected 'decode', 'prefill', mla_decode or mla_prefill, got {op!r}")
    try:
        bound = inspect.signature(fn).bind(*arrays, **kwargs)
    except TypeError as e:
        raise TypeError(f"explain({op!r}, ...): the arguments do not match mla_{op}: {e}") from None
    bound.apply_defaults()
    a = bound.arguments
    if op == "decode":
        problem = _d._decode_problem(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["causal"],
                                     a["kv_lora_rank"], a["return_lse"])
    else:
        problem = _p._prefill_problem(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                      a["causal"], a["return_lse"], a["max_seqlen_q"], a["max_seqlen_k"])
    return backend_reasons(op, problem)
