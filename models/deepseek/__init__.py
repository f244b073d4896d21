"""DeepSeek-V3/R1 in Flax NNX on the tokenspeed_jax MLA ops (``tokenspeed_jax.models.deepseek``).

Stable entry points:

* ``load_checkpoint(path, *, dtype)`` -> :class:`DeepseekV3` from a Hugging Face checkpoint directory.
* ``model.logits(input_ids)`` -> full-sequence causal logits ``[T, vocab]`` float32 (prefill path).
* ``generate(model, prompts, max_new_tokens, *, num_speculative_tokens=0)`` -> list of token-id lists
  (greedy; MTP speculative decoding with ``num_speculative_tokens > 0``).

See ``docs/model.md`` for the design and ``python -m tokenspeed_jax.models.deepseek --help`` for the CLI.
"""

from tokenspeed_jax.models.deepseek.cache import KVCache, PageAllocator
from tokenspeed_jax.models.deepseek.config import PRESETS, DeepseekV3Config
from tokenspeed_jax.models.deepseek.engine import Engine, GenerateOutput, generate
from tokenspeed_jax.models.deepseek.model import DeepseekV3
from tokenspeed_jax.models.deepseek.weights import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "PRESETS",
    "CheckpointError",
    "DeepseekV3",
    "DeepseekV3Config",
    "Engine",
    "GenerateOutput",
    "KVCache",
    "PageAllocator",
    "generate",
    "load_checkpoint",
    "save_checkpoint",
]
