"""Batch generation over a ``datasets.Dataset`` with ``Dataset.map``: one engine run per map batch.

Recipe::

    from datasets import Dataset
    from hf_paged.entrypoints.datasets_map import paged_generate_map

    ds = Dataset.from_dict({"prompt": ["Hello", "The capital of France is"]})
    fn = paged_generate_map("path/to/ckpt", column="prompt", output_column="generated",
                            batch_size=256, max_new_tokens=32, do_sample=False,
                            paged_config={"max_num_seqs": 64})
    ds = ds.map(fn, **fn.map_kwargs)        # batched=True, batch_size=256
    print(ds[0]["generated"])
    fn.close()                              # frees the engine (a path was given)

Each row gets what ``model.generate(**tokenizer(row, return_tensors="pt"), **generate_kwargs)``
would give it alone (its new tokens, decoded with ``skip_special_tokens=True``): stock
``generate`` prepares every row (defaults, validation, processors) and the engine samples all
rows of the map batch together, continuous batching them, with a tqdm bar over generated tokens
(shown only on a terminal).
Generate options the engine cannot sample itself (user logits processors or stopping criteria,
a streamer, ...) make the whole map batch one left-padded ``generate(backend="paged")`` call
instead: then a row gets what stock batched ``generate`` gives it in that padded batch.

Keep ``num_proc`` unset: the function holds an engine, which can't be sent to other processes
(``Dataset.map(num_proc=...)`` raises a RuntimeError saying so).
Dataset caching sees a new function each time ``paged_generate_map`` is called (the model is not
hashed).
"""

from __future__ import annotations

import os
import re
import uuid
import warnings

import numpy as np
import torch
from tqdm.auto import tqdm

from hf_paged.engine.core.request import budget
from hf_paged.integration import dispatch, servable
from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.loras import active_lora_key
from hf_paged.integration.plan import PlanCache
from hf_paged.integration.route import Beams, External, Native, route


def paged_generate_map(
    model_or_path,
    tokenizer=None,
    column: str = "prompt",
    output_column: str = "generated",
    batch_size: int = 256,
    *,
    paged_config: dict | None = None,
    use_tqdm: bool = True,
    **generate_kwargs,
) -> PagedGenerateMap:
    """A function for ``Dataset.map(fn, batched=True)`` that generates for every row.

    Args:
        model_or_path: a local checkpoint directory (opened with
            ``AutoPagedModelForCausalLM``; the HF model is never loaded), a
            ``PagedModelForCausalLM``, or a loaded HF causal LM (its dispatcher engine is used).
        tokenizer: defaults to the one saved beside the checkpoint (a path only).
        column: input column: strings, chats (lists of ``{"role", "content"}`` dicts; the chat
            template is applied with a generation prompt) or lists of token ids, in any
            ``Dataset.with_format`` (python, numpy, torch, arrow, pandas).
        output_column: column the decoded new text goes to.
        batch_size: rows per map batch, i.e. per engine run; ``fn.map_kwargs`` holds it.
        paged_config: EngineConfig keys for the engine (a path or a loaded model).
        use_tqdm: a progress bar over each map batch's generated tokens (on a terminal only).
        **generate_kwargs: ``generate`` options (``max_new_tokens``, ``do_sample`` ...);
            ``generate`` also gets ``tokenizer`` (stop strings need it).

    Raises:
        ValueError / TypeError: a bad argument (named in the message).
    """
    return PagedGenerateMap(
        model_or_path, tokenizer, column, output_column, batch_size, paged_config, use_tqdm,
        generate_kwargs,
    )  # fmt: skip


class PagedGenerateMap:
    """The callable ``paged_generate_map`` returns: ``fn(batch: dict[str, list]) -> {output_column:
    list[str]}``. ``fn.map_kwargs`` are the ``Dataset.map`` keywords it is meant for."""

    def __init__(
        self, model_or_path, tokenizer, column, output_column, batch_size, paged_config,
        use_tqdm, generate_kwargs,
    ):  # fmt: skip
        from hf_paged.integration.auto import AutoPagedModelForCausalLM, PagedModelForCausalLM

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is not allowed: must be an int >= 1")
        for name, value in (("column", column), ("output_column", output_column)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}={value!r} is not allowed: must be a column name")
        self._owned = False
        self._paged_config = paged_config
        if isinstance(model_or_path, (str, os.PathLike)):
            model = AutoPagedModelForCausalLM.from_pretrained(model_or_path, **(paged_config or {}))
            self._owned = True
        elif isinstance(model_or_path, PagedModelForCausalLM) or hasattr(model_or_path, "generate"):
            model = model_or_path
        else:
            raise TypeError(
                f"model_or_path={type(model_or_path).__name__} is not allowed: pass a checkpoint "
                "directory, a PagedModelForCausalLM or a loaded transformers causal LM"
            )
        self.model = model
        self._paged = isinstance(model, PagedModelForCausalLM)
        if tokenizer is None:
            tokenizer = model.tokenizer if self._paged else None
        if tokenizer is None:
            raise ValueError("tokenizer=None is not allowed here: pass the model's tokenizer")
        if not self._paged:
            refusal = servable.generate_refusal(model, {}, {})
            if refusal is not None:
                raise ValueError(f"this model can't run on the paged engine: {refusal.detail}")
        self.tokenizer = tokenizer
        self.column = column
        self.output_column = output_column
        self.use_tqdm = use_tqdm
        # stop strings need the tokenizer in generate; this function's own takes the name
        self.generate_kwargs = {"tokenizer": tokenizer, **generate_kwargs}
        self.map_kwargs = {"batched": True, "batch_size": batch_size}
        self._warned: set[tuple[type, str]] = set()  # warnings said already (_warn_once)
        self._token = uuid.uuid4().hex  # what dataset fingerprinting sees instead of the model

    def __call__(self, batch: dict) -> dict:
        if not hasattr(batch, "keys") and not hasattr(batch, "column_names"):  # pyarrow: no keys
            raise TypeError(
                f"batch={type(batch).__name__} is not allowed: this function takes the batch's "
                "columns by name (a dict); call ds.map(fn, **fn.map_kwargs) without input_columns"
            )
        names = list(getattr(batch, "column_names", None) or batch.keys())
        if self.column not in names:
            raise ValueError(
                f"column={self.column!r} is not allowed: the dataset's columns are {sorted(names)}"
            )
        rows = _as_list(batch[self.column])
        if not isinstance(rows, list) or (
            rows
            and (all(isinstance(r, int) for r in rows) or all(isinstance(r, dict) for r in rows))
        ):
            # one row (a string, a chat, a list of ids), not a batch: Dataset.map without batched
            shown = repr(rows) if len(repr(rows)) <= 60 else repr(rows)[:57] + "..."
            raise ValueError(
                f"{self.column}={shown} is one row, not a batch: this function needs "
                "batched=True; call ds.map(fn, **fn.map_kwargs) (batched=True, "
                f"batch_size={self.map_kwargs['batch_size']})"
            )
        prompts = [self._encode(row, i) for i, row in enumerate(rows)]
        if not prompts:
            return {self.output_column: []}
        new_tokens = self._generate(prompts)
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in new_tokens]
        return {self.output_column: texts}

    def _encode(self, row, index: int) -> list[int]:
        if _is_ids_array(row):  # a row of a column formatted as numpy or torch
            row = row.tolist()
        elif isinstance(row, np.ndarray) and row.dtype == object:  # a chat, formatted as numpy
            row = list(row)
        if isinstance(row, str):
            return self.tokenizer(row)["input_ids"]
        if isinstance(row, list) and row and all(isinstance(m, dict) for m in row):
            out = self.tokenizer.apply_chat_template(row, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        if isinstance(row, list) and row and all(isinstance(t, int) for t in row):
            return row
        raise ValueError(
            f"{self.column}[{index}]={row!r} is not allowed: rows must be strings, chats (lists "
            "of role/content dicts) or non-empty lists of token ids"
        )

    # ---- one engine run per map batch --------------------------------------------------------

    def _prep_model(self):
        return self.model._skeleton if self._paged else self.model

    def _engine(self):
        if self._paged:
            return self.model.engine
        return dispatch.get_engine(self.model, self._paged_config)

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        engine = self._engine()
        plans = PlanCache()  # rows with the same options are prepared once
        try:
            # stock's preparation runs once per row: its warnings are said once (see _warn_once)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                calls = [
                    route(self._prep_model(), self._kwargs(p), lambda: engine, cache=plans)
                    for p in prompts
                ]
            self._warn_once(caught)
        except PagedFallback as fb:
            raise NotImplementedError(
                f"paged_generate_map cannot run these generate options: {fb.detail} [{fb.reason}]"
            ) from None
        if any(_generations_per_row(c) != 1 for c in calls):
            raise ValueError(
                f"num_return_sequences={self.generate_kwargs.get('num_return_sequences')} is not "
                "allowed: paged_generate_map writes one generation per row"
            )
        if not all(isinstance(c, Native) for c in calls):
            # a call that observes steps (streamer, scores) samples outside the engine
            return self._generate_padded(prompts)
        # one request per row, seeded as generate() seeds them
        requests = [c.requests[0] for c in calls]
        key = active_lora_key(self.model, engine)  # a PEFT model's active adapters
        for r in requests:
            r.lora_key = key
        total = sum(budget(r.params) for r in requests)
        # disable=None: no bar when stderr is not a terminal, so logs get no cursor-up codes
        # from a bar nested under Dataset.map's own
        bar = tqdm(total=total, desc="hf_paged generate", unit="tok", leave=False,
                   disable=None if self.use_tqdm else True)  # fmt: skip
        try:
            outs = engine.run(requests, progress=bar.update)
        finally:
            bar.close()
        return [o.outputs[0].token_ids for o in outs]

    def _warn_once(self, caught: list[warnings.WarningMessage]) -> None:
        """Say each warning of stock's per-row preparation once for this function, not once per
        row or per prompt length: warnings that differ only in their numbers (``max_length
        (=44)``, ``(=45)``, ...) are one. They go through the caller's warning filters."""
        for w in caught:
            key = (w.category, re.sub(r"\d+", "N", str(w.message)))
            if key in self._warned:
                continue
            self._warned.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

    def _kwargs(self, prompt: list[int]) -> dict:
        """``generate``'s keywords for this row alone (stock prepares them: defaults,
        validation, processors, criteria; no model run)."""
        device = self.model.device
        return {
            "input_ids": torch.tensor([prompt], device=device),
            "attention_mask": torch.ones(1, len(prompt), dtype=torch.long, device=device),
            **self.generate_kwargs,
        }

    def _generate_padded(self, prompts: list[list[int]]) -> list[list[int]]:
        """One left-padded paged ``generate`` call for the whole map batch."""
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else pad
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kwargs = dict(self.generate_kwargs)
        kwargs.setdefault("pad_token_id", pad)
        if not self._paged:
            if not dispatch.is_installed():
                raise RuntimeError(
                    "these generate options need generate(backend='paged'): call "
                    "hf_paged.install() first (import hf_paged does)"
                )
            kwargs.update(backend="paged", paged_config=self._paged_config)
        device = self.model.device
        out = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs
        )
        out = out if isinstance(out, torch.Tensor) else out.sequences
        return [row[width:].tolist() for row in out]

    # ---- lifecycle / pickling ---------------------------------------------------------------

    def close(self) -> None:
        """Free the engine if this function opened it from a path."""
        if self._owned:
            self.model.close()

    def __reduce__(self):
        # datasets hashes the map function by pickling it: hash a token, never the model
        return (_SentToAnotherProcess, (self._token,))


def _is_ids_array(x) -> bool:
    """A 1-D numpy array or torch tensor of integers."""
    if isinstance(x, torch.Tensor):
        return x.ndim == 1 and not x.is_floating_point() and not x.is_complex()
    return isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind in "iu"


def _as_list(rows):
    """A batch's column as a list of rows: ``Dataset.with_format`` gives a pyarrow array
    ("arrow"), a pandas Series ("pandas"), a 2-D array of equal-length ids, a 1-D array of
    strings or of ragged rows ("numpy"), or a list of 1-D tensors ("torch"). A 1-D array of ids
    is one row: returned as it is."""
    if hasattr(rows, "to_pylist"):  # pyarrow
        return rows.to_pylist()
    if type(rows).__name__ == "Series" and hasattr(rows, "tolist"):  # pandas
        return rows.tolist()
    if isinstance(rows, (np.ndarray, torch.Tensor)) and rows.ndim == 2:
        return rows.tolist()
    if isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype.kind in "OUS":
        return [str(r) if isinstance(r, np.str_) else r for r in rows]
    return rows


def _generations_per_row(way: Native | External | Beams) -> int:
    """Outputs one row's ``generate`` call returns (a beam call's rows are its beams)."""
    if isinstance(way, Native):
        return way.input_ids.shape[0]
    return way.call.generation_config.num_return_sequences


class _SentToAnotherProcess:
    """What a ``PagedGenerateMap`` becomes in another process: calling it raises. (Raising while
    unpickling killed ``Dataset.map(num_proc=...)``'s workers, and the parent only said that a
    subprocess died; an error raised by the call reaches the parent as it is.)"""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            "a PagedGenerateMap can't be sent to another process (it holds an engine): "
            "call Dataset.map without num_proc"
        )
