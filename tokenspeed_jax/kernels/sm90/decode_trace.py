"""Debug timelines of decode loops (``benchmarks/trace_decode.py``): mixin of :class:`~.seesaw.MlaDecodeSeesawSm90` (and
loops built on it) knowing where a debug build stores ``clock64`` timestamps, the seesaw loop's trace point names (the
loops decide where to mark).  The loop sets :attr:`trace`: iterations timed per warpgroup (0: normal build, no-op).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

# mark points of a seesaw loop iteration per warpgroup (WG0 / WG1: time since the previous event).  In the 16-bit
# loop "P store + TAIL" is WG0's P -> register operand conversion and WG1's P1 conversion + store for the cross PV,
# "QK issue + cross PV retired" the first QK half, "QK retired" adds the slot-1 column refill, the second landed wait
# and QK half; "transpose" the FP8 V^T build; "wait VT*_FREE", "refill issue" empty (read 0 after clear_trace: skipped)
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
        """Debug builds (:attr:`trace` > 0): warpgroup thread 0 stores ``clock64`` in ``mTrace[cta, wg, j, event]`` if
        ``j < trace``, ``cta < ctas`` (predicated: a divergent branch can make ptxas serialize the loop's wgmmas)."""
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
        :meth:`mark`, so an unmarked event or unreached iteration reads 0 (a fresh XLA output is not zeroed)."""
        if cutlass.const_expr(self.trace > 0):
            n = mTrace.shape[0]
            ok = (wtid == 0) & (wg < 2) & (cta < n)
            row = (cutlass.min(cta, n - 1) * 2 + cutlass.min(wg, 1)) * self.trace * len(TRACE_EVENTS)
            for i in cutlass.range(self.trace * len(TRACE_EVENTS)):
                cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[
                    (mTrace.iterator + row + i).toint(), Int64(0)], predicate=ok)


__all__ = ["TRACE_EVENTS", "DecodeTraceMixin"]
