"""The ``sm90`` backend (Hopper, H100/H200).

Decode runs our CuTe DSL MLA decode kernel (:mod:`tokenspeed_jax.backends.sm90_decode`); prefill runs
FlashAttention-4's CuTe DSL Hopper forward (:mod:`tokenspeed_jax.backends.sm90_prefill`).  Both go through
the FFI layer in :mod:`tokenspeed_jax.ffi`.  Each half answers its own ``supports`` with a precise reason;
a half that is not present in this build says so.
"""

from __future__ import annotations

import importlib


def _half(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


class Sm90Backend:
    name = "sm90"
    priority = 90
    decode_batch_invariant = True  # mla_decode(batch_invariant=True): the batch-invariant schedule
    # the decode kernels clamp every length and block-table entry they read (the schedule kernel's and jnp schedule's
    # ``units``, ``MlaDecodeSm90.piece``, ``KvRefillMixin.coords``): mla_decode passes int32 ones unclamped
    decode_clamps_indices = True

    @staticmethod
    def _decode_mod():
        return _half("tokenspeed_jax.backends.sm90_decode")

    @staticmethod
    def _prefill_mod():
        return _half("tokenspeed_jax.backends.sm90_prefill")

    def supports_decode(self, problem) -> str | None:
        m = self._decode_mod()
        return "sm90 decode is not part of this build" if m is None else m.supports(problem)

    def supports_prefill(self, problem) -> str | None:
        m = self._prefill_mod()
        return "sm90 prefill is not part of this build" if m is None else m.supports(problem)

    def decode(self, problem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale, work=None):
        return self._decode_mod().decode(problem, q, kv_cache, block_table, seq_lens, softmax_scale,
                                         output_scale, work=work)

    def decode_work_key(self, problem):
        return self._decode_mod().work_key(problem)

    def decode_work(self, problem, seq_lens):
        return self._decode_mod().schedule_of(problem, seq_lens)

    def prefill(self, problem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        return self._prefill_mod().prefill(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)


BACKEND = Sm90Backend()
