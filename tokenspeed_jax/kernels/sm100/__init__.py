"""Blackwell (SM100/SM103) kernels: launch wrappers around the TokenSpeed MLA kernel classes.

* :mod:`.plan` -- pure-Python planning (tile, fold/pack, split-KV count, workspace); no CuTe DSL.
* :mod:`.runtime_scalars` -- device-resident scales for the TokenSpeed classes.
* :mod:`.decode` -- ``launch_decode`` (BF16/FP16 and FP8 decode classes + split-KV reduction).
* :mod:`.prefill` -- ``launch_prefill`` (the FMHA forward class, ragged varlen).

The kernel classes themselves come from the ``tokenspeed-mla`` package (``pip install
'tokenspeed-jax[sm100]'``); nothing of their source is copied here.  This package imports nothing
heavy: import the submodules you need (all but :mod:`.plan` import CuTe DSL and tokenspeed_mla).
"""
