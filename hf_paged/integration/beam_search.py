"""Beam search and beam sampling of one ``generate`` call on the paged engine.

Stock ``_beam_search`` keeps ``B * num_beams`` rows of KV cache and reorders them every step.
Here each prompt row is one engine request whose sequences are its beams: they share the
prompt's KV blocks, and a beam continued by several new beams is forked, copy-on-write
(``LLMEngine.provide_beams``). Each step gathers the beams' raw next-token logits into
``[B * num_beams, V]`` and runs stock's loop body on them, on the device, for every row at once,
through the model's own helpers (``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic``, ``_beam_search_has_unfinished_sequences``): length penalty,
``early_stopping`` True / False / "never", EOS lists and every processor stock applies to the
log-softmaxed scores are stock's by construction, in each transformers version's own form. Then
one ``provide_beams`` call tells the engine every new beam's parent and token.

Before the first selection a request has one sequence (the prompt is prefilled once); stock's
``num_beams`` identical copies of it get its logits, and every first beam is its fork.

Beam sampling draws in ``_get_top_k_continuations`` from torch's global RNG exactly as stock
does (one ``multinomial`` over ``[B, num_beams * V]`` per step, and nothing else draws), so a
call seeded like stock's makes the same draws; the samples are stock's wherever the engine's
logits are close enough to stock's that no draw lands between the two (on one device type: the
CPU and CUDA generators differ).

A row whose finished beams can no longer change (the early-stop heuristic says so, or
``early_stopping=True`` and all its beams are finished) leaves the engine when no one observes
its later steps (no user processors, criteria or ``prefix_allowed_tokens_fn``, no scores or
logits returned, only max-length / EOS criteria); stock computes such rows to the end, and what
their later steps produce reaches no output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import GenerateBeamDecoderOnlyOutput
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.core.request_loop import RequestGroup
from hf_paged.integration.contract.cache import CacheContract, output_field
from hf_paged.integration.contract.content import fill
from hf_paged.integration.plan import fit_refusal
from hf_paged.integration.prepare import PreparedCall
from hf_paged.refusal import Refusal


def generate_beams(model, engine, call: PreparedCall, contract: CacheContract | None = None):
    """Run a prepared ``num_beams > 1`` call (beam search or beam sampling) on ``engine``, which
    ``beams_refusal`` found able to serve it (``route`` asks it before anything is queued).

    Returns:
        What stock returns: the ``[B * num_return_sequences, L + T]`` sequences, or a
        ``GenerateBeamDecoderOnlyOutput`` with ``return_dict_in_generate``. Stock's cache
        (``contract``) is its last reorder's: the running beams' tokens but the last.
    """
    keep_rows = contract is not None and contract.fill  # the cache holds every row to the end
    with torch.no_grad():
        beams, scores, logits = _run(model, engine, call, keep_rows)
        cache = None
        if contract is not None:
            b, k, _ = beams.running_sequences.shape
            running = beams.running_sequences[:, :, : beams.cur_len].reshape(b * k, beams.cur_len)
            cache = fill(contract, engine, running, call)
    return _outputs(call, beams, scores, logits, cache)


def beams_refusal(call: PreparedCall, engine) -> Refusal | None:
    """Why the engine cannot serve this beam call, or None (``plan.fit_refusal`` judges whether
    one row's beams fit the KV cache at once)."""
    gen = call.generation_config
    if gen.low_memory:  # stock raises for it; let it
        return Refusal("low_memory", "low_memory=True is refused by stock beam search")
    if call.streamer is not None:
        return Refusal("streamer", "a streamer with beams is passed to the model by stock")
    if not hasattr(engine, "provide_beams"):
        return Refusal("beam_search", f"{type(engine).__name__} has no provide_beams")
    return fit_refusal(call.prompts, call.max_new_tokens, engine.runtime, held="beams",
                       num_beams=gen.num_beams)  # fmt: skip


@dataclass
class BeamState:
    """Stock ``_beam_search``'s running tensors (its names; shapes with B rows, K beams)."""

    running_sequences: torch.Tensor  # [B, K, max_length] int64, filled past cur_len
    running_beam_scores: torch.Tensor  # [B, K] float32 sum of logprobs
    running_beam_indices: torch.Tensor  # [B, K, max_length - L] int32, -1 = not yet
    sequences: torch.Tensor  # [B, K, max_length] finished hypotheses
    beam_scores: torch.Tensor  # [B, K] their length-penalized scores (-1e9 = empty)
    beam_indices: torch.Tensor  # [B, K, max_length - L]
    is_sent_finished: torch.Tensor  # [B, K] bool
    is_early_stop_heuristic_unsatisfied: torch.Tensor  # [B, 1] bool
    cur_len: int

    @classmethod
    def initial(cls, input_ids: torch.Tensor, gen) -> BeamState:
        """Stock's initial state for ``input_ids`` ``[B * K, L]`` (rows repeated K times)."""
        k, max_length = gen.num_beams, gen.max_length
        (bk, cur_len), dev = input_ids.shape, input_ids.device
        b = bk // k
        pad, eos = gen._pad_token_tensor, gen._eos_token_tensor
        fill = pad or eos[0] if eos is not None else -1  # stock's expression, verbatim
        running = torch.full((b, k, max_length), fill_value=fill, dtype=torch.int64, device=dev)
        running[:, :, :cur_len] = input_ids.reshape(b, k, cur_len)
        scores = torch.zeros((b, k), dtype=torch.float, device=dev)
        scores[:, 1:] = -1e9  # only the first beam's tokens are candidates at the first step
        indices = torch.full((b, k, max_length - cur_len), -1, dtype=torch.int32, device=dev)
        return cls(
            running_sequences=running,
            running_beam_scores=scores,
            running_beam_indices=indices,
            sequences=running.detach().clone(),
            beam_scores=torch.full((b, k), -1e9, dtype=torch.float, device=dev),
            beam_indices=indices.detach().clone(),
            is_sent_finished=torch.zeros((b, k), dtype=torch.bool, device=dev),
            is_early_stop_heuristic_unsatisfied=torch.ones((b, 1), dtype=torch.bool, device=dev),
            cur_len=cur_len,
        )

    def flat_running(self) -> torch.Tensor:
        """``[B * K, cur_len]``: what stock's processors see."""
        b, k, _ = self.running_sequences.shape
        return self.running_sequences[:, :, : self.cur_len].reshape(b * k, self.cur_len)

    def frozen_rows(self, early_stopping) -> torch.Tensor:
        """``[B]`` bool: rows whose finished beams no later step can change."""
        full = self.is_sent_finished.all(dim=-1) & (early_stopping is True)
        return ~self.is_early_stop_heuristic_unsatisfied[:, 0] | full


def beam_step(model, state: BeamState, log_probs: torch.Tensor, call: PreparedCall, all_scores,
              prompt_len: int) -> bool:  # fmt: skip
    """Stock ``_beam_search``'s loop body after the processors, on ``log_probs`` ``[B * K, V]``
    (processed log-softmax scores): select, update ``state`` in place (``cur_len`` + 1).

    Returns:
        True when stock's loop ends here.
    """
    gen, criteria = call.generation_config, call.criteria
    k, (b, _, max_length) = gen.num_beams, state.running_sequences.shape
    eos = gen._eos_token_tensor
    beams_to_keep = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * k
    top_num_beam_mask = torch.cat(
        (torch.ones(k, dtype=torch.bool), torch.zeros(beams_to_keep - k, dtype=torch.bool))
    ).to(log_probs.device)
    vocab_size = log_probs.shape[-1]
    log_probs = model._unflatten_beam_dim(log_probs, b, k) + state.running_beam_scores[:, :, None]
    log_probs = torch.reshape(log_probs, (b, -1))  # [B, K * V]
    topk_log_probs, topk_sequences, topk_beam_indices = model._get_top_k_continuations(
        accumulated_log_probs=log_probs,
        running_sequences=state.running_sequences,
        running_beam_indices=state.running_beam_indices,
        cur_len=state.cur_len,
        decoder_prompt_len=prompt_len,
        do_sample=gen.do_sample,
        beams_to_keep=beams_to_keep,
        num_beams=k,
        vocab_size=vocab_size,  # transformers 5.17 needs it; later versions take **kwargs
        batch_size=b,
    )
    hits = criteria(model._flatten_beam_dim(topk_sequences[:, :, : state.cur_len + 1]), all_scores)
    hits = model._unflatten_beam_dim(hits, b, beams_to_keep)  # [B, beams_to_keep]
    (state.running_sequences, state.running_beam_scores, state.running_beam_indices) = (
        model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs,
            topk_running_sequences=topk_sequences,
            topk_running_beam_indices=topk_beam_indices,
            next_token_hits_stopping_criteria=hits,
            num_beams=k,
        )
    )
    state.sequences, state.beam_scores, state.beam_indices, state.is_sent_finished = (
        model._update_finished_beams(
            sequences=state.sequences,
            topk_running_sequences=topk_sequences,
            beam_scores=state.beam_scores,
            topk_log_probs=topk_log_probs,
            beam_indices=state.beam_indices,
            topk_running_beam_indices=topk_beam_indices,
            is_early_stop_heuristic_unsatisfied=state.is_early_stop_heuristic_unsatisfied,
            is_sent_finished=state.is_sent_finished,
            next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=top_num_beam_mask,
            num_beams=k,
            cur_len=state.cur_len,
            decoder_prompt_len=prompt_len,
            length_penalty=gen.length_penalty,
            early_stopping=gen.early_stopping,
        )
    )
    state.cur_len += 1
    state.is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
        is_early_stop_heuristic_unsatisfied=state.is_early_stop_heuristic_unsatisfied,
        running_beam_scores=state.running_beam_scores,
        beam_scores=state.beam_scores,
        is_sent_finished=state.is_sent_finished,
        cur_len=state.cur_len,
        max_length=max_length,
        decoder_prompt_len=prompt_len,
        early_stopping=gen.early_stopping,
        length_penalty=gen.length_penalty,
    )
    return not model._beam_search_has_unfinished_sequences(
        state.is_early_stop_heuristic_unsatisfied, state.is_sent_finished, hits, gen.early_stopping
    )


def unobserved(call: PreparedCall) -> bool:
    """Nothing outside the returned sequences sees a row's steps (so a frozen row may leave)."""
    return not (
        call.user_processors
        or call.user_criteria
        or call.wants_scores
        or any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in call.processors)
        or any(type(c) not in (MaxLengthCriteria, EosTokenCriteria) for c in call.criteria)
    )


def _run(model, engine, call: PreparedCall, keep_rows: bool = False):
    """Stock's loop with the engine as the model: ``(BeamState, scores, raw logits)``;
    ``keep_rows`` keeps finished rows stepping (their running beams reach the cache)."""
    gen, input_ids = call.generation_config, call.input_ids  # [B * K, L]
    k, prompt_len = gen.num_beams, input_ids.shape[1]
    dev, num_rows = input_ids.device, input_ids.shape[0] // k
    state = BeamState.initial(input_ids, gen)
    all_scores = () if gen.return_dict_in_generate and gen.output_scores else None
    raw_logits = () if gen.return_dict_in_generate and gen.output_logits else None
    may_leave = unobserved(call) and not keep_rows
    params = SamplingParams(temperature=0.0, max_tokens=gen.max_length - prompt_len)
    with engine.request_group() as batch:
        keys = (call.lora_keys or [None] * len(call.prompts))[::k]  # the same for every beam
        rids = [
            batch.add(EngineRequest(p, params, external_sampling=True, beam_search=True,
                                    **call.request_inputs(i * k), lora_key=key))
            for i, (p, key) in enumerate(zip(call.prompts[::k], keys, strict=True))
        ]  # fmt: skip
        live, num_slots = list(range(num_rows)), 1  # rows in the engine; beams per request
        prompt_tokens = sum(len(p) for p in call.prompts)
        for _ in range(gen.max_length - prompt_len):
            budget = prompt_tokens + 2 * k * num_rows * state.cur_len + 16  # engine steps
            logits = _gather_logits(batch, rids, live, num_slots, k, budget).to(dev)  # [B*K, V]
            log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
            log_probs = call.processors(state.flat_running(), log_probs)
            if raw_logits is not None:
                raw_logits += (logits.clone(),)
            if all_scores is not None:
                all_scores += (log_probs.clone(),)
            if beam_step(model, state, log_probs, call, all_scores, prompt_len):
                break
            if may_leave:
                for b in state.frozen_rows(gen.early_stopping).nonzero()[:, 0].tolist():
                    if b in live:
                        live.remove(b)
                        batch.close(rids[b])
            _provide(engine, state, rids, live, num_slots, prompt_len)
            num_slots = k
        for rid in rids:
            batch.close(rid)
        batch.drain()
    return state, all_scores, raw_logits


def _provide(engine, state: BeamState, rids, live, num_slots: int, prompt_len: int) -> None:
    """One ``provide_beams`` call: each live row's new beams, as parent beam and token."""
    if not live:
        return
    b, k, _ = state.running_sequences.shape
    step = state.cur_len - 1  # the token just chosen
    offset = torch.arange(b, device=state.running_beam_indices.device)[:, None] * k
    parents = state.running_beam_indices[:, :, step - prompt_len] - offset  # [B, K]
    if num_slots == 1:
        parents = torch.zeros_like(parents)  # all K beams were copies of the one prefilled
    tokens = state.running_sequences[:, :, step]  # [B, K]
    rows = torch.tensor(live, device=parents.device)
    engine.provide_beams([rids[i] for i in live], parents[rows].tolist(), tokens[rows].tolist())


def _gather_logits(batch: RequestGroup, rids, live, num_slots: int, k: int, budget: int):
    """``[B * K, V]`` raw next-token logits of every beam (row-major), stepping the engine until
    each live beam has reported; before the first selection a row's one sequence stands for
    all K beams; rows no longer in the engine get zeros."""
    got = batch.await_logits([(rids[r], j) for r in live for j in range(num_slots)], budget)
    zeros = torch.zeros_like(next(iter(got.values())))
    rows = []
    for rid in rids:
        for j in range(k):
            rows.append(got.get((rid, j if num_slots > 1 else 0), zeros))
    return torch.stack(rows)


def _outputs(call: PreparedCall, state: BeamState, all_scores, raw_logits, cache=None):
    """Stock's step 5: the best ``num_return_sequences`` per row, cropped to the longest."""
    gen = call.generation_config
    n, prompt_len = gen.num_return_sequences, call.input_ids.shape[1]
    sequences = state.sequences[:, :n, :].flatten(0, 1)
    beam_scores = state.beam_scores[:, :n].flatten(0, 1)
    beam_indices = state.beam_indices[:, :n, :].flatten(0, 1)
    max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
    sequences = sequences[:, : prompt_len + max_generated_length]
    beam_indices = beam_indices[:, :max_generated_length]
    if not gen.return_dict_in_generate:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=beam_scores if gen.output_scores else None,
        scores=all_scores,
        logits=raw_logits,
        beam_indices=beam_indices,
        **{output_field(): cache},
    )
