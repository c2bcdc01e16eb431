"""Every ``HF_PAGED_*`` environment switch, in one place: name, type, default, what it covers.

Read once: a switch is parsed from the environment at its first access and cached for the
process (``envs.HF_PAGED_PDL``, or :func:`get`). After the first access it is a plain module
attribute, so reading it in a kernel's dispatch costs what a global does. Read switches as
attributes of the module at the point of use, never ``from hf_paged.envs import HF_PAGED_PDL``
(that copies the value once and misses :func:`apply` and :func:`reset`).

* :func:`snapshot` gives every switch's value (a JSON-able dict). ``RunnerSpec`` carries it to
  the tensor-parallel workers, which :func:`apply` it, so every rank runs with rank 0's values
  whatever the workers' environment says; benchmarks record it in their result files.
* :func:`reset` drops cached values, so the next access reads the environment again (tests; the
  CLI after it sets ``HF_PAGED_BACKEND``).
* A bad value raises ``ValueError`` naming the variable, the value and what is allowed. A set
  ``HF_PAGED_*`` variable that is no switch here is warned about once, with the nearest name.

Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_MISSING = object()  # "not read yet" in the module namespace


@dataclass(frozen=True)
class Switch:
    """One environment switch. ``default`` sets the type: bool switches take 0/1 (also
    true/false, yes/no, on/off); str switches take one of ``choices`` (None = any string).
    Unset or empty = ``default``."""

    name: str
    default: bool | str
    doc: str
    choices: tuple[str, ...] | None = None


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "HF_PAGED_BACKEND",
            "hf",
            "Backend of transformers ``generate`` calls (and so of text-generation pipelines) "
            "made without a ``backend=`` keyword: 'hf' = stock, 'paged' = the engine. "
            "``hf_paged.set_default_backend`` overrides it within a process; ``hf-paged run`` "
            "sets it to 'paged' for the program and its child processes. It acts in programs "
            "that never import hf_paged through the start-up hook the package installs "
            "(``hf_paged_backend.pth``: imports hf_paged only when this is set).",
            choices=("hf", "paged"),
        ),
        Switch(
            "HF_PAGED_FUSED",
            True,
            "The fused elementwise Triton kernels on CUDA: RMSNorm (with the residual add), "
            "rotary embedding (with Qwen3's per-head q/k norm, and the K/V cache write when "
            "the attention backend accepts it) and SiLU-and-mul. 0 = the layers' torch code "
            "(the attention backend then writes K/V itself). Does not cover the argmax or the "
            "skinny GEMM kernels, which have their own switches.",
        ),
        Switch(
            "HF_PAGED_SKINNY_GEMM",
            True,
            "The skinny GEMM Triton kernel for linear layers with few rows on CUDA "
            "(``kernels/skinny_gemm.py``; it takes only shapes where it beats cuBLAS). "
            "0 = every linear layer on cuBLAS.",
        ),
        Switch(
            "HF_PAGED_FP8_GEMM",
            "auto",
            "The GEMM of FP8 linear layers (``layers/quantization/fp8_linear.py``). 'auto' = "
            "per weight shape and row count from the measured table (``kernels/fp8/fp8_paths.json``"
            ") on CUDA devices with FP8 (compute capability 8.9+), else 'dequant'. A named "
            "path runs wherever it takes the layer's shapes and device (else 'auto' decides): "
            "'cublaslt' (block-wise F.scaled_mm), 'triton' (block GEMM), 'gemv' (decode rows), "
            "'w8a8_ref' (the fp32 W8A8 reference, any device), 'dequant' (weights dequantized "
            "per call, then the model-dtype GEMM: what transformers runs without FP8 GEMMs). "
            "Row-wise checkpoints (compressed-tensors) use torch._scaled_mm for every path but "
            "'w8a8_ref' and 'dequant'.",
            choices=("auto", "cublaslt", "triton", "gemv", "w8a8_ref", "dequant"),
        ),
        Switch(
            "HF_PAGED_ARGMAX",
            True,
            "The Triton row-wise argmax for greedy sampling on CUDA (``kernels/argmax.py``). "
            "0 = ``torch.argmax``.",
        ),
        Switch(
            "HF_PAGED_TOKEN_SCORES",
            True,
            "The Triton log-softmax + gather + rank of prompt logprobs on CUDA "
            "(``kernels/token_scores.py``): one pass over each scored row's logits in the "
            "model's dtype. 0 = ``log_softmax`` in fp32 of each slice of rows.",
        ),
        Switch(
            "HF_PAGED_PDL",
            True,
            "Programmatic dependent launch for every Triton kernel here, on devices that "
            "support it (compute capability 9.0+, a Triton with ``launch_pdl``): a kernel may "
            "be launched while the one before it finishes (``kernels/pdl.py``). 0 = plain "
            "launches.",
        ),
        Switch(
            "HF_PAGED_PDL_PREFETCH",
            True,
            "Under PDL, the skinny GEMM loads its first weight tile before waiting on the "
            "kernel before it. 0 = it waits first. No effect without PDL.",
        ),
        Switch(
            "HF_PAGED_PROFILE",
            False,
            "Host-side timing of engine steps (``timing/step_profile.py``): host time per step "
            "section and the time spent waiting for the GPU, in ``llm.stats['profile']``. "
            "Costs one clock read per section; off by default.",
        ),
        Switch(
            "HF_PAGED_TIMINGS",
            "",
            "A file path: the process adds up wall-time spans (imports, model loading, each "
            "engine start and its steps, every engine step) and appends them as one JSON line "
            "to that file at exit (``hf_paged/timing/spans.py``; the client suite's time "
            "breakdown). Turns on ``HF_PAGED_PROFILE``'s step sections too. Empty = off.",
        ),
        Switch(
            "HF_PAGED_GIT_SHA",
            "",
            "Benchmarks only (``evaluation/``): the commit the tree was made from, recorded in "
            "every result file instead of ``git rev-parse HEAD`` (a copied tree may carry a "
            "stale ``.git``). The engine does not read it.",
        ),
    )
}

_warned_unknown: set[str] = set()


def _parse(switch: Switch, raw: str | None) -> bool | str:
    """The value of ``switch`` for the environment string ``raw`` (None = unset)."""
    text = "" if raw is None else raw.strip()
    if not text:
        return switch.default
    if isinstance(switch.default, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        allowed = "0 or 1 (also true/false, yes/no, on/off)"
        default = int(switch.default)
    else:
        if switch.choices is None or text in switch.choices:
            return text
        allowed = f"one of {list(switch.choices)}"
        default = repr(switch.default)
    raise ValueError(
        f"{switch.name}={raw!r} is not allowed: {switch.name} must be {allowed}; "
        f"unset it for the default ({default})"
    )


def get(name: str) -> bool | str:
    """The value of switch ``name``: parsed from the environment once, then cached.

    Raises:
        KeyError: ``name`` is no switch (the message lists the switches).
        ValueError: the environment holds a value the switch does not take.
    """
    if name not in SWITCHES:
        raise KeyError(f"{name!r} is not an hf_paged switch; switches are {list(SWITCHES)}")
    value = globals().get(name, _MISSING)
    if value is _MISSING:
        value = _parse(SWITCHES[name], os.environ.get(name))
        globals()[name] = value
    return value


def __getattr__(name: str):  # module attribute access: ``envs.HF_PAGED_PDL``
    if name in SWITCHES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def snapshot() -> dict[str, bool | str]:
    """Every switch's value now, ``{name: value}`` (reads and caches those not read yet)."""
    warn_unknown()
    return {name: get(name) for name in SWITCHES}


def apply(values: dict[str, bool | str]) -> None:
    """Install values recorded by :func:`snapshot` (in another process) as this process's.

    Raises:
        ValueError: a name that is no switch, or a value of the wrong type.
    """
    for name, value in values.items():
        switch = SWITCHES.get(name)
        if switch is None:
            raise ValueError(f"apply: {name!r} is not an hf_paged switch: {list(SWITCHES)}")
        kind = type(switch.default)
        if type(value) is not kind or (switch.choices and value not in switch.choices):
            allowed = f"one of {list(switch.choices)}" if switch.choices else f"a {kind.__name__}"
            raise ValueError(f"apply: {name}={value!r} is not allowed: must be {allowed}")
        globals()[name] = value


def reset(*names: str) -> None:
    """Forget cached values (all, or ``names``): the next access reads the environment."""
    for name in names or tuple(SWITCHES):
        globals().pop(name, None)


def warn_unknown() -> None:
    """Warn once per name about set ``HF_PAGED_*`` variables that are no switch (a typo, or a
    switch that no longer exists), with the nearest switch name."""
    for name in os.environ:
        if not name.startswith("HF_PAGED_") or name in SWITCHES or name in _warned_unknown:
            continue
        _warned_unknown.add(name)
        near = difflib.get_close_matches(name, list(SWITCHES), n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        warnings.warn(
            f"{name} is set but is not an hf_paged switch, so it has no effect; {hint}"
            f"switches are {list(SWITCHES)}",
            stacklevel=3,
        )


# A launcher's own variables (torchrun, SLURM via the caller, ``accelerate launch``). Only
# ``hf_paged.shard_generate`` reads them, to pick its slice and GPUs; the engine's
# tensor-parallel group never does (it has its own store on 127.0.0.1).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launcher(name: str) -> str | None:
    """The launcher variable ``name`` (one of ``LAUNCHER_VARIABLES``) as set now, or None."""
    if name not in LAUNCHER_VARIABLES:
        raise KeyError(f"{name!r} is not a launcher variable: one of {LAUNCHER_VARIABLES}")
    return os.environ.get(name)


# Variables outside hf_paged's switches that a result file records beside them, because they
# change how a run's output reaches its log (``benchmarks``' environment record).
RECORDED_VARIABLES = ("PYTHONUNBUFFERED",)


def recorded() -> dict[str, str | None]:
    """Each of ``RECORDED_VARIABLES`` as set now (None: unset), keyed by its lower-case name."""
    return {name.lower(): os.environ.get(name) for name in RECORDED_VARIABLES}


# Set in every tensor-parallel worker, and in rank 0 before it starts them, unless the user's
# environment already sets them: NVLink multicast (NVLS) stays off in NCCL, torch's symmetric
# memory and NVSHMEM, because a program using multicast can take a shared host's GPUs out of
# service. Each rank's NCCL reads its own environment when its group is created, so every rank
# of one engine gets the same values (a spawned worker would otherwise inherit whatever rank 0's
# environment held when it was started).
WORKER_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def worker_environment() -> dict[str, str]:
    """The variables a spawned tensor-parallel worker must set: each of ``WORKER_ENV_DEFAULTS``
    that is not set in this process's environment (a value the user set, even "1", wins)."""
    return {name: value for name, value in WORKER_ENV_DEFAULTS.items() if name not in os.environ}


def set_environment(values: dict[str, str]) -> None:
    """Set ``values`` in this process's environment (from :func:`worker_environment`).

    Raises:
        ValueError: a name that is not one of ``WORKER_ENV_DEFAULTS``.
    """
    for name in values:
        if name not in WORKER_ENV_DEFAULTS:
            raise ValueError(
                f"set_environment: {name!r} is not allowed: only {list(WORKER_ENV_DEFAULTS)}"
            )
    os.environ.update(values)


def child_environment(drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
    """This process's environment for a child process: a copy with ``values`` set and the
    names in ``drop`` removed (this process's environment is not changed)."""
    env = {**os.environ, **values}
    for name in drop:
        env.pop(name, None)
    return env
