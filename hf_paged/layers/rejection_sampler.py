"""Speculative acceptance: which proposed tokens a model keeps, so that its output distribution is
its own whatever proposed them.

Two rules, both keep the longest accepted prefix of the proposal plus one token of the model's:

- ``accept_matching`` (greedy, and proposals without probabilities such as n-gram lookup): the
  model draws its own token at every position (argmax, or a sample from its distribution) and a
  proposed token is kept while it equals the model's draw. Greedy output is the model's greedy
  output; sampled output is distributed as the model's, since each kept token is the model's own
  draw given a prefix of the model's own draws.
- ``rejection_sample`` (proposals drawn from a draft distribution q, "speculative sampling",
  Leviathan et al. 2023 / Chen et al. 2023, transformers' ``_speculative_sampling``): keep proposed
  token x with probability ``min(1, p(x) / q(x))``; at the first rejection draw from the residual
  ``max(0, p - q)`` normalised; when all are kept draw the next token from p. Each emitted token
  is distributed as p given the tokens before it.

Pure functions on tensors; the engine's verification (``engine/spec/spec_decode.py``) calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_paged.layers.sampler import random_sample


def accept_matching(proposed: Sequence[int], drawn: Sequence[int]) -> list[int]:
    """The kept tokens: the proposed ones while they equal the model's draws, then the model's
    draw at the first mismatch (or after the last proposed token).

    Args:
        proposed: k proposed tokens.
        drawn: k + 1 tokens the model drew, at the last known token's position and at each
            proposed token's.
    Returns:
        m + 1 tokens, ``m`` = the number of proposed tokens kept.

    Raises:
        ValueError: ``drawn`` does not have ``len(proposed) + 1`` tokens.
    """
    if len(drawn) != len(proposed) + 1:
        raise ValueError(f"drawn has {len(drawn)} tokens, must be len(proposed) + 1")
    m = 0
    while m < len(proposed) and proposed[m] == drawn[m]:
        m += 1
    return list(proposed[:m]) + [drawn[m]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    proposed: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The speculative-sampling rule for a batch of requests.

    Args:
        target_probs: [sum(k_i + 1), V] float32, request i's k_i + 1 rows in order: the model's
            distribution at the last known token's position and at each proposed token's.
        draft_probs: [sum(k_i), V] float32, request i's k_i rows: the distribution each proposed
            token was drawn from.
        proposed: per request its k_i >= 1 proposed tokens.
        generators: per request a generator on the probabilities' device, or None (then
            ``default_generator``, or torch's global RNG). A request draws its k_i uniforms and
            then its next token from its own generator, so seeded results do not depend on the
            batch.
    Returns:
        Per request the kept proposed tokens followed by one token of the model's.

    Raises:
        ValueError: row counts that do not match ``proposed``.
    """
    ks = [len(p) for p in proposed]
    if min(ks, default=1) < 1:
        raise ValueError("every request must propose at least one token")
    if target_probs.shape[0] != sum(ks) + len(ks) or draft_probs.shape[0] != sum(ks):
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows and draft_probs "
            f"{draft_probs.shape[0]}; {len(ks)} requests proposing {ks} need "
            f"{sum(ks) + len(ks)} and {sum(ks)}"
        )
    dev, b, kmax = target_probs.device, len(ks), max(ks)
    # proposed token j of request i is row d0[i] + j of draft_probs, t0[i] + j of target_probs
    k_t = torch.tensor(ks, device=dev)
    d0 = torch.cumsum(k_t, 0) - k_t  # [B] request i's first row in draft_probs
    t0 = d0 + torch.arange(b, device=dev)  # [B] and in target_probs
    req = torch.repeat_interleave(torch.arange(b, device=dev), k_t)  # [sum k] request of row
    pos = torch.arange(req.numel(), device=dev) - d0[req]  # [sum k] position in its proposal
    flat = torch.tensor([t for p in proposed for t in p], dtype=torch.long, device=dev)
    p_x = target_probs[t0[req] + pos, flat]  # [sum k]
    q_x = draft_probs[torch.arange(flat.numel(), device=dev), flat]
    u = _uniforms(ks, generators, default_generator, dev)  # [sum k]
    kept = u * q_x <= p_x  # u <= p / q without dividing by q
    padded = torch.zeros(b, kmax, dtype=torch.bool, device=dev)
    padded[req, pos] = kept
    m = padded.long().cumprod(dim=1).sum(dim=1)  # [B] leading kept tokens
    rejected = m < k_t
    p_next = target_probs[t0 + m]  # [B, V]
    q_at = draft_probs[d0 + torch.minimum(m, k_t - 1)]  # [B, V]
    residual = (p_next - q_at).clamp_min_(0.0)
    mass = residual.sum(dim=1, keepdim=True)
    # p == q up to rounding leaves no residual mass: then p itself (the same distribution)
    residual = torch.where(mass > torch.finfo(mass.dtype).tiny, residual / mass, p_next)
    dist = torch.where(rejected[:, None], residual, p_next)
    nxt = random_sample(dist, generators, default_generator).tolist()
    m = m.tolist()
    return [list(p[: m[i]]) + [nxt[i]] for i, p in enumerate(proposed)]


def _uniforms(ks: list[int], generators, default_generator, dev) -> torch.Tensor:
    """``sum(ks)`` uniforms in [0, 1): request i's ``ks[i]`` from its own generator, those of
    requests without one from ``default_generator`` in one call."""
    u = torch.empty(sum(ks), device=dev)
    free, at = [], 0
    for k, g in zip(ks, generators, strict=True):
        if g is not None:
            u[at : at + k] = torch.rand(k, device=dev, generator=g)
        else:
            free.extend(range(at, at + k))
        at += k
    if free:
        u[torch.tensor(free, device=dev)] = torch.rand(
            len(free), device=dev, generator=default_generator
        )
    return u
