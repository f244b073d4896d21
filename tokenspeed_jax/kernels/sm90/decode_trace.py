"""Debug timelines of the sm90 decode loops (``benchmarks/trace_decode.py``): where a debug build stores ``clock64``
timestamps, and the names of the seesaw loop's trace points.  A mixin of
:class:`~tokenspeed_jax.kernels.sm90.seesaw.MlaDecodeSeesawSm90` (and so of the loops built on it), which
sets :attr:`trace` (the iterations timed per warpgroup; 0: a normal build, in which every method here emits nothing).
Split from the loop by responsibility: this module knows the trace buffer; the loops decide where to mark.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

# DecodeTraceMixin.mark: the points of an iteration of the seesaw loop a debug build times, per warpgroup (WG0 /
# WG1: what the time since the previous event was spent on).  In the 16-bit loop "P store + TAIL" is WG0's conversion
# of P to the register operand and WG1's conversion and store of P1 for the cross PV, "QK issue + cross PV retired" is
# the first QK half, "QK retired" adds the slot-1 column refill, the second landed wait and QK half; "transpose" is
# the FP8 V^T build; "wait VT*_FREE" and "refill issue" are empty (DecodeTraceMixin.clear_trace zeroes the buffer, so an
# unmarked event reads 0 and its interval is left out)
TRACE_EVENTS = (
    ("top", "top"),
    ("softmax", "wait SCALE0 (WG0's max)"),
    ("P store + TAIL", "fold + exp (SCALE1 out)"),
    ("own PV (issue + retire)", "P store + TAIL"),
    ("wait SCALE1 (WG1's max)", "own PV issue + wait P0_READY"),
    ("rescale, P0' store, O rescale", "cross PV issue, P1_READY out"),
    ("wait P1_READY", "wait own + cross PV retired"),
    ("cross PV issue + wait KV landed", "wait KV landed"),
    ("QK issue + cross PV retired", "QK issue + retired"),
    ("QK retired", "wait VT1_FREE (WG0's cross PV)"),
    ("wait VT0_FREE (WG1's cross PV)", "transpose"),
    ("transpose", "refill issue"),
    ("refill issue", "-"),
)


class DecodeTraceMixin:
    """``mark`` / ``clear_trace`` over the int64 trace buffer ``(ctas, 2, trace, len(TRACE_EVENTS))``."""

    trace: int = 0

    @cute.jit
    def mark(self, mTrace: cute.Tensor, cta: Int32, wg: Int32, wtid: Int32, j: Int32, event: cutlass.Constexpr):
        """Debug builds (:attr:`trace` > 0): thread 0 of the warpgroup stores ``clock64`` as event ``event`` of
        iteration ``j`` of CTA ``cta`` into ``mTrace[cta, wg, j, event]`` (int64, shape ``(ctas, 2, trace,
        len(TRACE_EVENTS))``), for ``j < trace`` and ``cta < ctas``.  A predicated store, no branch (a divergent
        branch in the loop can make ptxas serialize the wgmmas).  Nothing at all in normal builds."""
        if cutlass.const_expr(self.trace > 0):
            t = cute.arch.clock64()
            n = mTrace.shape[0]
            ok = (wtid == 0) & (j < self.trace) & (cta < n)
            idx = ((cutlass.min(cta, n - 1) * 2 + wg) * self.trace + cutlass.min(j, self.trace - 1)) \
                * len(TRACE_EVENTS) + event
            cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[(mTrace.iterator + idx).toint(),
                                                                                  Int64(t)], predicate=ok)

    @cute.jit
    def clear_trace(self, mTrace: cute.Tensor, cta: Int32, wg: Int32, wtid: Int32):
        """Debug builds: thread 0 of computing warpgroup ``wg`` zeroes its rows of ``mTrace`` before its first
        :meth:`mark` (program order), so an event a build never marks, or an iteration it never reaches, reads 0 (the
        trace buffer is a fresh XLA output, not zeroed).  Nothing in normal builds."""
        if cutlass.const_expr(self.trace > 0):
            n = mTrace.shape[0]
            ok = (wtid == 0) & (wg < 2) & (cta < n)
            row = (cutlass.min(cta, n - 1) * 2 + cutlass.min(wg, 1)) * self.trace * len(TRACE_EVENTS)
            for i in cutlass.range(self.trace * len(TRACE_EVENTS)):
                cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[
                    (mTrace.iterator + row + i).toint(), Int64(0)], predicate=ok)


__all__ = ["TRACE_EVENTS", "DecodeTraceMixin"]
