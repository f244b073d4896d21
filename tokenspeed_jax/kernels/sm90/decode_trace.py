"""Debug timelines of decode loops (``benchmarks/trace_decode.py``): mixin of :class:`~.seesaw.MlaDecodeSeesawSm90` (and
loops built on it) knowing where a debug build stores ``clock64`` timestamps, the seesaw loop's trace point names (the
loops decide where to mark).  The loop sets :attr:`trace`: iterations timed per warpgroup (0: normal build, no-op).
The piece-trace builds (``benchmarks/piece_timeline.py``) record each CTA's pieces instead: :attr:`piece_trace` pieces a
CTA, :meth:`DecodeTraceMixin.mark_piece` at the common piece walk of every loop (:data:`PIECE_FIELDS`).
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


# a piece-trace build's record of one piece (int64 each; :meth:`DecodeTraceMixin.mark_piece`): the piece, clock64 at
# its start, after its Q barrier, at the epilogue's barrier and after its last barrier, globaltimer (ns) at start and
# end; then the epilogue's steps: clock64 once the epilogue barrier passed (``epilogue_barrier``), after the next
# piece's Q copies went out (0 but in the loop with the Q prefetch) and when the epilogue's stores are issued, before
# the piece's last barrier
PIECE_FIELDS = ("b", "start", "end", "slot", "clk_start", "clk_q", "clk_epilogue", "clk_end", "ns_start", "ns_end",
                "clk_epi_pass", "clk_q_issued", "clk_stored")
_PIECE_NS = 8
_PIECE_EVENT_FIELD = (4, 5, 6, 7, 10, 11, 12)  # mark_piece's event -> its clock64 field


@cute.jit
def store_i64(mTrace: cute.Tensor, idx, value: Int64, ok):
    """``mTrace[idx] = value`` where ``ok`` (a predicated ``st.global.b64``: a divergent branch around a debug store can
    make ptxas serialize a loop's wgmmas)."""
    cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[(mTrace.iterator + idx).toint(), value],
                         predicate=ok)


class DecodeTraceMixin:
    """``mark`` / ``clear_trace`` over the int64 trace buffer ``(ctas, 2, trace, len(TRACE_EVENTS))``."""

    trace: int = 0
    piece_trace: int = 0

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
            store_i64(mTrace, idx, Int64(t), ok)

    @cute.jit
    def clear_trace(self, mTrace: cute.Tensor, cta: Int32, wg: Int32, wtid: Int32):
        """Debug builds: thread 0 of computing warpgroup ``wg`` zeroes its rows of ``mTrace`` before its first
        :meth:`mark`, so an unmarked event or unreached iteration reads 0 (a fresh XLA output is not zeroed)."""
        if cutlass.const_expr(self.trace > 0):
            n = mTrace.shape[0]
            ok = (wtid == 0) & (wg < 2) & (cta < n)
            row = (cutlass.min(cta, n - 1) * 2 + cutlass.min(wg, 1)) * self.trace * len(TRACE_EVENTS)
            for i in cutlass.range(self.trace * len(TRACE_EVENTS)):
                store_i64(mTrace, row + i, Int64(0), ok)

    @cute.jit
    def mark_piece(self, c, b: Int32, event: cutlass.Constexpr, meta=None):
        """Debug builds (:attr:`piece_trace` > 0): thread 0 (computing warpgroup 0) records event ``event`` of request
        ``b``'s piece in ``c.mTrace[cta, b - b_first]`` (:data:`PIECE_FIELDS`; events 0-3: start, Q barrier, epilogue
        barrier, end; 4-6: the epilogue's steps): its ``clock64``, and at events 0 and 3 the ``globaltimer`` (ns, one
        clock for all SMs); ``meta``: the piece's ``(b, start, end, slot)`` too.
        Pieces past the first :attr:`piece_trace` of a range are not recorded.  Normal builds: nothing."""
        if cutlass.const_expr(self.piece_trace > 0):
            j = b - c.b_first
            ok = (c.tid == 0) & (j < self.piece_trace)
            row = (c.g * self.num_m_blocks + c.mblk) * self.piece_trace + cutlass.min(j, self.piece_trace - 1)
            self._piece_store(c.mTrace, row, _PIECE_EVENT_FIELD[event], cute.arch.clock64(), ok)
            if cutlass.const_expr(event == 0 or event == 3):
                self._piece_store(c.mTrace, row, _PIECE_NS + event // 3, cute.arch.globaltimer(), ok)
            if cutlass.const_expr(meta is not None):
                for f in cutlass.range_constexpr(4):
                    self._piece_store(c.mTrace, row, f, Int64(meta[f]), ok)

    @cute.jit
    def clear_piece_trace(self, c):
        """Debug builds: thread 0 zeroes its CTA's :attr:`piece_trace` records before the first piece, so a record of
        no piece reads 0 (a fresh XLA output is not zeroed)."""
        row0 = (c.g * self.num_m_blocks + c.mblk) * self.piece_trace
        for i in cutlass.range(self.piece_trace, unroll=1):
            for f in cutlass.range_constexpr(len(PIECE_FIELDS)):
                self._piece_store(c.mTrace, row0 + i, f, Int64(0), c.tid == 0)

    @cute.jit
    def _piece_store(self, mTrace: cute.Tensor, row: Int32, field: cutlass.Constexpr, value: Int64, ok):
        store_i64(mTrace, Int64(row) * len(PIECE_FIELDS) + field, value, ok)


__all__ = ["PIECE_FIELDS", "TRACE_EVENTS", "DecodeTraceMixin", "store_i64"]
