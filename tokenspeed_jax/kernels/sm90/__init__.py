"""Hopper (SM90) CuTe DSL kernels.  CuTe DSL only: no jax, no torch in this package.

* :mod:`.mla_decode` -- :class:`MlaDecodeSm90`, absorbed-MLA paged decode (main + split-KV combine).
* :mod:`.helpers` -- shared device helpers of the decode kernel (barrier ids, quad reductions, row pointers).
* :mod:`.fa4_prefill` -- ragged prefill forward (FlashAttention-4's CuTe DSL kernel, adapted).
"""
