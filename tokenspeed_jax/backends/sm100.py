"""The ``sm100`` backend (Blackwell): placeholder until the TokenSpeed kernels are wired in."""

from __future__ import annotations


class Sm100Backend:
    name = "sm100"
    priority = 100

    def supports_decode(self, problem) -> str | None:
        return "sm100 backend not built yet"

    def supports_prefill(self, problem) -> str | None:
        return "sm100 backend not built yet"


BACKEND = Sm100Backend()
