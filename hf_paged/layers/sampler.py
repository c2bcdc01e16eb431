"""Logits -> next token ids, per-row sampling params, in Hugging Face ``generate``'s order.

Order (HF's processor order, so greedy and sampled results agree with HF given the same logits):

1. logits -> float32;
2. repetition penalty (HF, on prompt + output), frequency/presence penalties (vLLM, output
   only), then ``min_tokens`` masking of stop ids;
3. logprobs, when asked, from ``log_softmax`` of these *penalised* logits, before temperature and
   the filters (so they score the model's distribution, not the sampling distribution);
4. greedy rows (``temperature == 0``): argmax;
5. sampled rows: ``/ temperature``, top-k, top-p, min-p (HF warpers), softmax;
6. the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``. A row with its own generator
   (``SamplingParams.seed``) draws its ``q`` alone, so a seed gives the same tokens whatever the
   batch and the row index; other rows draw from the engine generator in one call.

Which parts run is decided from the host-side params (no device sync); a filter no row needs costs
nothing. ``apply_penalties``, ``apply_top_k_top_p_min_p`` and ``random_sample`` are pure functions,
usable as references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from hf_paged.config import SamplingParams
from hf_paged.kernels.argmax import argmax_rows

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step; row i = the i-th sampled sequence."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]  # repetition_penalty looks at prompt + output (like HF)
    output_token_ids: list[list[int]]  # presence/frequency penalties (output only) and min_tokens
    stop_token_ids: list[tuple[int, ...]]  # masked (-inf) while len(output) < params.min_tokens
    # a generator per seeded row (on the logits' device, kept by the engine across steps), else None
    generators: list[torch.Generator | None]

    def __post_init__(self) -> None:
        n = len(self.params)
        for name in ("prompt_token_ids", "output_token_ids", "stop_token_ids", "generators"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"SamplingMetadata.{name} has {len(getattr(self, name))} rows, params has {n}"
                )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] = (),
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplingMetadata:
        """Metadata with empty token lists / no generators where not given.

        Stop ids per row are ``eos_token_ids`` (unless ``ignore_eos``) + ``params.stop_token_ids``.
        """
        n = len(params)
        stop = [
            tuple(dict.fromkeys((() if p.ignore_eos else tuple(eos_token_ids)) + p.stop_token_ids))
            for p in params
        ]
        return cls(
            params=list(params),
            prompt_token_ids=[list(x) for x in prompt_token_ids] if prompt_token_ids else [[]] * n,
            output_token_ids=[list(x) for x in output_token_ids] if output_token_ids else [[]] * n,
            stop_token_ids=stop,
            generators=list(generators) if generators is not None else [None] * n,
        )


@dataclass
class SamplerOutput:
    """What one sampling step produced."""

    token_ids: torch.Tensor  # [B] int64, on the logits' device
    # per row (logprob of the sampled token, {top-k id: logprob}) when any row asked
    # (params.logprobs is not None), None for rows that did not ask; None when no row asked
    logprobs: list[tuple[float, dict[int, float]] | None] | None


def _row_token_mask(
    rows: list[int], ids: list[Sequence[int]], shape: tuple[int, int], device, count: bool
) -> torch.Tensor:
    """[B, V] token counts (float32) or presence (bool) of ``ids[j]`` in row ``rows[j]``.

    Ids >= V (embedding vocab larger than the lm_head) land in a padding column that is dropped.
    """
    b, v = shape
    lens = torch.tensor([len(x) for x in ids], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lens)
    flat, row_idx = flat.clamp_(max=v).to(device), row_idx.to(device)
    if count:
        out = torch.zeros(b, v + 1, dtype=torch.float32, device=device)
        out.index_put_((row_idx, flat), torch.ones_like(flat, dtype=out.dtype), accumulate=True)
    else:
        out = torch.zeros(b, v + 1, dtype=torch.bool, device=device)
        out[row_idx, flat] = True
    return out[:, :v]


def _needs_penalties(meta: SamplingMetadata) -> bool:
    """Whether ``apply_penalties`` would change any row (decided on the host, no sync)."""
    return any(
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or (len(out) < p.min_tokens and stop)
        for p, out, stop in zip(meta.params, meta.output_token_ids, meta.stop_token_ids)
    )


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency/presence penalties, then min_tokens masking. Out of place.

    Args:
        logits: [B, V] float32.
        meta: row i's params and token ids.
    Returns:
        [B, V] float32 penalised logits (``logits`` itself when no row needs anything).
    """
    shape, dev, params = tuple(logits.shape), logits.device, meta.params
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:  # HF RepetitionPenaltyLogitsProcessor: each distinct prompt+output token once
        seen = [list(meta.prompt_token_ids[i]) + list(meta.output_token_ids[i]) for i in rep_rows]
        mask = _row_token_mask(rep_rows, seen, shape, dev, count=False)  # [B, V]
        pen = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]  # [B, 1]
        penalised = torch.where(logits < 0, logits * pen, logits / pen)
        logits = torch.where(mask, penalised, logits)
    fp_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if fp_rows:  # vLLM: logits -= freq * count + presence * (count > 0), output tokens only
        counts = _row_token_mask(
            fp_rows, [meta.output_token_ids[i] for i in fp_rows], shape, dev, count=True
        )
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        logits = logits - freq * counts - pres * (counts > 0).float()
    min_rows = [
        i
        for i, p in enumerate(params)
        if len(meta.output_token_ids[i]) < p.min_tokens and meta.stop_token_ids[i]
    ]
    if min_rows:
        mask = _row_token_mask(
            min_rows, [meta.stop_token_ids[i] for i in min_rows], shape, dev, count=False
        )
        logits = logits.masked_fill(mask, _NEG_INF)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """HF's TopK, TopP then MinP warpers with a value per row; filtered tokens become -inf.

    Args:
        logits: [B, V] float32, already divided by temperature.
        top_k: [B] int; <= 0 or >= V = off for that row. None = off for all rows.
        top_p: [B] float in (0, 1]; 1 = off. None = off for all rows.
        min_p: [B] float in [0, 1]; 0 = off. None = off for all rows.
    Returns:
        [B, V] float32, out of place. At least one token per row stays finite.
    """
    v = logits.shape[-1]
    if top_k is not None or top_p is not None:
        # one ascending sort serves both: top-k masks a prefix, so the order stays sorted
        sorted_logits, sorted_idx = logits.sort(dim=-1)  # [B, V]
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            k_on = (top_k > 0) & (top_k < v)
            k = torch.where(k_on, top_k, v).clamp(1, v).long()
            kth = sorted_logits.gather(1, (v - k)[:, None])  # [B, 1] k-th largest
            # HF: drop logits < k-th largest (ties with it are kept)
            remove = (sorted_logits < kth) & k_on[:, None]
            sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
        if top_p is not None:
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
            # HF: drop the low tail whose mass is <= 1 - top_p; always keep the largest
            drop = cum <= (1 - top_p.to(cum.dtype))[:, None]
            drop[:, -1] = False
            remove = remove | (drop & (top_p < 1)[:, None])
        mask = torch.empty_like(remove).scatter_(1, sorted_idx, remove)
        logits = logits.masked_fill(mask, _NEG_INF)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)  # [B, 1]
        # min_p <= 1, so the top token is never below the threshold (HF keeps it explicitly)
        logits = logits.masked_fill(probs < min_p.to(probs.dtype)[:, None] * top, _NEG_INF)
    return logits


def random_sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Exponential race: ``argmax(probs / q)``, ``q ~ Exp(1)``, one token per row.

    Args:
        probs: [B, V] float32 probabilities (zeros where filtered).
        generators: per row a generator (on ``probs``' device) or None. A row with a generator
            draws ``torch.empty(V).exponential_(generator=g)`` alone, so its tokens depend only on
            the generator's state, never on the batch or the row index.
        default_generator: for rows without one, in one call; None = torch's global RNG.
    Returns:
        [B] int64 token ids.
    """
    b, v = probs.shape
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        q = torch.empty_like(probs).exponential_(generator=default_generator)
    else:
        q = torch.empty_like(probs)
        for i in seeded:
            q[i] = torch.empty(v, dtype=probs.dtype, device=probs.device).exponential_(
                generator=generators[i]
            )
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[torch.tensor(unseeded, device=probs.device)] = torch.empty(
                len(unseeded), v, dtype=probs.dtype, device=probs.device
            ).exponential_(generator=default_generator)
    # q == 0 would make 0/0 = nan, which argmax picks; keep q > 0
    return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, per row (the rows of sampled requests).

    Args:
        logits: [S, V] float32 penalised logits.
        params: S sampling params, none greedy.
    Returns:
        [S, V] float32: filtered tokens at -inf; its softmax is what the row samples from.
    """
    dev, v = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], device=dev)
    top_k = top_p = min_p = None
    if any(0 < p.top_k < v for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
    return apply_top_k_top_p_min_p(logits / temp[:, None], top_k, top_p, min_p)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row's next token is drawn from, as ``Sampler`` draws it.

    Args:
        logits: [B, V] raw logits (any float dtype).
        meta: B rows.
    Returns:
        [B, V] float32: penalties, then for sampled rows the softmax of ``warp``; a greedy row
        is one-hot at its argmax.
    """
    logits = apply_penalties(logits.float(), meta)
    probs = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(meta.params) if p.greedy]
    sampled = [i for i, p in enumerate(meta.params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        probs[idx, argmax_rows(logits.index_select(0, idx))] = 1.0
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        rows = warp(logits.index_select(0, idx), [meta.params[i] for i in sampled])
        probs[idx] = rows.softmax(dim=-1)
    return probs


class Sampler(torch.nn.Module):
    """Next token per row from ``[B, V]`` logits; see the module docstring for the order."""

    def __init__(self, generator: torch.Generator | None = None):
        """``generator``: the engine's, for rows without a seed (None = torch's global RNG)."""
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Args: logits [B, V] of any float dtype and device; meta with B rows.

        Raises:
            ValueError: meta's row count differs from B.
        """
        b, v = logits.shape
        if len(meta.params) != b:
            raise ValueError(f"logits has {b} rows but SamplingMetadata has {len(meta.params)}")
        params = meta.params
        if all(p.greedy and p.logprobs is None for p in params) and not _needs_penalties(meta):
            # casting is monotonic: argmax of the model's dtype equals argmax in fp32
            return SamplerOutput(token_ids=argmax_rows(logits), logprobs=None)
        logits = apply_penalties(logits.float(), meta)  # [B, V] fp32
        dev = logits.device
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        token_ids = argmax_rows(logits) if len(sample_rows) < b else None  # [B] greedy
        if sample_rows:
            idx = torch.tensor(sample_rows, device=dev) if len(sample_rows) < b else None
            rows = logits if idx is None else logits.index_select(0, idx)  # [S, V]
            rows = warp(rows, [params[i] for i in sample_rows])
            gens = [meta.generators[i] for i in sample_rows]
            sampled = random_sample(rows.softmax(dim=-1), gens, self.generator)  # [S]
            token_ids = sampled if token_ids is None else token_ids.index_copy(0, idx, sampled)
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = token_logprobs(logits, token_ids, params)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[float, dict[int, float]] | None]:
    """Per asking row (sampled token's logprob, {top-k id: logprob}) from the penalised logits."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    idx = torch.tensor(rows, device=logits.device)
    lp = logits.index_select(0, idx).log_softmax(dim=-1)  # [R, V]
    chosen = lp.gather(1, token_ids.index_select(0, idx)[:, None])[:, 0].tolist()
    k_max = min(max(params[i].logprobs for i in rows), lp.shape[-1])
    top_vals, top_ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    for r, i in enumerate(rows):
        k = params[i].logprobs
        out[i] = (chosen[r], dict(zip(top_ids[r][:k], top_vals[r][:k], strict=True)))
    return out
