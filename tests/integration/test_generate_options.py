"""Every ``GenerationConfig`` option and ``generate`` argument is a visible decision: served or
run stock under a reason key the code raises, and listed in docs/generate_options.md. A new
transformers option fails here until ``integration/contract/options.py`` decides it."""

from __future__ import annotations

import inspect
import pathlib
import re

from transformers import GenerationConfig
from transformers.generation import GenerationMixin, GenerationMode

from hf_paged.integration.contract.options import (
    GENERATE_ARGUMENTS,
    GENERATION_CONFIG_OPTIONS,
    fallback_keys,
    shown,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_OPTIONS = {"transformers_version", "_from_model_config"}  # metadata, not behaviour


def test_every_generation_config_attribute_is_decided():
    attributes = {k for k in vars(GenerationConfig()) if k not in NOT_OPTIONS}
    assert attributes - set(GENERATION_CONFIG_OPTIONS) == set(), "decide these options"
    assert set(GENERATION_CONFIG_OPTIONS) - attributes == set(), "options transformers dropped"


def test_every_generate_argument_is_decided():
    generate = getattr(GenerationMixin.generate, "__hf_paged_original__", GenerationMixin.generate)
    names = set(inspect.signature(generate).parameters) - {"self", "kwargs"}
    assert names - set(GENERATE_ARGUMENTS) == set()


def _reason_keys() -> set[str]:
    keys = set()
    for table in (GENERATION_CONFIG_OPTIONS, GENERATE_ARGUMENTS):
        for status, _ in table.values():
            keys |= set(fallback_keys(status))
    return keys


def test_every_fallback_status_is_a_reason_the_code_raises():
    source = "\n".join(
        p.read_text() for p in (ROOT / "hf_paged").rglob("*.py") if p.name != "options.py"
    )
    modes = {m.value for m in GenerationMode}  # raised as the generation mode's own name
    missing = {k for k in _reason_keys() if k not in modes and f'"{k}"' not in source}
    assert missing == set()


def test_the_docs_list_every_option_with_its_status():
    doc = (ROOT / "docs" / "generate_options.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", doc, flags=re.M))
    for table in (GENERATION_CONFIG_OPTIONS, GENERATE_ARGUMENTS):
        for name, (status, _) in table.items():
            assert rows.get(name) == shown(status), name
