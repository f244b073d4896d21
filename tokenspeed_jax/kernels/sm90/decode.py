"""Launch entry of the Hopper MLA decode: ``launch_decode(..., loop=, producer=)`` runs the main loop of a
:class:`tokenspeed_jax.backends.sm90_decode.Sm90DecodeConfig` on its persistent grid, then the split-KV combine.  Loops:

* ``"seesaw"`` (:mod:`.seesaw`): two warpgroups own alternate 64-token tiles of 64 query rows and work out of phase;
  16-bit, or FP8 with 16-token pages (QK and P V on FP8 tensor cores, V^T built in a packed slot); ``producer``: a
  third warpgroup issues the TMA refills (pages >= 32).
* ``"transposed"`` (:mod:`.transposed`): 16-bit, S x H <= 32 query rows: S^T = K Q^T and O^T = V^T P^T on the real
  rows as the N dimension, the seesaw's refills, always with the producer warpgroup.
* ``"fp8_transposed_pv"`` (:mod:`.fp8_transposed_pv`): FP8, S x H > 32, pages >= 32: 64-row blocks, O^T = V^T P^T with
  V^T a register operand loaded straight from the e4m3 staging.
* ``"fp8_transposed"`` (:mod:`.fp8_transposed`): FP8, S x H <= 32, pages >= 32: both matmuls transposed, each
  warpgroup its own KV tiles over all 512 features, merged in the epilogue."""

import cutlass
import cutlass.cute as cute

from tokenspeed_jax.kernels.sm90.fp8_transposed import MlaDecodeFp8TransposedSm90
from tokenspeed_jax.kernels.sm90.fp8_transposed_pv import MlaDecodeFp8TransposedPvSm90
from tokenspeed_jax.kernels.sm90.seesaw import MlaDecodeSeesawSm90
from tokenspeed_jax.kernels.sm90.transposed import MlaDecodeTransposedSm90

LOOPS = ("seesaw", "transposed", "fp8_transposed_pv", "fp8_transposed")


def build_decode_kernel(*, loop: str, producer: bool, dtype: str, num_heads: int, q_len: int, page_size: int,
                        causal: bool, num_ctas: int, max_slots: int, trace: int = 0, chunk: int = 0,
                        prefetch: bool = False, piece_trace: int = 0):
    """The kernel object of ``loop`` for one problem class (the backend's config, resolved); other arguments as in
    ``decode_common.MlaDecodeSm90``.  ``trace``: not the transposed 16-bit loop; ``prefetch``: loops with the producer
    warpgroup whose epilogue leaves the KV buffers alone (not ``fp8_transposed``: it swaps O^T halves through them);
    ``piece_trace``: any loop, with or without ``prefetch``, the length-balanced schedule."""
    kw = dict(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
              num_ctas=num_ctas, max_slots=max_slots, chunk=chunk, prefetch=prefetch, piece_trace=piece_trace)
    if prefetch and (not producer or loop == "fp8_transposed" or trace):
        raise ValueError(f"prefetch: loops with the producer warpgroup other than fp8_transposed, and no trace "
                         f"build, got loop {loop!r}, producer {producer}, trace {trace}")
    if loop == "seesaw":
        return MlaDecodeSeesawSm90(producer=producer, trace=trace, **kw)
    if not producer:
        raise ValueError(f"loop {loop!r} runs with the producer warpgroup only")
    if loop == "transposed":
        if trace:
            raise ValueError("trace: the transposed 16-bit loop has no debug build")
        return MlaDecodeTransposedSm90(**kw)
    if loop == "fp8_transposed_pv":
        return MlaDecodeFp8TransposedPvSm90(trace=trace, **kw)
    if loop == "fp8_transposed":
        return MlaDecodeFp8TransposedSm90(trace=trace, **kw)
    raise ValueError(f"loop: expected one of {LOOPS}, got {loop!r}")


@cute.jit
def launch_decode(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                  softmax_scale: cute.Tensor, output_scale: cute.Tensor, sched_cta: cute.Tensor, sched_req: cute.Tensor,
                  out: cute.Tensor, lse: cute.Tensor, o_accum: cute.Tensor, lse_accum: cute.Tensor, *,
                  loop: cutlass.Constexpr, producer: cutlass.Constexpr, dtype: cutlass.Constexpr,
                  num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr, page_size: cutlass.Constexpr,
                  causal: cutlass.Constexpr, num_ctas: cutlass.Constexpr, max_slots: cutlass.Constexpr,
                  chunk: cutlass.Constexpr = 0, prefetch: cutlass.Constexpr = False):
    """FFI launch function of the sm90 decode (ABI: ``tokenspeed_jax.backends.sm90_decode.decode``): q, cache, block
    table, lengths, the (1,)-shaped scales, the schedule's ``cta [num_ctas, 8]`` and ``req [B, 2]``
    (``tokenspeed_jax.decode_schedule``), then the outputs out, lse and the fp32 partials ``o_accum [slots, rows, 512]``
    and ``lse_accum [slots, rows]`` (``max_slots`` slots; ``chunk`` > 0: ``B * ceil(capacity / chunk)``)."""
    build_decode_kernel(loop=loop, producer=producer, dtype=dtype, num_heads=num_heads, q_len=q_len,
                        page_size=page_size, causal=causal, num_ctas=num_ctas, max_slots=max_slots, chunk=chunk,
                        prefetch=prefetch)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, sched_cta, sched_req, out, lse, o_accum,
        lse_accum)


@cute.jit
def launch_decode_traced(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                         softmax_scale: cute.Tensor, output_scale: cute.Tensor, sched_cta: cute.Tensor,
                         sched_req: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, trace_buf: cute.Tensor,
                         o_accum: cute.Tensor, lse_accum: cute.Tensor, *,
                         loop: cutlass.Constexpr, producer: cutlass.Constexpr, dtype: cutlass.Constexpr,
                         num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr, page_size: cutlass.Constexpr,
                         causal: cutlass.Constexpr, num_ctas: cutlass.Constexpr, max_slots: cutlass.Constexpr,
                         trace: cutlass.Constexpr, chunk: cutlass.Constexpr = 0):
    """Debug build of :func:`launch_decode` with ``clock64`` marks (:class:`~.decode_trace.DecodeTraceMixin`) in
    ``trace_buf`` (int64 ``(ctas, 2, trace, len(TRACE_EVENTS))``, the first ``ctas`` CTAs in ``(g, row block)``
    order), an extra output after ``lse`` (benchmarks/trace_decode.py)."""
    build_decode_kernel(loop=loop, producer=producer, dtype=dtype, num_heads=num_heads, q_len=q_len,
                        page_size=page_size, causal=causal, num_ctas=num_ctas, max_slots=max_slots, trace=trace,
                        chunk=chunk)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, sched_cta, sched_req, out, lse, o_accum,
        lse_accum, trace_buf)


@cute.jit
def launch_decode_piece_traced(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor,
                               seq_lens: cute.Tensor, softmax_scale: cute.Tensor, output_scale: cute.Tensor,
                               sched_cta: cute.Tensor, sched_req: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                               trace_buf: cute.Tensor, o_accum: cute.Tensor, lse_accum: cute.Tensor, *,
                               loop: cutlass.Constexpr, producer: cutlass.Constexpr, dtype: cutlass.Constexpr,
                               num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr, page_size: cutlass.Constexpr,
                               causal: cutlass.Constexpr, num_ctas: cutlass.Constexpr, max_slots: cutlass.Constexpr,
                               piece_trace: cutlass.Constexpr, prefetch: cutlass.Constexpr = False):
    """Debug build of :func:`launch_decode` recording each CTA's first ``piece_trace`` pieces
    (:meth:`~.decode_trace.DecodeTraceMixin.mark_piece`) in ``trace_buf`` (int64 ``(num_ctas * row blocks,
    piece_trace, len(PIECE_FIELDS))``, CTA ``g * row blocks + row block``), an extra output after ``lse``
    (benchmarks/piece_timeline.py)."""
    build_decode_kernel(loop=loop, producer=producer, dtype=dtype, num_heads=num_heads, q_len=q_len,
                        page_size=page_size, causal=causal, num_ctas=num_ctas, max_slots=max_slots,
                        prefetch=prefetch, piece_trace=piece_trace)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, sched_cta, sched_req, out, lse, o_accum,
        lse_accum, trace_buf)


__all__ = ["LOOPS", "build_decode_kernel", "launch_decode", "launch_decode_piece_traced", "launch_decode_traced"]
