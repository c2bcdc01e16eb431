"""``shard_generate``: one process's slice of a dataset through one engine, as parquet parts.

For launchers without Ray (``torchrun``, SLURM arrays, ``accelerate launch``): every process runs
the same script, reads its rank and world size (``RANK`` / ``WORLD_SIZE`` or explicit
arguments), takes its contiguous slice with ``datasets.distributed.split_dataset_by_node``, and
writes ``part-{rank:05d}-{chunk:05d}.parquet`` files of ``rows_per_part`` rows each. A part is
written to a temporary file and renamed, so a part file is complete or absent; a rerun skips
every part that exists and regenerates only the missing ones. No collectives: ranks never wait
for each other, and hf_paged's own tensor-parallel group (127.0.0.1, a free port, its own
store) ignores the launcher's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``.

The layout (world size, rows per part, row count) is recorded in ``_layout.json`` on the first
run; a rerun with another layout is refused, since its parts would overlap the old ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from hf_paged import envs
from hf_paged.config import SamplingParams
from hf_paged.entrypoints.rows import (
    check_columns,
    check_unique_ids,
    generate_rows,
    resolve_sampling,
)

_LAYOUT = "_layout.json"


@dataclass
class ShardReport:
    """What one ``shard_generate`` call did on its rank."""

    rank: int
    world_size: int
    written: list[str] = field(default_factory=list)  # part files this call wrote
    skipped: list[str] = field(default_factory=list)  # part files that existed already
    rows_generated: int = 0  # rows that went through the engine in this call


def shard_generate(
    dataset,
    output_dir: str,
    *,
    model,
    column: str = "prompt",
    output_column: str = "generation",
    id_column: str = "id",
    sampling_params=None,
    generation_config=None,
    rank: int | None = None,
    world_size: int | None = None,
    rows_per_part: int = 256,
    seed: int = 0,
    tokenizer=None,
    **engine_kwargs,
) -> ShardReport:
    """Generate for this rank's slice of ``dataset`` and write it as parquet parts.

    Args:
        dataset: a ``datasets.Dataset``, a parquet path or a list of them. Without
            ``id_column`` the row index becomes the id.
        output_dir: directory for the parts (shared by all ranks; created if missing).
        model: checkpoint directory, loaded HF causal-LM, or an open ``hf_paged.LLM``
            (used as it is and left open).
        column: prompt column (strings or lists of token ids).
        output_column: the text column written; ``{output_column}_token_ids`` holds the ids.
        id_column: unique row ids (int or str); each row's sampling seed derives from its id.
            Repeated ids are refused (every rank hashes the whole column once, in Arrow).
        sampling_params / generation_config: one of them (default greedy, 16 new tokens).
        rank / world_size: default ``RANK`` / ``WORLD_SIZE`` from the environment, else 0 / 1.
        rows_per_part: rows per part file (the unit of resume).
        seed: base seed mixed with every row id.
        tokenizer: for a checkpoint without one beside it.
        **engine_kwargs: EngineConfig keys (``tensor_parallel_size``, ``device``, ...). Without
            ``device``, a process with ``LOCAL_RANK=r`` puts its engine on GPUs ``r*tp`` ..
            ``r*tp+tp-1`` (see ``local_device``).

    Returns:
        A ``ShardReport`` (parts written and skipped, rows generated).

    Raises:
        ValueError: bad rank / world size / rows_per_part, a missing column, repeated ids,
            or an ``output_dir`` written with another layout.
    """
    rank, world_size = _rank_and_world(rank, world_size)
    if isinstance(rows_per_part, bool) or not isinstance(rows_per_part, int) or rows_per_part < 1:
        raise ValueError(f"rows_per_part={rows_per_part!r} is not allowed: an int >= 1")
    base = resolve_sampling(sampling_params, generation_config)
    ds = _load(dataset, id_column)
    check_columns(ds.column_names, column, id_column, output_column)
    check_unique_ids(ds.with_format("arrow")[id_column], id_column)  # before anything is written
    os.makedirs(output_dir, exist_ok=True)
    _check_layout(output_dir, world_size, rows_per_part, len(ds))
    _remove_stale_temps(output_dir, rank)

    from datasets.distributed import split_dataset_by_node

    mine = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    report = ShardReport(rank, world_size)
    todo = []  # (part path, row range of ``mine``) for the parts still missing
    for chunk, start in enumerate(range(0, len(mine), rows_per_part)):
        path = os.path.join(output_dir, f"part-{rank:05d}-{chunk:05d}.parquet")
        if os.path.exists(path):
            report.skipped.append(path)
        else:
            todo.append((path, range(start, min(start + rows_per_part, len(mine)))))
    if todo:
        job = _Job(column, id_column, output_column, base, seed)
        _generate_parts(mine, todo, report, job, _open(model, tokenizer, engine_kwargs))
    return report


@dataclass(frozen=True)
class _Job:
    column: str
    id_column: str
    output_column: str
    base: SamplingParams
    seed: int


def _generate_parts(mine, todo, report: ShardReport, job: _Job, opened) -> None:
    llm, owned = opened
    try:
        for path, rows in todo:
            part = mine.select(rows)
            texts, ids = generate_rows(
                llm, part[job.column], part[job.id_column], job.base, job.seed, job.column
            )
            _write_part(part, job.output_column, texts, ids, path)
            report.written.append(path)
            report.rows_generated += len(rows)
    finally:
        if owned:
            llm.close()


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    # The launcher's variables are read here only to pick this process's slice; the engine's
    # tensor-parallel group never reads them.
    if rank is None:
        rank = _env_int("RANK", 0)
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", 1)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} is not allowed: an int")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank}, world_size={world_size} is not allowed: need world_size >= 1 and "
            "0 <= rank < world_size"
        )
    return rank, world_size


def _env_int(name: str, default: int) -> int:
    text = envs.launcher(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment {name}={text!r} is not an int") from None


def _load(dataset, id_column: str):
    import datasets

    if isinstance(dataset, (str, os.PathLike)):
        dataset = [dataset]
    if (
        isinstance(dataset, (list, tuple))
        and dataset
        and all(isinstance(p, (str, os.PathLike)) for p in dataset)
    ):
        dataset = datasets.Dataset.from_parquet([os.fspath(p) for p in dataset])
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"dataset={type(dataset).__name__} is not allowed: pass a datasets.Dataset or "
            "parquet path(s) (a resumable split needs a known length)"
        )
    if id_column not in dataset.column_names:
        dataset = dataset.add_column(id_column, list(range(len(dataset))))
    return dataset


def _check_layout(output_dir: str, world_size: int, rows_per_part: int, num_rows: int) -> None:
    layout = {"world_size": world_size, "rows_per_part": rows_per_part, "num_rows": num_rows}
    path = os.path.join(output_dir, _LAYOUT)
    if not os.path.exists(path):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(layout, f)
        os.replace(tmp, path)  # every rank writes the same content; the last rename wins
        return
    with open(path) as f:
        found = json.load(f)
    if found != layout:
        raise ValueError(
            f"output_dir={output_dir!r} holds parts written with {found}, but this run has "
            f"{layout}: rerun with the same world_size and rows_per_part, or use a new output_dir"
        )


def _remove_stale_temps(output_dir: str, rank: int) -> None:
    """Drop temporaries a killed run of this rank left (no other rank writes these names)."""
    prefix = f".part-{rank:05d}-"
    for name in os.listdir(output_dir):
        if name.startswith(prefix) and ".tmp-" in name:
            os.remove(os.path.join(output_dir, name))


def _open(model, tokenizer, engine_kwargs):
    from hf_paged.entrypoints.llm import LLM

    if isinstance(model, LLM):
        if engine_kwargs or tokenizer is not None:
            raise ValueError(
                "model is an open LLM: engine options and tokenizer are fixed already; pass a "
                "checkpoint path to set them"
            )
        return model, False
    if "device" not in engine_kwargs:
        device = local_device(
            envs.launcher("LOCAL_RANK"),
            engine_kwargs.get("tensor_parallel_size", 1),
            _cuda_device_count(),
        )
        engine_kwargs = {**engine_kwargs, **({"device": device} if device else {})}
    return LLM(model, tokenizer=tokenizer, **engine_kwargs), True


def local_device(local_rank: str | None, tensor_parallel_size: int, num_devices: int):
    """The first GPU of this process's engine under a launcher that sets ``LOCAL_RANK``.

    Process ``LOCAL_RANK=r`` with ``tensor_parallel_size=t`` takes ``cuda:{r*t}`` .. ``cuda:{r*t
    + t - 1}``, so the engines of one node never share a GPU. None (the engine's own default)
    without ``LOCAL_RANK``, without CUDA, or when this process sees too few GPUs to offset (the
    launcher already narrowed ``CUDA_VISIBLE_DEVICES``).
    """
    if local_rank is None or not local_rank.isdigit() or num_devices == 0:
        return None
    first = int(local_rank) * tensor_parallel_size
    if first + tensor_parallel_size > num_devices:
        return None
    return f"cuda:{first}"


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _write_part(part, output_column: str, texts, token_ids, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = part.with_format("arrow")[:]
    table = table.append_column(output_column, pa.array(texts, type=pa.string()))
    table = table.append_column(
        f"{output_column}_token_ids", pa.array(token_ids, type=pa.list_(pa.int64()))
    )
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name[: -len('.parquet')]}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # atomic on one file system: a part is whole or absent
