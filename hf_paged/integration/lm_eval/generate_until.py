"""HFLM.generate_until on the paged engine (see ``install.py`` for when it is used).

Stock (``lm_eval/models/huggingface.py``) sorts the requests by context length, groups them by
gen_kwargs, tokenizes each batch with ``tok_batch_encode`` (left padding, left truncation to
``max_length - max_gen_toks``), calls ``model.generate(max_length=width + max_gen_toks, do_sample,
stopping_criteria=one MultiTokenEOSCriteria per stop string, pad_token_id)`` and cuts each decoded
row at the first occurrence of every stop string. Here the same sort, groups, batches and
tokenization give each row's prompt (its attended tokens); every row then runs in one engine
run, stopping at its own EOS, stop strings or ``max_gen_toks``, and is cut the same way. A row
that stock keeps generating after its stop (batch-mates still running) is cut at the same
place, so the text is the same. An empty stop string (a task's, or an EOS whose text is '') is
in every decoding: stock's criterion ends every row after its first token, and so does the row here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hf_paged.engine.core.request import EngineRequest
from hf_paged.integration.lm_eval.serving import owner_for, run_requests
from hf_paged.integration.lm_eval.stop_text import until_matcher
from hf_paged.integration.loras import active_lora_key
from hf_paged.integration.plan import PlanCache
from hf_paged.integration.route import Native, route
from hf_paged.refusal import Refusal

_NOT_NATIVE = Refusal("logits_processor", "the call needs processors the engine lacks")


@dataclass
class _Row:
    context: str
    gen_kwargs: dict  # as the request gave them (the cache key)
    until: list[str]  # stop strings, EOS text included (it may decode to '')
    stops: tuple[str, ...]  # the non-empty ones, matched during generation
    prompt: list[int]
    kwargs: dict  # the generate keywords stock's HFLM._model_generate would pass for the row
    max_gen_toks: int


def generate_until(lm, requests, disable_tqdm: bool) -> list[str] | Refusal:
    """The generated strings, in request order; or, before anything runs, the ``Refusal`` of
    requests that need stock ``generate`` (``route`` raises a call's own as ``PagedFallback``).
    """
    from lm_eval.models.utils import Collator, postprocess_generated_text

    re_ords = Collator(
        [req.args for req in requests],
        sort_fn=lambda req: (-len(lm.tok_encode(req[0])), req[0]),
        group_by="gen_kwargs",
        group_fn=lambda x: x[1],
    )
    batch_size = lm.batch_size if isinstance(lm.batch_size, int) else 1
    rows: list[_Row] = []
    for chunk in re_ords.get_batched(n=batch_size, batch_fn=None):
        batch = _rows(lm, chunk)
        if isinstance(batch, Refusal):
            return batch
        rows.extend(batch)
    owner = owner_for(lm, max(len(r.prompt) + r.max_gen_toks for r in rows))
    if isinstance(owner, Refusal):
        return owner
    with owner.hold() as held:
        engine = held.get()
        requests = _requests(lm, engine, rows)
        if isinstance(requests, Refusal):
            return requests
        key = active_lora_key(lm.model, engine)  # a PEFT model's active adapters
        for r in requests:
            r.lora_key = key
        outs = run_requests(
            engine, requests, "Running generate_until requests (paged)",
            disable_tqdm or lm.rank != 0,
        )  # fmt: skip
    think = lm.think_end_token
    res = []
    for row, out in zip(rows, outs, strict=True):
        cont = list(out.token_ids)
        if isinstance(think, int) and think in cont:
            cont = cont[len(cont) - cont[::-1].index(think) :]
        text = lm.tok_decode(cont)
        if isinstance(think, int):
            text = text.lstrip()
        text = postprocess_generated_text(
            generation=text,
            stop=row.until,
            think_end_token=think if isinstance(think, str) else None,
        )
        res.append(text)
        lm.cache_hook.add_partial("generate_until", (row.context, row.gen_kwargs), text)
    return re_ords.get_original(res)


def _rows(lm, chunk) -> list[_Row] | Refusal:
    """One stock batch: its gen_kwargs as stock reads them, its rows' prompts (or why it runs
    stock)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    contexts, all_gen_kwargs = zip(*chunk, strict=True)
    gen_kwargs = all_gen_kwargs[0]  # one group: every row has the same
    kwargs = normalize_gen_kwargs(gen_kwargs, lm.max_gen_toks)
    eos = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = kwargs.pop("max_gen_toks")
    max_ctx_len = lm.max_length - max_gen_toks
    if max_ctx_len <= 0:
        raise ValueError(
            f"max_gen_toks={max_gen_toks} is not allowed: it must be less than the model's "
            f"max_length ({lm.max_length})"
        )
    if "max_length" in kwargs:
        return Refusal("max_length", "max_length in gen_kwargs counts from the padded batch")
    _model_generate_kwargs(kwargs)
    stops = tuple(s for s in until if s)  # stock skips '' when it trims
    ids, mask = lm.tok_batch_encode(
        list(contexts), left_truncate_len=max_ctx_len, truncation=lm.truncation
    )  # [B, W] left padded
    return [
        _Row(context, gen_kwargs, until, stops, row[keep].tolist(), kwargs, max_gen_toks)
        for context, row, keep in zip(contexts, ids, mask.bool(), strict=True)
    ]


def _model_generate_kwargs(kwargs: dict) -> None:
    """HFLM._model_generate's handling of temperature / do_sample, in place."""
    kwargs["temperature"] = kwargs.get("temperature", 0.0)
    do_sample = kwargs.get("do_sample")
    if kwargs["temperature"] == 0.0 and do_sample is None:
        kwargs["do_sample"] = do_sample = False
    if do_sample is False and kwargs["temperature"] == 0.0:
        kwargs.pop("temperature")


def _requests(lm, engine, rows: list[_Row]) -> list[EngineRequest] | Refusal:
    """One engine request per row: stock's ``model.generate`` call on the row alone, routed
    (``route``, one preparation per distinct set of options) and taken in the form the engine
    takes, with lm-eval's stop rule as its stop-string matcher; or the ``Refusal`` of a row
    whose call the engine does not sample itself."""
    plans = PlanCache()
    out = []
    for row in rows:
        ids = torch.tensor([row.prompt], dtype=torch.long, device=lm.device)
        # stock's limit, max_length (the model's generation config may override it, as in
        # stock); '' is in every text: stock's criterion ends the row at its first token
        budget = 1 if "" in row.until else row.max_gen_toks
        routed = route(lm.model, {
            "input_ids": ids, "attention_mask": torch.ones_like(ids),
            "max_length": len(row.prompt) + budget,
            "pad_token_id": lm.tokenizer.pad_token_id, "use_cache": True, **row.kwargs,
        }, lambda: engine, cache=plans)  # fmt: skip
        if not isinstance(routed, Native):
            return _NOT_NATIVE
        req = routed.requests[0]
        if row.stops and "" not in row.until:  # lm-eval's stop rule, not HF's stop strings
            req = dataclasses.replace(
                req, params=dataclasses.replace(req.params, stop=row.stops),
                stop_strings=until_matcher(lm.tokenizer, row.stops, len(row.prompt)),
            )  # fmt: skip
        out.append(req)
    return out
