"""Tiny local models, tokenizers, prompts and oracles for the tests, the demo and the examples
(nothing is downloaded). The one factory for them: a test builds what it needs from here, never
from another test module.

- ``models``: ``tiny_config`` / ``build_hf_model`` / ``save_tiny_model`` per native family,
  ``save_checkpoint`` (model + tokenizer), ``save_demo_model``, ``randomize_``,
  ``randomize_lora_`` / ``save_random_lora`` (PEFT LoRA factors that change the tokens);
- ``any_model``: ``build_tiny`` / ``shrink_config`` for any transformers architecture;
- ``tokenizer``: ``build_char_tokenizer`` (``models.tiny_tokenizer`` pads it to the tiny vocab);
- ``prompts``: ``make_prompts``, ``spread_prompts``, ``left_pad`` / ``right_pad``;
- ``parity``: the oracles, ``hf_greedy`` (stock) / ``paged_greedy`` (``LLM``) and
  ``stock_and_paged`` (one ``generate`` call both ways), ``SMALL_ENGINE``;
- ``paged_step``: one paged forward by hand (``make_kv_cache``, ``build_metadata``, ``run_step``);
- ``comm``: tensor-parallel ranks without a process group (``FakeComm``, ``ThreadGroup``);
- ``procfs``: what a process holds (fds, listening sockets, /dev/shm files), whether it runs;
- ``toy_model``: a ``PagedModel`` that is not Llama, for the protocol tests.

``procfs`` and ``toy_model`` are imported by their module path; the rest is re-exported here.

Not part of the public API: ``hf_paged`` exports nothing from here, and it changes with the
tests' needs.
"""

from __future__ import annotations

from hf_paged.testing.any_model import build_tiny, shrink_config
from hf_paged.testing.comm import FakeComm, ThreadComm, ThreadGroup, run_ranks
from hf_paged.testing.models import (
    FAMILIES,
    TINY_VOCAB,
    build_hf_model,
    randomize_,
    randomize_lora_,
    save_checkpoint,
    save_demo_model,
    save_random_lora,
    save_tiny_model,
    tiny_config,
    tiny_tokenizer,
)
from hf_paged.testing.paged_step import build_metadata, make_kv_cache, run_step
from hf_paged.testing.parity import (
    SMALL_ENGINE,
    fallback_warnings,
    hf_greedy,
    paged_greedy,
    stock_and_paged,
)
from hf_paged.testing.prompts import PAD, left_pad, make_prompts, right_pad, spread_prompts
from hf_paged.testing.tokenizer import build_bpe_tokenizer, build_char_tokenizer, random_words

__all__ = [
    "FAMILIES",
    "PAD",
    "SMALL_ENGINE",
    "TINY_VOCAB",
    "FakeComm",
    "ThreadComm",
    "ThreadGroup",
    "build_bpe_tokenizer",
    "build_char_tokenizer",
    "build_hf_model",
    "build_metadata",
    "build_tiny",
    "fallback_warnings",
    "hf_greedy",
    "left_pad",
    "make_kv_cache",
    "make_prompts",
    "paged_greedy",
    "random_words",
    "randomize_",
    "randomize_lora_",
    "right_pad",
    "run_ranks",
    "run_step",
    "save_checkpoint",
    "save_demo_model",
    "save_random_lora",
    "save_tiny_model",
    "shrink_config",
    "spread_prompts",
    "stock_and_paged",
    "tiny_config",
    "tiny_tokenizer",
]
