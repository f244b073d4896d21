"""The ``sm90`` backend (Hopper): placeholder until the kernels land; refuses every call with a reason."""

from __future__ import annotations


class Sm90Backend:
    name = "sm90"
    priority = 90

    def supports_decode(self, problem) -> str | None:
        return "sm90 decode kernel not built yet"

    def supports_prefill(self, problem) -> str | None:
        return "sm90 prefill kernel not built yet"


BACKEND = Sm90Backend()
