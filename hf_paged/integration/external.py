"""The external-sampling path of a paged ``generate`` call: stock ``_sample``'s loop with the
engine as the model.

Every row is an external-sampling request. Each step gathers all open rows' raw next-token logits
into ``[B, V]`` and runs exactly stock ``_sample``'s loop body on it: processors, multinomial or
argmax, pad for finished rows, stopping criteria, streamer. Used when the caller observes every
step (a streamer, scores or logits, user processors or criteria) or HF's processors are ones the
engine's sampler lacks.
"""

from __future__ import annotations

import torch

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.core.request_loop import RequestGroup


def run_external(engine, call):
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
    with engine.request_group() as batch:
        keys = call.lora_keys or [None] * n
        for i, (prompt, key) in enumerate(zip(call.prompts, keys, strict=True)):
            batch.add(EngineRequest(prompt, params, external_sampling=True,
                                    **call.request_inputs(i), lora_key=key))  # fmt: skip
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


def _gather_logits(batch: RequestGroup, open_rows: list[int], n: int, budget: int) -> torch.Tensor:
    """``[B, V]`` raw next-token logits; rows no longer in the engine get zeros."""
    got = batch.await_logits([(batch.rids[i], 0) for i in open_rows], budget)
    rows = [got.get((batch.rids[i], 0)) for i in range(n)]
    zeros = torch.zeros_like(next(iter(got.values())))
    return torch.stack([r if r is not None else zeros for r in rows])


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
