"""Hopper (SM90) CuTe DSL kernels.  CuTe DSL only: no jax, no torch in this package.

MLA decode (``docs/sm90_decode.md``; the backend ``tokenspeed_jax.backends.sm90_decode`` picks the config):

* :mod:`.decode` -- the one launch entry, ``launch_decode(..., loop=, producer=)``.
* :mod:`.decode_common` -- :class:`MlaDecodeSm90`: configuration, Q load, the walk over the schedule's pieces,
  epilogue; :mod:`.combine` -- the split-KV combine kernel; :mod:`.schedule` -- the schedule kernel.
* :mod:`.seesaw`, :mod:`.transposed`, :mod:`.fp8_transposed_pv`, :mod:`.fp8_transposed` -- the main loops.
* :mod:`.transposed_out`, :mod:`.kv_refill`, :mod:`.fp8_operands`, :mod:`.decode_trace`, :mod:`.helpers` -- shared
  device code of the loops.

* :mod:`.fa4_prefill` -- ragged prefill forward (FlashAttention-4's CuTe DSL kernel, adapted).
"""
