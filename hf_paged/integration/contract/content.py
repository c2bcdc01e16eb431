"""The content of stock's cache on the paged route (``cache.py`` says what the contract is):
``passed_cache_refusal`` compares a cache passed in with the engine's KV of the same tokens, ``fill``
writes the engine's KV (and a hybrid's states) of a call's rows into stock's cache object, both
through ``padded_kv``: the rows' KV in the call's padded layout."""

from __future__ import annotations

import dataclasses

import torch

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.integration.contract.cache import CacheContract
from hf_paged.integration.contract.states import put_states, stock_states
from hf_paged.integration.prepare import PreparedCall
from hf_paged.refusal import Refusal


def passed_cache_refusal(contract: CacheContract, engine, call: PreparedCall) -> Refusal | None:
    """None when a passed cache holds the engine's KV (and a hybrid's states) of ``input_ids``'
    first tokens (what this model computes for them), within the dtype's tolerance, at every
    attended position it keeps; else the ``Refusal`` of a cache that holds something else (other
    tokens, another model's KV)."""
    cache = contract.cache
    length = int(cache.get_seq_length()) if contract.passed else 0
    if not length:
        return None
    mask = call.attention_mask[:, :length].bool()  # [N, P]
    kv, states = padded_kv(engine, call.input_ids[:, :length], mask)
    for idx, (kind, j) in enumerate(contract.kinds[: len(cache.layers)]):
        layer = cache.layers[idx]
        if kind == "state":
            pairs = [(layer.conv_states[0], states[j]["conv"]),
                     (layer.recurrent_states[0], states[j]["recurrent"])]  # fmt: skip
        else:
            n = layer.keys.shape[-2]  # a sliding layer keeps the last ``n`` positions
            keep = mask[:, length - n :]
            pairs = [(held.transpose(1, 2)[keep], mine[:, :, length - n :].transpose(1, 2)[keep])
                     for held, mine in ((layer.keys, kv[j][0]), (layer.values, kv[j][1]))]  # fmt: skip
        if not all(_close(held, mine) for held, mine in pairs):
            return Refusal(
                "past_key_values",
                f"the cache passed in is not this model's KV of input_ids' first {length} tokens",
            )
    return None


def _close(held: torch.Tensor | None, mine: torch.Tensor) -> bool:
    """Equal within the dtype's tolerance, relative to the largest value held."""
    if held is None or held.shape != mine.shape:
        return False
    tol = 1e-3 if held.dtype == torch.float32 else 3e-2
    scale = float(held.abs().max()) if held.numel() else 1.0
    return torch.allclose(held, mine.to(held), rtol=tol, atol=tol * max(scale, 1.0))


def fill(contract: CacheContract, engine, sequences: torch.Tensor, call: PreparedCall):
    """Stock's cache after the call: ``contract.cache`` reset and filled with the engine's KV of
    ``sequences[:, :-1]`` (``[N, S + 1]``: the prompt's columns attended where the call's mask
    is 1, every later token attended, as stock's mask grows; with ``inputs_embeds`` alone the
    sequences hold the new tokens only, and the embedded prompt comes first).

    Returns:
        The filled cache (None when the contract has none to fill).
    """
    if not contract.fill:
        return contract.cache
    prompt_mask = call.attention_mask
    if call.from_inputs_embeds and call.input_ids.shape[1] == 0:  # embeds only
        placeholders = sequences.new_zeros(sequences.shape[0], prompt_mask.shape[1])
        sequences = torch.cat([placeholders, sequences], dim=1)
    n, total = sequences.shape
    grown = torch.ones(n, total - prompt_mask.shape[1], dtype=torch.bool, device=prompt_mask.device)
    mask = torch.cat([prompt_mask.bool(), grown], dim=1)[:, : total - 1]  # [N, S]
    kv, states = padded_kv(engine, sequences[:, : total - 1], mask, call.prompt_embeds)
    cache = contract.cache
    cache.reset()
    for idx, (kind, j) in enumerate(contract.kinds):
        if kind == "kv":
            cache.update(kv[j][0], kv[j][1], idx)
        else:
            put_states(cache, idx, states[j], total - 1)
    return cache


def padded_kv(engine, ids: torch.Tensor, mask: torch.Tensor, prompt_embeds: list | None = None):
    """``(kv, states)`` for ``ids`` ``[N, S]``: every KV layer's ``(k [N, H, S, D],
    v [N, H, S, Dv])``, the engine's KV of each row's attended tokens at their positions, zeros
    at masked ones (``prompt_embeds``: per row, the rows its first attended positions take); and
    every recurrent layer's states in stock's form (``states.py``; empty without such layers)."""
    mask = mask.bool().cpu()
    rows = [r[k].tolist() for r, k in zip(ids.cpu(), mask, strict=True)]
    # rows one after another
    flat, states = _rows_kv(engine, rows, prompt_embeds or [None] * len(rows))
    row_idx, pos_idx = mask.nonzero(as_tuple=True)  # row-major: the order of ``flat``
    n, s = mask.shape
    out = []
    for k, v in flat:
        dev = k.device
        r, p = row_idx.to(dev), pos_idx.to(dev)
        kk = k.new_zeros(n, k.shape[1], s, k.shape[2])
        vv = v.new_zeros(n, v.shape[1], s, v.shape[2])
        kk[r, :, p] = k  # [T, H, D] into [N, H, S, D]
        vv[r, :, p] = v
        out.append((kk, vv))
    return out, states


def _rows_kv(engine, rows: list[list[int]], embeds: list):
    """``engine.request_kv`` of ``rows`` run as external-sampling requests that pause after
    their prefill, holding their blocks, in as many groups as the KV cache (and the state
    slots) hold at once; and their recurrent states (``states.stock_states``)."""
    size = engine.config.kv_block_size
    room = max(1, engine.runtime.num_kv_blocks // 2)
    slots = getattr(engine.runtime, "num_state_slots", 0) or len(rows)
    groups, current, used = [], [], 0
    for i, r in enumerate(rows):
        blocks = -(-len(r) // size)
        if current and (used + blocks > room or len(current) == slots):
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += blocks
    groups.append(current)
    parts = [_group_kv(engine, [(rows[i], embeds[i]) for i in g if rows[i]]) for g in groups]
    parts = [p for p in parts if p]
    if len(parts) == 1:
        return parts[0]
    kv = [(torch.cat([p[0][j][0] for p in parts]), torch.cat([p[0][j][1] for p in parts]))
          for j in range(len(parts[0][0]))]  # fmt: skip
    states = [{name: torch.cat([p[1][j][name] for p in parts]) for name in parts[0][1][j]}
              for j in range(len(parts[0][1]))]  # fmt: skip
    return kv, states


def _grown(pe, length: int):
    """``pe`` for a prompt grown to ``length`` tokens by generated ones: M-RoPE positions
    ``[3, L]`` continue as the engine runs generated tokens (``p + position_delta``); the ranges
    and their keys are the same (their KV is found in the prefix cache)."""
    if pe is None or pe.positions is None or pe.positions.shape[1] >= length:
        return pe
    pos = pe.positions  # [3, L]
    tail = torch.arange(pos.shape[1], length, dtype=pos.dtype, device=pos.device)
    tail = (tail + pe.position_delta).expand(3, -1)
    return dataclasses.replace(pe, positions=torch.cat([pos, tail], dim=1))


def _last_is_an_id(pe, length: int) -> bool:
    """The last of ``length`` tokens is fed by its id, not a row of ``pe`` (so it can be given
    as a token after the rest ran)."""
    return pe is None or all(r.offset + r.length < length for r in pe.ranges)


def _group_kv(engine, rows: list[tuple[list[int], object]]):
    """``(kv, states)`` of one group of rows. With recurrent layers a row of two tokens or more
    runs in two steps (``states.py``): all but its last token, then the last one."""
    if not rows:
        return None
    recurrent = bool(getattr(engine.runtime, "num_state_slots", 0))
    two_steps = [recurrent and len(r) > 1 and _last_is_an_id(pe, len(r)) for r, pe in rows]
    params = SamplingParams(temperature=0.0, max_tokens=2)  # a provided token must not end it
    budget = sum(len(r) for r, _ in rows) + 16
    with engine.request_group() as group:
        rids = [
            group.add(
                EngineRequest(
                    r[:-1] if two else r,
                    params,
                    external_sampling=True,
                    prompt_embeds=_grown(pe, len(r) - two),
                )
            )  # fmt: skip
            for (r, pe), two in zip(rows, two_steps, strict=True)
        ]
        group.await_logits([(rid, 0) for rid in rids], budget)
        states = []
        if recurrent:
            first = engine.request_states(rids)
            for rid, (r, _), two in zip(rids, rows, two_steps, strict=True):
                if two:
                    engine.provide_token(rid, r[-1])
            group.await_logits([(rid, 0) for rid, two in zip(rids, two_steps) if two], budget)
            states = stock_states(first, engine.request_states(rids), two_steps)
        kv = engine.request_kv(rids)
        for rid in rids:
            group.close(rid)
        group.drain()
    return kv, states


__all__ = ["passed_cache_refusal", "fill", "padded_kv"]
