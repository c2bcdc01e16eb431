"""Generate for a batch of table rows: what ``hf_paged.ray`` and ``shard_generate`` share.

A row carries an id and a prompt (a string or a list of token ids). Each row's seed is a stable
hash of ``(seed, row id)``, so a row gives the same tokens whichever batch, process, actor or
retry generates it, also when sampling. The outputs go back as plain columns:
``{output_column}`` (the decoded text, None without a tokenizer) and
``{output_column}_token_ids`` (the generated ids).

Only the public API is used: ``LLM``, ``SamplingParams``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from collections.abc import Sequence
from typing import Any

from hf_paged.config import SamplingParams

_SEED_BITS = 62  # the engine seeds request i's completion j with seed + j: stay below 2**63

# GenerationConfig fields that sampling_from_generation_config maps (everything else that differs
# from the defaults is refused by name), and fields that never change what is generated.
_MAPPED = frozenset(
    {"do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
     "max_new_tokens", "min_new_tokens", "eos_token_id"}
)  # fmt: skip
_IGNORED = frozenset(
    {"pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "max_length",
     "transformers_version", "_from_model_config", "return_dict_in_generate", "cache_implementation"}
)  # fmt: skip


def row_seed(seed: int, row_id: Any) -> int:
    """A stable 62-bit seed for one row: the same for the same ``(seed, row_id)`` in any process.

    Integer ids (Python or NumPy) hash by value, strings by their text, bytes as they are.

    Raises:
        TypeError: ``row_id`` is not an int, str or bytes.
    """
    if isinstance(row_id, numbers.Integral) and not isinstance(row_id, bool):
        key = b"i" + str(int(row_id)).encode()
    elif isinstance(row_id, str):
        key = b"s" + row_id.encode()
    elif isinstance(row_id, bytes):
        key = b"b" + row_id
    else:
        raise TypeError(
            f"row id {row_id!r} ({type(row_id).__name__}) is not allowed: ids must be ints, "
            "strings or bytes (they seed each row and name it in the output)"
        )
    digest = hashlib.blake2b(str(int(seed)).encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def sampling_from_generation_config(gen) -> SamplingParams:
    """``SamplingParams`` equal in meaning to a ``GenerationConfig`` (or a dict of its fields).

    Maps ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``max_new_tokens``, ``min_new_tokens`` and ``eos_token_id``
    (which then replaces the model's EOS ids, as in stock ``generate``).

    Raises:
        ValueError: ``max_new_tokens`` is missing, or a field is set that changes generation
            and has no engine equivalent here (beam search, stop strings, ...); it is named.
    """
    from transformers import GenerationConfig

    if isinstance(gen, dict):
        gen = GenerationConfig(**gen)
    if not isinstance(gen, GenerationConfig):
        raise TypeError(f"generation_config={gen!r}: expected a GenerationConfig or a dict")
    # fields left None take stock generate's global defaults (top_k=50 when sampling, ...)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    unsupported = sorted(
        k
        for k, v in gen.to_diff_dict().items()
        if k not in _MAPPED and k not in _IGNORED and (k not in defaults or defaults[k] != v)
    )
    if unsupported:
        raise ValueError(
            f"generation_config sets {unsupported}, which map_generate / shard_generate can't "
            f"reproduce; allowed fields are {sorted(_MAPPED)} (use SamplingParams for the rest)"
        )
    if gen.max_new_tokens is None:
        raise ValueError(
            "generation_config.max_new_tokens=None is not allowed here: set max_new_tokens "
            "(max_length counts the prompt, which differs per row)"
        )
    sample = bool(gen.do_sample)
    top_k = gen.top_k if gen.top_k is not None else defaults.get("top_k", 50)
    eos = gen.eos_token_id
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    return SamplingParams(
        temperature=float(gen.temperature or 1.0) if sample else 0.0,
        top_k=int(top_k) if sample and top_k else -1,
        top_p=float(gen.top_p) if sample and gen.top_p is not None else 1.0,
        min_p=float(gen.min_p) if sample and gen.min_p is not None else 0.0,
        repetition_penalty=float(gen.repetition_penalty or 1.0),
        max_tokens=int(gen.max_new_tokens),
        min_tokens=min(int(gen.min_new_tokens or 0), int(gen.max_new_tokens)),
        stop_token_ids=eos_ids,
        ignore_eos=bool(eos_ids),  # the call's EOS ids replace the model's
    )


def resolve_sampling(sampling_params=None, generation_config=None) -> SamplingParams:
    """One ``SamplingParams`` from either argument (greedy, 16 tokens when neither is given).

    Raises:
        ValueError: both are given.
        TypeError: ``sampling_params`` is not a SamplingParams.
    """
    if sampling_params is not None and generation_config is not None:
        raise ValueError("sampling_params and generation_config are both set: give one of them")
    if generation_config is not None:
        return sampling_from_generation_config(generation_config)
    if sampling_params is None:
        return SamplingParams(temperature=0.0)
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params={sampling_params!r} is not allowed: must be a SamplingParams"
        )
    if sampling_params.n != 1:
        raise ValueError(
            f"sampling_params.n={sampling_params.n} is not allowed here: one completion per row"
        )
    return sampling_params


def row_params(base: SamplingParams, seed: int, row_ids: Sequence) -> list[SamplingParams]:
    """``base`` per row, seeded from the row id when it samples (greedy needs no seed)."""
    if base.greedy:
        return [base] * len(row_ids)
    return [dataclasses.replace(base, seed=row_seed(seed, rid)) for rid in row_ids]


def as_prompt(value, column: str):
    """A table cell as an ``LLM.generate`` prompt: a str, or a list of int token ids.

    Raises:
        TypeError: the cell is neither (the column is named).
    """
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):  # NumPy / Arrow arrays of ids
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value
    ):
        return [int(t) for t in value]
    raise TypeError(
        f"column {column!r} holds {value!r} ({type(value).__name__}): each prompt must be a "
        "string or a list of int token ids"
    )


def generate_rows(
    llm, prompts: Sequence, row_ids: Sequence, base: SamplingParams, seed: int, column: str
) -> tuple[list[str | None], list[list[int]]]:
    """Generate one completion per row in one engine run.

    Args:
        llm: an ``hf_paged.LLM``.
        prompts: one cell of ``column`` per row (str or token ids).
        row_ids: one id per row (seeds sampling).
        base: the request's parameters.
        seed: the run's base seed (mixed with each row id).
        column: the prompt column's name, for error messages.

    Returns:
        (texts, token_ids): per row, in input order.
    """
    cells = [as_prompt(p, column) for p in prompts]
    outs = llm.generate(cells, row_params(base, seed, row_ids), use_tqdm=False)
    return [o.text for o in outs], [list(o.token_ids) for o in outs]


def check_columns(names: Sequence[str], column: str, id_column: str, output_column: str) -> None:
    """Raise ValueError naming a missing input column or an output column that exists already."""
    missing = [c for c in (column, id_column) if c not in names]
    if missing:
        raise ValueError(
            f"column(s) {missing} not in the dataset, which has {list(names)}: pass column= "
            "(the prompts) and id_column= (unique row ids) naming existing columns"
        )
    taken = [c for c in (output_column, f"{output_column}_token_ids") if c in names]
    if taken:
        raise ValueError(
            f"output_column={output_column!r} would overwrite existing column(s) {taken}: "
            "choose another output_column"
        )


def check_unique_ids(ids, id_column: str, examples: int = 5) -> None:
    """Refuse repeated row ids: they are the exactly-once and resume key (a row's seed, its
    checkpoint entry), so a repeated id would be generated once per row and reported as one, and
    a resume would skip the unfinished twin of a committed one.

    Args:
        ids: the whole id column: a pyarrow Array or ChunkedArray (hashed in Arrow, no Python
            object per row) or a sequence.
        id_column: its name, for the message.

    Raises:
        ValueError: naming the column, how many ids repeat, a few of them, and the fix.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if not isinstance(ids, (pa.Array, pa.ChunkedArray)):
        ids = pa.array(list(ids))
    if pc.count_distinct(ids, mode="all").as_py() == len(ids):
        return
    counts = pc.value_counts(ids)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    shown = repeated.field("values")[:examples].to_pylist()
    raise ValueError(
        f"id_column={id_column!r} has {len(repeated)} id(s) that occur more than once in "
        f"{len(ids)} rows, e.g. {shown}: row ids are the exactly-once and resume key (each "
        "row's seed and its checkpoint entry), so repeated ones would be generated once per "
        "row under one id, and a resumed run would skip the unfinished twin of a finished one. "
        "Deduplicate the rows, or pass id_column= a column of unique values"
    )
