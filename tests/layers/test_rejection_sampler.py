"""The speculative acceptance rules as pure functions: ``accept_matching`` keeps the agreeing prefix
plus the model's token; ``rejection_sample`` emits, at every position it reaches, a token
distributed as the model's distribution there (chi-square over 60k draws, against the
model's and, as a control of the test's power, against the draft's), keeps a proposed token
with probability sum(min(p, q)), and draws seeded requests the same whatever the batch."""

from __future__ import annotations

import pytest
import torch

from hf_paged.layers.rejection_sampler import accept_matching, rejection_sample


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's statistic for ``counts`` [V] against ``probs`` [V] (cells with an
    expected count under 5 merged), from the chi-square survival function Q(df/2, x/2)."""
    n = counts.sum().double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_accept_matching():
    assert accept_matching([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_matching([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_matching([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept_matching([], [3]) == [3]
    with pytest.raises(ValueError, match="len\\(proposed\\) \\+ 1"):
        accept_matching([5], [5])


def test_every_emitted_token_has_the_models_distribution():
    torch.manual_seed(0)
    v, k, b = 6, 3, 60_000
    p = torch.softmax(torch.randn(k + 1, v) * 1.5, dim=-1)  # the model, per position
    q = torch.softmax(torch.randn(k, v) * 1.5, dim=-1)  # the draft, per position
    drafts = torch.stack([torch.multinomial(q[j], b, replacement=True) for j in range(k)], 1)
    kept = rejection_sample(p.repeat(b, 1), q.repeat(b, 1), drafts.tolist(), [None] * b)
    lengths = torch.tensor([len(t) for t in kept])
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= k + 1
    for j in range(k + 1):  # the token emitted at position j, where one was
        reached = [t[j] for t in kept if len(t) > j]
        counts = torch.bincount(torch.tensor(reached), minlength=v)
        assert chi_square_p(counts, p[j]) > 1e-3, j
        assert chi_square_p(counts, q[min(j, k - 1)]) < 1e-6  # the test tells p and q apart
    # a proposed token is kept with probability sum_x min(p(x), q(x))
    rate = (lengths > 1).double().mean()
    expected = torch.minimum(p[0], q[0]).sum().double()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / b) ** 0.5


def test_a_draft_equal_to_the_model_is_always_kept_and_a_disjoint_one_never():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    same = rejection_sample(p, p[:1], [[1]], [None])
    assert same[0][0] == 1 and len(same[0]) == 2
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # proposes 2, which the model never emits
    out = rejection_sample(p, q, [[2]], [None])
    assert len(out[0]) == 1 and out[0][0] in (0, 1)  # the residual is p itself here


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    v = 5
    p = torch.softmax(torch.randn(3, v), dim=-1)
    q = torch.softmax(torch.randn(2, v), dim=-1)
    alone = rejection_sample(p, q, [[1, 2]], [torch.Generator().manual_seed(7)])
    others = torch.softmax(torch.randn(5, v), dim=-1), torch.softmax(torch.randn(3, v), dim=-1)
    batch = rejection_sample(
        torch.cat([others[0][:2], p, others[0][2:]]),
        torch.cat([others[1][:1], q, others[1][1:]]),
        [[0], [1, 2], [3, 4]],
        [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)],
    )
    assert batch[1] == alone[0]


def test_bad_row_counts_are_named():
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="need 4 and 3"):
        rejection_sample(p, q, [[1, 2, 3]], [None])
