"""``generate(backend="paged")``: one HF ``generate`` call run on the paged engine.

The call is prepared with HF's own machinery, in stock ``generate``'s order
(``_prepare_generation_config`` -> ``_prepare_model_inputs`` -> ``_prepare_special_tokens`` ->
attention mask -> ``_expand_inputs_for_generation`` -> ``_prepare_generated_length`` ->
``_get_logits_processor`` / ``_get_stopping_criteria``), so defaults, validation errors and the
processors it builds are stock's by construction. Each row's prompt is its attended tokens.

Then one of two paths:

* native: the processors and criteria are ones the engine's sampler implements (greedy or
  temperature/top-k/top-p/min-p sampling, repetition penalty, min length, EOS, max length) and the
  caller observes nothing per step (no user processors/criteria, streamer, scores or logits). Each
  row is an ordinary engine request; seeds for sampled rows come from torch's global RNG.
* external: every row is an external-sampling request. Each step gathers all open rows' raw
  logits into ``[B, V]`` and runs exactly stock ``_sample``'s loop body on it: processors,
  multinomial or argmax, pad for finished rows, stopping criteria, streamer.

Anything neither path can reproduce raises ``PagedFallback`` before the engine is touched (or
before any request is added), and the dispatcher runs stock ``generate`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    GenerationMode,
    LogitsProcessorList,
    StoppingCriteriaList,
)

from hf_paged.config import SamplingParams
from hf_paged.integration.sampling import NativePlan, native_plan

# model kwargs a paged call can take: everything else (position_ids, token_type_ids, pixel
# values ...) changes what the model computes, so the call runs stock
_MODEL_KWARGS = frozenset({"attention_mask", "use_cache", "logits_to_keep"})


class PagedFallback(Exception):
    """This call must run stock ``generate``. ``reason`` is a short key (one warning per key per
    process); ``detail`` says why in words."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class PreparedCall:
    """One generate call, prepared as stock prepares it (rows already repeated for
    ``num_return_sequences``)."""

    input_ids: torch.Tensor  # [B, L] as given, padding included
    prompts: list[list[int]]  # per row: the attended tokens (the engine's prompt)
    generation_config: object  # prepared GenerationConfig (final max_length, special tensors)
    processors: LogitsProcessorList  # HF-built, user processors merged in
    criteria: StoppingCriteriaList  # HF-built, user criteria merged in
    streamer: object | None
    user_processors: bool  # the caller passed logits processors: they see every row's logits
    user_criteria: bool  # the caller passed stopping criteria
    left_padded: bool  # every row is [pads..., tokens...]

    @property
    def wants_scores(self) -> bool:
        gen = self.generation_config
        return bool(gen.return_dict_in_generate and (gen.output_scores or gen.output_logits))

    @property
    def observed(self) -> bool:
        """The caller sees every step (so the engine must not sample on its own)."""
        return (
            self.user_processors
            or self.user_criteria
            or self.streamer is not None
            or self.wants_scores
        )

    @property
    def max_new_tokens(self) -> int:
        """Steps stock's loop runs at most (at least one; a user MaxLengthCriteria wins)."""
        max_length = self.criteria.max_length
        if max_length is None:
            max_length = self.generation_config.max_length
        return max(1, max_length - self.input_ids.shape[1])

    @property
    def pad_token_id(self) -> int | None:
        pad = self.generation_config._pad_token_tensor
        return None if pad is None else int(pad)


def prepare_call(
    model,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    streamer=None,
    **kwargs,
) -> PreparedCall:
    """Stock ``generate``'s steps 1-8 for a decoder-only call, without running the model.

    Raises:
        PagedFallback: the call needs something only stock ``generate`` does.
        ValueError / TypeError: whatever stock raises for the same arguments.
    """
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    defaults = {  # has_default_max_length / has_default_min_length, as stock computes them
        name: kwargs.get(name) is None
        and (generation_config is None or getattr(generation_config, name) is None)
        and getattr(model.generation_config, name) is None
        for name in ("max_length", "min_length")
    }
    gen, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _check_generation_config(gen)
    model._validate_model_kwargs(model_kwargs.copy())
    mode_kwargs = {k: v for k, v in (("tokenizer", tokenizer), ("streamer", streamer)) if v}
    model._validate_generation_mode(gen.get_generation_mode(None), gen, mode_kwargs)
    inputs_tensor, mask = _prepare_prompt(model, gen, inputs, model_kwargs)

    input_ids, expanded = model._expand_inputs_for_generation(
        input_ids=inputs_tensor,
        expand_size=gen.num_return_sequences,
        is_encoder_decoder=False,
        attention_mask=mask,
    )
    mask, length = expanded["attention_mask"], input_ids.shape[1]  # [B, L]
    gen = model._prepare_generated_length(
        generation_config=gen,
        has_default_max_length=defaults["max_length"],
        has_default_min_length=defaults["min_length"],
        model_input_name="input_ids",
        inputs_tensor=inputs_tensor,
        input_ids_length=length,
    )
    model._validate_generated_length(gen, length, defaults["max_length"])
    all_ones = bool((mask == 1).all())  # stock drops an all-ones mask before building processors
    processors = model._get_logits_processor(
        generation_config=gen,
        input_ids_seq_length=length,
        encoder_input_ids=inputs_tensor,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=LogitsProcessorList() if logits_processor is None else logits_processor,
        device=inputs_tensor.device,
        model_kwargs={"attention_mask": None if all_ones else mask},
    )
    criteria = model._get_stopping_criteria(
        generation_config=gen,
        stopping_criteria=StoppingCriteriaList()
        if stopping_criteria is None
        else stopping_criteria,
        tokenizer=tokenizer,
    )
    keep = mask.bool()
    return PreparedCall(
        input_ids=input_ids,
        prompts=[row[k].tolist() for row, k in zip(input_ids, keep, strict=True)],
        generation_config=gen,
        processors=processors,
        criteria=criteria,
        streamer=streamer,
        user_processors=bool(logits_processor),
        user_criteria=bool(stopping_criteria),
        left_padded=bool((keep[:, 1:] >= keep[:, :-1]).all()),
    )


def _prepare_prompt(model, gen, inputs, model_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], attention_mask [B, L])`` as stock builds them (a missing mask is
    inferred from the pad id); sets the config's special-token tensors."""
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(
        inputs, gen.bos_token_id, model_kwargs
    )
    if input_name != "input_ids" or inputs_tensor.dim() != 2:
        raise PagedFallback("inputs_embeds", "the prompt is not a 2-D input_ids tensor")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if extra:
        raise PagedFallback("model_kwargs", f"model inputs {extra} are passed to the forward")
    mask = model_kwargs.get("attention_mask")
    model._prepare_special_tokens(
        gen, mask is not None, device=inputs_tensor.device, batch_size=inputs_tensor.shape[0]
    )
    if mask is None:
        mask = model._prepare_attention_mask_for_generation(inputs_tensor, gen, model_kwargs)
    elif mask.dim() > 2:
        raise ValueError("`attention_mask` passed to `generate` must be 2D.")
    if mask.shape != inputs_tensor.shape:
        raise PagedFallback("attention_mask", "attention_mask's shape differs from input_ids'")
    if inputs_tensor.shape[1] == 0 or bool((mask.sum(dim=-1) == 0).any()):
        raise PagedFallback("empty_prompt", "a row has no attended token")
    if bool((mask[:, -1] == 0).any()):
        # stock gives a right-padded row a pad query and restarts its positions after the pads:
        # no paged engine can reproduce that, so those calls run stock
        raise PagedFallback("right_padding", "the input is right padded")
    return inputs_tensor, mask


def _check_generation_config(gen) -> None:
    mode = gen.get_generation_mode(None)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise PagedFallback(mode.value, f"the generation mode is {mode.value}")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(gen, flag, False):
            raise PagedFallback(flag, f"{flag}=True needs the model's own forward")
    if gen.guidance_scale is not None and gen.guidance_scale != 1:
        raise PagedFallback("guidance_scale", "classifier-free guidance runs a second model pass")
    if getattr(gen, "token_healing", False):
        raise PagedFallback("token_healing", "token_healing rewrites the prompt")


def check_fits(call: PreparedCall, engine, native: bool) -> None:
    """PagedFallback when the engine would cut a row short or (external path) could not hold
    the whole batch's KV at once."""
    max_new = call.max_new_tokens
    longest = max(len(p) for p in call.prompts) + max_new
    if longest > engine.runtime.max_model_len:
        raise PagedFallback(
            "max_model_len",
            f"a row may reach {longest} tokens, over the engine's max_model_len="
            f"{engine.runtime.max_model_len}",
        )
    if native:
        return
    block = engine.config.kv_block_size
    need = sum(math.ceil((len(p) + max_new) / block) for p in call.prompts)
    if need > engine.runtime.num_kv_blocks:
        # every row of a step must be paused at once holding its KV; more would thrash
        raise PagedFallback(
            "kv_cache",
            f"the batch needs up to {need} KV blocks at once, the engine has "
            f"{engine.runtime.num_kv_blocks}",
        )


def generate_paged(model, get_engine: Callable[[], object], **generate_kwargs):
    """Run one ``generate`` call (stock's arguments, already bound by name) on the engine.

    Returns:
        What stock returns: the ``[B, L + T]`` sequences tensor, or a
        ``GenerateDecoderOnlyOutput`` (``cache=None``) with ``return_dict_in_generate``.

    Raises:
        PagedFallback: before any request is queued.
    """
    call = prepare_call(model, **generate_kwargs)
    engine = get_engine()
    plan = None if call.observed else native_plan(call, engine.runtime.vocab_size)
    check_fits(call, engine, native=plan is not None)
    with torch.no_grad():
        if plan is not None:
            sequences, scores, logits = _run_native(engine, call, plan), None, None
        else:
            sequences, scores, logits = _run_external(engine, call)
    gen = call.generation_config
    if not gen.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, cache=None)


class _Batch:
    """The engine requests of one call. On an error every open one is aborted and drained, so
    the engine stays usable."""

    def __init__(self, engine):
        self.engine = engine
        self.rids: list = []
        self.outputs: dict = {}  # request_id -> RequestOutput once the engine reported it

    def add(self, prompts: list[list[int]], params: list[SamplingParams], external: bool):
        for prompt, p in zip(prompts, params, strict=True):
            self.rids.append(self.engine.add_request(prompt, p, external_sampling=external))

    def step(self):
        res = self.engine.step()
        for out in res.finished:
            self.outputs[out.request_id] = out
        return res

    def close(self, rid) -> None:
        """End ``rid`` now (paused or not); the engine reports it by a later step."""
        if rid not in self.outputs:
            self.engine.abort(rid)

    def drain(self) -> None:
        while any(r not in self.outputs for r in self.rids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine lost requests of this generate call")
            self.step()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return
        try:
            for rid in self.rids:
                self.close(rid)
            self.drain()
        except Exception:  # the original error matters more than a failed cleanup
            pass


def _run_native(engine, call: PreparedCall, plan: NativePlan) -> torch.Tensor:
    """Engine-sampled rows -> ``[B, L + T]`` (rows that stopped early padded like stock)."""
    n = len(call.prompts)
    seeds = [None] * n
    if plan.temperature > 0:  # draw from torch's global RNG: torch.manual_seed reproduces a call
        seeds = torch.randint(0, 2**62, (n,)).tolist()
    with _Batch(engine) as batch:
        batch.add(call.prompts, [plan.sampling_params(s) for s in seeds], external=False)
        batch.drain()
    new = [batch.outputs[r].outputs[0].token_ids for r in batch.rids]
    width = max(len(t) for t in new)
    pad = call.pad_token_id if call.pad_token_id is not None else 0  # unequal only with an EOS
    ids = call.input_ids
    out = torch.full((n, ids.shape[1] + width), pad, dtype=ids.dtype, device=ids.device)
    out[:, : ids.shape[1]] = ids
    for i, toks in enumerate(new):
        out[i, ids.shape[1] : ids.shape[1] + len(toks)] = torch.tensor(toks, dtype=ids.dtype)
    return out


def _collect_logits(batch: _Batch, rids: list, budget: int) -> dict:
    """Step until every request in ``rids`` has its next-token logits; ``{rid: [V] float32}``."""
    want, got = set(rids), {}
    for _ in range(budget):
        if want <= got.keys():
            return got
        res = batch.step()
        for rid, row in res.logits.items():
            if rid in want:
                got[rid] = row  # a preempted request reports again: the same values
        ended = [r for r in want if r in batch.outputs]
        if ended:
            out = batch.outputs[ended[0]]
            raise RuntimeError(
                f"the engine ended request {ended[0]!r} itself "
                f"(finish_reason={out.outputs[0].finish_reason!r})"
            )
    if want <= got.keys():
        return got
    raise RuntimeError(f"the engine made no progress on {len(want - got.keys())} request(s)")


def _run_external(engine, call: PreparedCall):
    """Stock ``_sample``'s loop with the engine as the model: ``(sequences, scores, logits)``."""
    gen, input_ids = call.generation_config, call.input_ids  # [B, L]
    n, dev = input_ids.shape[0], input_ids.device
    pad = gen._pad_token_tensor
    pad = pad.to(dev) if pad is not None else None
    scores = () if gen.return_dict_in_generate and gen.output_scores else None
    raw_logits = () if gen.return_dict_in_generate and gen.output_logits else None
    has_eos = any(hasattr(c, "eos_token_id") for c in call.criteria)
    # stock keeps feeding finished rows pad tokens; only scores/logits and user processors
    # can tell, so otherwise a finished row (its tokens are pad from now on) leaves the engine
    feed_finished = call.wants_scores or call.user_processors
    unfinished = torch.ones(n, dtype=torch.long, device=dev)
    open_rows = list(range(n))
    params = SamplingParams(temperature=0.0, max_tokens=call.max_new_tokens)
    prompt_tokens = sum(len(p) for p in call.prompts)
    with _Batch(engine) as batch:
        batch.add(call.prompts, [params] * n, external=True)
        if call.streamer is not None:
            call.streamer.put(input_ids.cpu())
        for step in range(call.max_new_tokens):
            # steps a round may take: every row recomputed once (preemption), plus slack
            budget = prompt_tokens + n * (step + 2) + 16
            next_token_logits = _gather_logits(batch, open_rows, n, budget).to(dev)  # [B, V]
            next_token_scores = call.processors(input_ids, next_token_logits)  # [B, V]
            if scores is not None:
                scores += (next_token_scores,)
            if raw_logits is not None:
                raw_logits += (next_token_logits,)
            next_tokens = _select(next_token_scores, gen.do_sample, open_rows)  # [B]
            if has_eos:
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished = unfinished & ~call.criteria(input_ids, scores)
            if call.streamer is not None:
                call.streamer.put(next_tokens.cpu())
            done = bool(unfinished.max() == 0)
            tokens = next_tokens.tolist()
            for i in list(open_rows):
                if done or (has_eos and not feed_finished and not unfinished[i]):
                    batch.close(batch.rids[i])  # its later tokens are pad: stop it
                    open_rows.remove(i)
                else:
                    engine.provide_token(batch.rids[i], tokens[i])
            if done:
                break
        for rid in batch.rids:  # a criteria list without max_length: stop where stock would
            batch.close(rid)
        batch.drain()
    if call.streamer is not None:
        call.streamer.end()
    return input_ids, scores, raw_logits


def _gather_logits(batch: _Batch, open_rows: list[int], n: int, budget: int) -> torch.Tensor:
    """``[B, V]`` raw next-token logits; rows no longer in the engine get zeros."""
    got = _collect_logits(batch, [batch.rids[i] for i in open_rows], budget)
    vocab = next(iter(got.values())).shape[-1]
    rows = [got.get(batch.rids[i]) for i in range(n)]
    return torch.stack([r if r is not None else torch.zeros(vocab) for r in rows])


def _select(scores: torch.Tensor, do_sample: bool, open_rows: list[int]) -> torch.Tensor:
    """Stock's token choice on ``[B, V]`` processed scores: multinomial (torch's global RNG) or
    argmax. Rows that left the engine become pad afterwards; they draw from a valid uniform."""
    n = scores.shape[0]
    if len(open_rows) < n:
        closed = torch.ones(n, dtype=torch.bool, device=scores.device)
        closed[open_rows] = False
        scores = scores.masked_fill(closed[:, None], 0.0)
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)
