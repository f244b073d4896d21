"""Checkpoints shipped inside the package (Hugging Face layout, loadable by ``load_checkpoint``).

* ``pystdlib-tiny``: a 2.1M-parameter DeepSeek-V3-architecture model (MLA, MoE with the noaux_tc router,
  one MTP layer) trained on the Python standard library's source with
  :mod:`tokenspeed_jax.models.deepseek.train`; its ``README.md`` is the model card.
"""

from __future__ import annotations

import os

DEFAULT = "pystdlib-tiny"
_HERE = os.path.dirname(os.path.abspath(__file__))


def checkpoint_path(name: str = DEFAULT) -> str:
    """Directory of the shipped checkpoint ``name`` (``FileNotFoundError`` if this install lacks it)."""
    path = os.path.join(_HERE, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        names = sorted(n for n in os.listdir(_HERE) if os.path.isfile(os.path.join(_HERE, n, "config.json")))
        raise FileNotFoundError(f"name: expected one of the shipped checkpoints {names}, got {name!r}")
    return path


def default_checkpoint() -> str:
    """Directory of the default shipped checkpoint (``pystdlib-tiny``)."""
    return checkpoint_path(DEFAULT)


__all__ = ["DEFAULT", "checkpoint_path", "default_checkpoint"]
