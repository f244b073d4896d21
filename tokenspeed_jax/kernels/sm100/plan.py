"""Static planning of the TokenSpeed MLA decode kernels (pure Python: no CuTe DSL, no jax, no torch).

Everything here is a function of static shapes and device facts, so CPU tests cover it and the decode
wrapper sizes its XLA-owned workspace exactly.  It restates, in our own code, the policy TokenSpeed's
``tokenspeed_mla_decode`` applies before launching its kernel classes (tokenspeed-mla 2.0.4,
``mla_decode.py`` / ``mla_helpers.py``); ``tests/test_sm100_host.py`` checks it against TokenSpeed's
functions whenever the package is installed.

MMA tile (``select_mla_decode_tilers``)
    BF16/FP16: M128 x N128 (QK) / M128 x N256 (PV), a 2-CTA cluster.  FP8 on SM100: M64 (one CTA, no
    cluster) when ``H * S <= 64``, else M128; FP8 on SM103: always M128.

Query rows (fold or pack)
    ``fold`` = the largest divisor of ``S`` that is ``<= M // H``: ``fold`` query tokens are folded into
    the heads (``H_eff = H * fold`` rows per tile, ``S_eff = S / fold`` tiles per request).  An M128
    kernel instead *packs* the ``S * H`` rows contiguously (``row = token * H + head``, tiles of 128 rows
    crossing token boundaries) when that needs fewer tiles than folding; then ``H_eff = 128``,
    ``S_eff = ceil(S * H / 128)``, ``fold = 1``.

Split-KV count (``max_active_blocks`` = the SM count of the target)
    BF16/FP16 and FP8-M128: ``min(max(1, sms // B // (2 * S_eff)), 32)``; FP8-M64: TokenSpeed's
    wave-aware count over the KV tiles of the longest request (capped at 64).  FP8 then drops empty
    trailing splits (``splits = ceil(k_tiles / ceil(k_tiles / splits))``).  TokenSpeed plans from the
    runtime maximum length; we plan from the static capacity ``max_pages * page_size`` (the kernel
    re-divides each request's runtime length among the splits, so shorter requests stay correct).

Workspace (split-KV partials, only when ``splits > 1``)
    One float32 block ``[B, S_eff, H_eff, splits, 512]`` of partial outputs followed by
    ``[B, S_eff, H_eff, splits]`` partial base-2 LSEs: ``B * H_eff * S_eff * splits * 513 * 4`` bytes
    (TokenSpeed's ``get_workspace_size``).  It is an extra output of the custom call (XLA owns it, per
    call); int32 offsets inside the kernel limit it to < 2 GiB.
"""

from __future__ import annotations

import dataclasses

LATENT_DIM = 512
ROPE_DIM = 64
BLOCK_N = 128  # KV tokens per QK MMA tile (both dtypes)
MAX_SPLITS_2CTA = 32
MAX_SPLITS_M64 = 64
WORKSPACE_LIMIT = 1 << 31
# Archs whose TokenSpeed decode / prefill kernels we compile in CI.
SUPPORTED_ARCHS = ("sm_100a", "sm_103a")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def compute_capability(arch: str) -> tuple[int, int]:
    """``"sm_100a" -> (10, 0)``, ``"sm_103a" -> (10, 3)``."""
    digits = "".join(c for c in arch.removeprefix("sm_") if c.isdigit())
    return int(digits[:-1]), int(digits[-1])


def mma_m_tile(*, num_heads: int, q_len: int, fp8: bool, arch: str) -> int:
    """M of the QK/PV MMA tile TokenSpeed selects (64 or 128)."""
    return 64 if fp8 and arch.startswith("sm_100") and num_heads * q_len <= 64 else 128


def fold_factor(num_heads: int, q_len: int, m_tile: int) -> int:
    """Largest divisor of ``q_len`` not above ``m_tile // num_heads`` (1 when none)."""
    for f in range(min(q_len, m_tile // num_heads), 1, -1):
        if q_len % f == 0:
            return f
    return 1


@dataclasses.dataclass(frozen=True)
class Sm100DecodeLayout:
    """How the ``S * H`` query rows of a request map onto M tiles."""

    m_tile: int
    fold: int
    pack_q: bool
    heads_eff: int  # rows per tile (H * fold, or m_tile when packed)
    q_len_eff: int  # tiles per request

    @property
    def cluster_m(self) -> int:
        """CTAs per M tile (2-CTA tcgen05 MMA for M128, one CTA for M64)."""
        return 2 if self.m_tile == 128 else 1


def query_layout(*, num_heads: int, q_len: int, fp8: bool, arch: str) -> Sm100DecodeLayout:
    m = mma_m_tile(num_heads=num_heads, q_len=q_len, fp8=fp8, arch=arch)
    fold = fold_factor(num_heads, q_len, m)
    q_len_eff = q_len // fold
    # Our q and out are always contiguous [B, S, H, D], the precondition TokenSpeed checks for packing.
    if m == 128 and ceil_div(num_heads * q_len, m) < q_len_eff:
        return Sm100DecodeLayout(m, 1, True, m, ceil_div(num_heads * q_len, m))
    return Sm100DecodeLayout(m, fold, False, num_heads * fold, q_len_eff)


def _split_wave_aware(batch: int, q_len_eff: int, max_kv_len: int, num_sms: int, ctas_per_tile: int) -> int:
    max_splits = ceil_div(max_kv_len, BLOCK_N)
    blocks_per_batch = max(1, num_sms // batch // (q_len_eff * ctas_per_tile))
    heur = min(max_splits, blocks_per_batch)
    waves = ceil_div(max_splits, heur)
    cap = MAX_SPLITS_M64 if ctas_per_tile == 1 else MAX_SPLITS_2CTA
    return min(ceil_div(max_splits, waves), cap)


def num_splits(*, batch: int, layout: Sm100DecodeLayout, max_kv_len: int, fp8: bool, num_sms: int) -> int:
    if fp8 and layout.m_tile == 64:
        splits = _split_wave_aware(batch, layout.q_len_eff, max_kv_len, num_sms, 1)
    else:
        splits = min(max(1, num_sms // batch // (layout.q_len_eff * 2)), MAX_SPLITS_2CTA)
    splits = max(splits, 1)
    if fp8:
        k_tiles = ceil_div(max_kv_len, BLOCK_N)
        splits = ceil_div(k_tiles, ceil_div(k_tiles, splits))
    return splits


def workspace_elems(*, batch: int, layout: Sm100DecodeLayout, splits: int, kv_lora_rank: int = LATENT_DIM) -> int:
    """float32 elements of the split-KV workspace (0 without splits)."""
    if splits == 1:
        return 0
    return batch * layout.heads_eff * layout.q_len_eff * splits * (kv_lora_rank + 1)


def reducer_d_tiles(*, batch: int, q_len: int, num_heads: int, num_sms: int, splits: int) -> int:
    """FP8 reduction: output bands of the 512 latent dims (2 when the rows fill at most half the SMs)."""
    rows = batch * q_len * num_heads
    if rows <= 0 or num_sms <= 0 or rows >= num_sms or splits <= 1:
        return 1
    return 2 if ceil_div(rows * 2, num_sms) < 2 * ceil_div(rows, num_sms) else 1


def reducer_max_splits(splits: int) -> int:
    """FP8 reduction capacity: the power of two (at least 4) covering ``splits``."""
    return max(4, 1 << (splits - 1).bit_length())
