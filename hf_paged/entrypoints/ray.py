"""``hf_paged.ray.map_generate``: generation over a Ray Dataset, one hf_paged engine per actor.

Built on Ray Data's public ``map_batches`` with an actor pool
(``compute=ActorPoolStrategy(size=num_replicas)`` where the installed Ray has it, else
``concurrency=num_replicas``). Each actor reserves ``num_gpus=tensor_parallel_size`` and opens one
``hf_paged.LLM`` on the GPUs Ray assigned to it (Ray sets ``CUDA_VISIBLE_DEVICES``); with
``tensor_parallel_size > 1`` the engine spawns its own worker processes there, and they meet
over their own store on 127.0.0.1.

Exactly once: Ray restarts an actor that died (``max_restarts``) and reruns the batch it held
(``max_task_retries``); the rerun gives the same tokens because every row's seed is a hash of
``(seed, row id)``. With ``output_path`` the output is written with Ray Data's checkpointing
(``CheckpointConfig(id_column=...)``): a rerun after an abort skips the rows already committed.
When an actor exits gracefully its engine is closed (the UDF's ``__del__``); when it is killed
its engine's workers notice the dead parent and exit.

Needs ``pip install "hf-paged[ray]"`` (``ray[data]``).
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import dataclass

try:
    import ray
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError(
        "hf_paged.ray needs ray[data]: pip install 'ray[data]' (from a clone of hf_paged: "
        "pip install -e '.[ray]')"
    ) from e

from hf_paged.config import SamplingParams
from hf_paged.entrypoints.rows import (
    check_columns,
    check_unique_ids,
    generate_rows,
    resolve_sampling,
)

_NOT_FROM_FILES = (
    "output_path is set but the input is not read from files, so a rerun could not tell which "
    "rows are done: write it first (ds.write_parquet(dir) or ds.to_parquet(path)) and pass the "
    "parquet path(s) as ds"
)
_HOOK_KEYS = ("exit_once_marker", "batch_log_dir", "fail_after_rows")


@dataclass(frozen=True)
class _Job:
    """What every actor needs to know about the run (pickled to each actor)."""

    model: str
    tokenizer: object
    engine_kwargs: dict
    column: str
    id_column: str
    output_column: str
    base: SamplingParams
    seed: int
    hooks: dict  # test-only, see map_generate's ``test_hooks``


def map_generate(
    ds,
    *,
    model,
    column: str = "prompt",
    output_column: str = "generation",
    id_column: str = "id",
    sampling_params: SamplingParams | None = None,
    generation_config=None,
    tensor_parallel_size: int = 1,
    num_replicas: int = 1,
    batch_size: int = 32,
    batches_in_flight: int = 2,
    seed: int = 0,
    tokenizer=None,
    engine_kwargs: dict | None = None,
    output_path: str | None = None,
    checkpoint_path: str | None = None,
    num_cpus: float = 1,
    num_gpus: float | None = None,
    max_restarts: int = -1,
    max_task_retries: int = -1,
    test_hooks: dict | None = None,
):
    """Generate one completion per row of ``ds`` on ``num_replicas`` engine actors.

    Args:
        ds: a ``ray.data.Dataset``, a ``datasets.Dataset`` (a missing ``id_column`` is added
            as the row index), or parquet path(s) (read with ``ray.data.read_parquet``).
        model: checkpoint directory, readable from every node.
        column: prompt column (strings or lists of token ids).
        output_column: text column added; ``{output_column}_token_ids`` holds the ids.
        id_column: unique row ids (int or str); each row's seed derives from its id, and
            Ray's checkpoint knows finished rows by it. Repeated ids are refused before
            anything runs: one pass reads the id column alone to the driver (in Arrow; a plan
            with transforms before it runs them for that column too: ``materialize()`` first
            to avoid it).
        sampling_params / generation_config: one of them (default greedy, 16 new tokens).
        tensor_parallel_size: ranks per engine; each actor reserves that many GPUs.
        num_replicas: actors in the pool (one engine each).
        batch_size: rows per ``map_batches`` call (one engine run each). Small batches keep
            retries cheap and replicas balanced; each batch is one engine run, so its last
            rows run with a thinning batch.
        batches_in_flight: batches queued per actor, so the next one is ready when a run ends.
        seed: base seed mixed with every row id.
        tokenizer: for a checkpoint without one beside it.
        engine_kwargs: EngineConfig keys for every engine (``max_num_seqs``, ...).
        output_path: write parquet there (and return it) instead of returning a Dataset;
            needs an input read from files (parquet paths or a ``read_*`` Dataset).
        checkpoint_path: where Ray keeps the committed row ids (default
            ``{output_path}.checkpoint``; a shared file system on a cluster).
        num_cpus / num_gpus: per actor (``num_gpus`` default: ``tensor_parallel_size`` when
            the cluster has GPUs, else 0).
        max_restarts / max_task_retries: Ray's actor options; -1 (unlimited) is Ray Data's
            default for actor pools and is not passed on.
        test_hooks: test-only fault injection, never for real runs: ``exit_once_marker`` (a
            path: the first actor to create it exits its process on that batch),
            ``batch_log_dir`` (each batch writes a file listing its row ids) and
            ``fail_after_rows`` (with ``batch_log_dir``: a batch raises once that many rows
            were logged, aborting the run).

    Returns:
        A lazy ``ray.data.Dataset`` with the input columns plus the two output columns; with
        ``output_path``, runs the write and returns ``output_path``.

    Raises:
        ValueError / TypeError: a bad argument (named), a missing column, repeated ids, or
            ``output_path`` with an input that is not read from files.
    """
    _check_args(model, ds, output_path, num_replicas=num_replicas, batch_size=batch_size,
                batches_in_flight=batches_in_flight, tensor_parallel_size=tensor_parallel_size)  # fmt: skip
    hooks = _check_hooks(test_hooks)
    ds = _as_ray_dataset(ds, id_column)
    if output_path is not None and not _reads_files(ds):
        raise ValueError(_NOT_FROM_FILES)
    check_columns(ds.schema().names, column, id_column, output_column)
    _check_unique_ids(ds, id_column)
    kwargs = dict(engine_kwargs or {})
    if kwargs.get("tensor_parallel_size", tensor_parallel_size) != tensor_parallel_size:
        raise ValueError(
            "engine_kwargs['tensor_parallel_size'] differs from tensor_parallel_size: set it once"
        )
    kwargs["tensor_parallel_size"] = tensor_parallel_size
    base = resolve_sampling(sampling_params, generation_config)
    job = _Job(os.fspath(model), tokenizer, kwargs, column, id_column, output_column, base,
               seed, hooks)  # fmt: skip
    if num_gpus is None:
        if not ray.is_initialized():
            ray.init()  # what Ray Data would do on first use
        num_gpus = tensor_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
    # Blocks of batch_size rows (a streaming split, no shuffle): each map task is one batch, so
    # batches spread over the actors and finished ones reach the writer while others run.
    ds = ds.repartition(target_num_rows_per_block=batch_size)
    out = ds.map_batches(
        _GenerateUDF,
        fn_constructor_args=(job,),
        batch_size=batch_size,
        batch_format="pyarrow",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        **_pool_args(num_replicas, batches_in_flight),
        **_retry_args(max_restarts, max_task_retries),
    )
    if output_path is None:
        return out
    return _write_resumable(out, output_path, checkpoint_path, id_column)


def _check_args(model, ds, output_path, **counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: {name} must be an int >= 1")
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model={type(model).__name__} is not allowed: map_generate needs a checkpoint "
            "directory that every actor can open"
        )
    if output_path is not None and not isinstance(
        ds, (ray.data.Dataset, str, os.PathLike, list, tuple)
    ):
        raise ValueError(_NOT_FROM_FILES)


def _check_unique_ids(ds, id_column: str) -> None:
    """``rows.check_unique_ids`` over the whole id column, read alone, before anything runs:
    a rerun's checkpoint filter would otherwise skip the unfinished twin of a committed id."""
    import pyarrow as pa

    chunks = []
    ids_only = ds.select_columns([id_column])
    for batch in ids_only.iter_batches(batch_size=None, batch_format="pyarrow"):
        chunks.extend(batch.column(id_column).chunks)
    try:
        ids = pa.chunked_array(chunks) if chunks else []
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # blocks typed differently (ints and nulls)
        ids = [v for c in chunks for v in c.to_pylist()]
    check_unique_ids(ids, id_column)


def _pool_args(num_replicas: int, batches_in_flight: int) -> dict:
    try:
        from ray.data import ActorPoolStrategy
    except ImportError:  # a Ray without it: the older spelling
        return {"concurrency": num_replicas}
    return {
        "compute": ActorPoolStrategy(
            size=num_replicas, max_tasks_in_flight_per_actor=batches_in_flight
        )
    }


def _retry_args(max_restarts: int, max_task_retries: int) -> dict:
    # Ray Data's actor pools default to both -1 (unlimited); pass them only to change that
    # (Ray 2.60 deprecates passing actor options through map_batches' **ray_remote_args).
    args = {}
    if max_restarts != -1:
        args["max_restarts"] = max_restarts
    if max_task_retries != -1:
        args["max_task_retries"] = max_task_retries
    return args


def _as_ray_dataset(ds, id_column: str):
    if isinstance(ds, ray.data.Dataset):
        return ds
    if isinstance(ds, (str, os.PathLike)) or (
        isinstance(ds, (list, tuple)) and ds and all(isinstance(p, (str, os.PathLike)) for p in ds)
    ):
        paths = [os.fspath(ds)] if isinstance(ds, (str, os.PathLike)) else list(map(os.fspath, ds))
        return ray.data.read_parquet(paths)
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(ds, datasets.Dataset):
        if id_column not in ds.column_names:
            ds = ds.add_column(id_column, list(range(len(ds))))
        return ray.data.from_huggingface(ds)
    raise TypeError(
        f"ds={type(ds).__name__} is not allowed: pass a ray.data.Dataset, a datasets.Dataset "
        "or parquet path(s)"
    )


def _write_resumable(out, output_path: str, checkpoint_path: str | None, id_column: str) -> str:
    """``out.write_parquet(output_path)`` under Ray Data's checkpointing by ``id_column``."""
    from ray.data.checkpoint import CheckpointConfig

    output_path = os.fspath(output_path)
    checkpoint_path = checkpoint_path or output_path.rstrip("/") + ".checkpoint"
    _check_not_orphaned(output_path, checkpoint_path)
    config = CheckpointConfig(
        id_column=id_column,
        checkpoint_path=checkpoint_path,
        delete_checkpoint_on_success=False,  # a later rerun still skips the finished rows
    )
    context = out.context
    previous = context.checkpoint_config
    context.checkpoint_config = config
    try:
        with warnings.catch_warnings():
            # Ray warns and writes without checkpoints when the plan does not start at a file
            # read; a rerun would then duplicate rows, so that is an error here.
            warnings.filterwarnings("error", message=".*doesn't support checkpointing")
            out.write_parquet(output_path)
    except UserWarning as exc:
        raise ValueError(_NOT_FROM_FILES) from exc
    finally:
        context.checkpoint_config = previous
    return output_path


def _reads_files(ds) -> bool:
    """Whether every source of ``ds``'s plan is a file read (what Ray's checkpointing needs).

    Ray 2.60 silently writes without checkpoints otherwise, so this is checked up front. It
    reads the private logical plan (Ray has no public test for it) and answers True, leaving
    the decision to Ray, where that plan is not found.
    """
    plan = getattr(ds, "_logical_plan", None)
    dag = getattr(plan, "dag", None)
    if dag is None:
        return True

    def reads(op) -> bool:
        if any(c.__name__ in ("Read", "ReadFiles") for c in type(op).__mro__):
            return True
        deps = getattr(op, "input_dependencies", None) or []
        return bool(deps) and all(reads(d) for d in deps)

    return reads(dag)


def _check_not_orphaned(output_path: str, checkpoint_path: str) -> None:
    """Refuse a checkpoint whose output is gone: its rows would be skipped and never written."""
    if "://" in output_path or "://" in checkpoint_path:
        return  # object stores: Ray's own checks only

    def has_files(path: str) -> bool:
        return os.path.isdir(path) and any(not n.startswith(".") for n in os.listdir(path))

    if has_files(checkpoint_path) and not has_files(output_path):
        raise ValueError(
            f"checkpoint_path={checkpoint_path!r} lists finished rows but output_path="
            f"{output_path!r} is empty or missing, so those rows would be skipped: restore the "
            "output, or delete the checkpoint directory to start over"
        )


def _check_hooks(hooks: dict | None) -> dict:
    hooks = dict(hooks or {})
    unknown = sorted(set(hooks) - set(_HOOK_KEYS))
    if unknown:
        raise ValueError(f"test_hooks keys {unknown} are not allowed: allowed {list(_HOOK_KEYS)}")
    if "fail_after_rows" in hooks and "batch_log_dir" not in hooks:
        raise ValueError("test_hooks['fail_after_rows'] needs test_hooks['batch_log_dir']")
    return hooks


class _GenerateUDF:
    """The ``map_batches`` callable: one engine per actor, one engine run per batch."""

    def __init__(self, job: _Job):
        from hf_paged.entrypoints.llm import LLM

        self.job = job
        self.llm = LLM(job.model, tokenizer=job.tokenizer, **job.engine_kwargs)

    def __call__(self, batch):  # pyarrow.Table -> pyarrow.Table with the two output columns
        import pyarrow as pa

        job = self.job
        row_ids = batch.column(job.id_column).to_pylist()
        _run_hooks(job.hooks, row_ids)
        texts, ids = generate_rows(
            self.llm, batch.column(job.column).to_pylist(), row_ids, job.base, job.seed, job.column
        )
        batch = batch.append_column(job.output_column, pa.array(texts, type=pa.string()))
        return batch.append_column(
            f"{job.output_column}_token_ids", pa.array(ids, type=pa.list_(pa.int64()))
        )

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            llm.close()


def _run_hooks(hooks: dict, row_ids: list) -> None:
    """Test-only fault injection (see ``map_generate``'s ``test_hooks``)."""
    if not hooks:
        return
    marker = hooks.get("exit_once_marker")
    if marker is not None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            os._exit(17)  # a crash, as if the node died: no cleanup, no exception
    log_dir = hooks.get("batch_log_dir")
    if log_dir is None:
        return
    limit = hooks.get("fail_after_rows")
    if limit is not None and _logged_rows(log_dir) >= limit:
        raise RuntimeError(f"test_hooks: aborting after {limit} logged rows")
    name = f"{time.time_ns()}-{uuid.uuid4().hex}.ids"
    with open(os.path.join(log_dir, name), "w") as f:
        f.write("\n".join(repr(r) for r in row_ids))


def _logged_rows(log_dir: str) -> int:
    total = 0
    for name in os.listdir(log_dir):
        if name.endswith(".ids"):
            with open(os.path.join(log_dir, name)) as f:
                total += sum(1 for line in f if line.strip())
    return total
