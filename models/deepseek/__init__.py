"""DeepSeek-V3/R1 in Flax NNX on the tokenspeed_jax MLA ops (``tokenspeed_jax.models.deepseek``).

Stable entry points:

* ``load_checkpoint(path, *, dtype)`` -> :class:`DeepseekV3` from a Hugging Face checkpoint directory.
* ``model.logits(input_ids)`` -> full-sequence causal logits ``[T, vocab]`` float32 (prefill path).
* ``generate(model, prompts, max_new_tokens, *, eos_token_id=None, temperature=0.0, top_k=None,
  top_p=None, seed=0, num_speculative_tokens=0, stream=None, tokenizer=None)`` -> token-id lists (or
  texts for string prompts); MTP speculative decoding (greedy or rejection sampling) with
  ``num_speculative_tokens > 0``.  ``Engine`` adds continuous batching (``max_slots``) and streaming.
* ``load_tokenizer(checkpoint_dir)`` -> :class:`Tokenizer` from ``tokenizer.json`` (or None).

See ``docs/model.md`` for the design and ``python -m tokenspeed_jax.models.deepseek --help`` for the CLI.
"""

from tokenspeed_jax.models.deepseek.cache import KVCache, PageAllocator
from tokenspeed_jax.models.deepseek.config import PRESETS, DeepseekV3Config
from tokenspeed_jax.models.deepseek.engine import (
    Engine,
    GenerateOutput,
    TokenEvent,
    enable_compilation_cache,
    generate,
)
from tokenspeed_jax.models.deepseek.model import DeepseekV3
from tokenspeed_jax.models.deepseek.sampling import SamplingParams
from tokenspeed_jax.models.deepseek.tokenizer import Tokenizer, load_tokenizer
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
    "SamplingParams",
    "TokenEvent",
    "Tokenizer",
    "enable_compilation_cache",
    "generate",
    "load_checkpoint",
    "load_tokenizer",
    "save_checkpoint",
]
