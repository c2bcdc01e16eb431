"""Sampler against Hugging Face's own logits processors, plus seed and distribution checks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.config import SamplingParams as SP
from hf_paged.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p_min_p,
    random_sample,
)

V = 64
# chi-square critical values at p = 0.001, by degrees of freedom
_CHI2_CRIT = {2: 13.816, 3: 16.266, 5: 20.515}


def _hf_warp(row: torch.Tensor, p: SP) -> torch.Tensor:
    """HF's sampling warpers, in generate's order, on one row [V]."""
    procs = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        procs.append(MinPLogitsWarper(p.min_p))
    x, ids = row[None].clone(), torch.zeros(1, 1, dtype=torch.long)
    for proc in procs:
        x = proc(ids, x)
    return x[0]


def _ours_warp(logits: torch.Tensor, params: list[SP]) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    return apply_top_k_top_p_min_p(
        logits / temp,
        torch.tensor([p.top_k for p in params], device=dev),
        torch.tensor([p.top_p for p in params], device=dev),
        torch.tensor([p.min_p for p in params], device=dev),
    )


def _assert_same_filter(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours[fin], ref[fin])


_WARP_ROWS = [  # different params per row; some rows with a filter off beside rows with it on
    SP(temperature=1.0),
    SP(temperature=0.7, top_k=5),
    SP(temperature=1.3, top_p=0.8),
    SP(temperature=0.9, min_p=0.1),
    SP(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
    SP(temperature=2.0, top_k=1),
    SP(temperature=1.0, top_p=0.3, min_p=0.3),
    SP(temperature=1.0, top_k=-1, top_p=0.95),
    SP(temperature=1.0, top_p=1e-9),  # nothing reaches the mass: HF keeps the top token
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warpers_match_hf_row_wise(seed):
    logits = torch.randn(len(_WARP_ROWS), V, generator=torch.Generator().manual_seed(seed)) * 3
    logits[0, 0] = -300.0  # prob underflows to 0, yet HF leaves the unfiltered row untouched
    ours = _ours_warp(logits, _WARP_ROWS)
    ref = torch.stack([_hf_warp(logits[i], p) for i, p in enumerate(_WARP_ROWS)])
    _assert_same_filter(ours, ref)
    assert torch.isinf(ref).any(dim=-1)[1:].all()  # each filtered row really filters something


@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_single_filter_none_for_others(which):
    """Filters passed as None are skipped; the one given still matches HF."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7)) * 2
    values = {"top_k": [3, -1, 10, 0], "top_p": [0.5, 1.0, 0.9, 0.2], "min_p": [0.2, 0.0, 0.5, 0.1]}
    params = [SP(**{which: val}) for val in values[which]]
    kwargs = {"top_k": None, "top_p": None, "min_p": None}
    kwargs[which] = torch.tensor(values[which])
    ours = apply_top_k_top_p_min_p(logits, **kwargs)
    ref = torch.stack([_hf_warp(logits[i], p) for i, p in enumerate(params)])
    _assert_same_filter(ours, ref)
    assert not torch.isinf(ours[1]).any()  # the "off" row is untouched


def test_top_p_boundary_matches_hf():
    """Equal logits: cumulative mass hits 1 - top_p exactly, and HF drops that token too."""
    logits = torch.zeros(2, 4)
    params = [SP(top_p=0.5), SP(top_p=0.75)]
    ours = apply_top_k_top_p_min_p(logits, None, torch.tensor([0.5, 0.75]), None)
    ref = torch.stack([_hf_warp(logits[i], p) for i, p in enumerate(params)])
    assert torch.isfinite(ours).sum(-1).tolist() == torch.isfinite(ref).sum(-1).tolist() == [2, 3]


def test_sampled_tokens_stay_in_hf_kept_set():
    """Through Sampler.forward, sampled tokens only ever come from HF's finite set."""
    logits = torch.randn(len(_WARP_ROWS), V, generator=torch.Generator().manual_seed(3)) * 3
    ref = torch.stack([_hf_warp(logits[i], p) for i, p in enumerate(_WARP_ROWS)])
    reps = 200
    meta = SamplingMetadata.build(_WARP_ROWS * reps)
    sampler = Sampler(torch.Generator().manual_seed(0))
    toks = sampler(logits.repeat(reps, 1), meta).token_ids.view(reps, len(_WARP_ROWS))
    kept = torch.isfinite(ref).expand(reps, -1, -1).gather(2, toks[..., None])
    assert kept.all()
    assert (toks[:, 5] == logits[5].argmax()).all()  # top_k=1 is argmax


def _rep_penalty_hf(logits, prompts, outputs, penalties):
    rows = []
    for i, pen in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        rows.append(RepetitionPenaltyLogitsProcessor(float(pen))(ids, logits[i : i + 1].clone())[0])
    return torch.stack(rows)


def _penalty_case():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, V, generator=g) * 2
    prompts = [[1, 2, 2, 5, 63], [3, 4], [7, 7, 7], [0, 9, 10]]
    outputs = [[5, 6, 6], [4, 8, 8, 8], [], [1]]
    return logits, prompts, outputs


def test_repetition_penalty_matches_hf():
    logits, prompts, outputs = _penalty_case()
    pens = [1.3, 0.8, 2.0, 1.0]
    meta = SamplingMetadata.build([SP(repetition_penalty=p) for p in pens], prompts, outputs)
    torch.testing.assert_close(
        apply_penalties(logits, meta), _rep_penalty_hf(logits, prompts, outputs, pens)
    )


def test_frequency_presence_penalties_on_output_only():
    logits, prompts, outputs = _penalty_case()
    params = [
        SP(frequency_penalty=0.5, presence_penalty=0.25),
        SP(frequency_penalty=-0.3),
        SP(presence_penalty=1.0),
        SP(),
    ]
    ref = logits.clone()
    for i, p in enumerate(params):
        for tok, n in Counter(outputs[i]).items():  # prompt tokens are not penalised
            ref[i, tok] -= p.frequency_penalty * n + p.presence_penalty
    meta = SamplingMetadata.build(params, prompts, outputs)
    torch.testing.assert_close(apply_penalties(logits, meta), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_in_mixed_batch(dtype):
    logits = (torch.randn(6, V, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.0, top_k=3)] * 2
    out = Sampler(torch.Generator().manual_seed(0))(logits, SamplingMetadata.build(params))
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    greedy = [0, 2, 3, 5]
    assert torch.equal(out.token_ids[greedy], logits.float().argmax(-1)[greedy])
    assert out.logprobs is None


def test_greedy_with_repetition_penalty_matches_hf():
    logits, prompts, outputs = _penalty_case()
    # make every row's argmax a token it has already seen, so the penalty decides
    for i, seen in enumerate(p + o for p, o in zip(prompts, outputs, strict=True)):
        logits[i, seen[0]] = logits[i].max() + 0.1
    pens = [1.5, 3.0, 2.0, 10.0]
    params = [SP(temperature=0.0, repetition_penalty=p) for p in pens]
    out = Sampler()(logits, SamplingMetadata.build(params, prompts, outputs))
    ref = _rep_penalty_hf(logits, prompts, outputs, pens).argmax(-1)
    assert torch.equal(out.token_ids, ref)
    assert not torch.equal(ref, logits.argmax(-1))  # the penalty changed the choice


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "params, seeded",
    [
        (SP(temperature=0.7), False),
        (SP(temperature=1.5), True),
        (SP(temperature=0.8, top_k=4), False),
        (SP(temperature=1.2, top_p=0.75), True),
    ],
)
def test_sampling_distribution_chi_square(params, seeded):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.8, -1.0])
    ref = _hf_warp(logits, params)  # temperature (+ filter) as HF does it
    probs = ref.softmax(-1)
    n = 5_000 if seeded else 20_000
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)] if seeded else None
    meta = SamplingMetadata.build([params] * n, generators=gens)
    toks = Sampler(torch.Generator().manual_seed(1))(logits.expand(n, -1), meta).token_ids
    counts = torch.bincount(toks, minlength=len(logits)).float()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    dof = int(kept.sum()) - 1
    assert _chi2(counts[kept], probs[kept], n) < _CHI2_CRIT[dof]
    # and the test has power: the untempered distribution is rejected
    if params.top_k < 0 and params.top_p == 1.0:
        assert _chi2(counts, logits.softmax(-1), n) > _CHI2_CRIT[dof]


def _run_steps(row: int, batch: list[SP], steps: list[torch.Tensor], seeds: list[int | None]):
    """Sample ``len(steps)`` steps, reusing generators; return row ``row``'s tokens."""
    gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    sampler = Sampler(torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(1234)
    toks = []
    for step_logits in steps:
        logits = torch.randn(len(batch), V, generator=g) * 2
        logits[row] = step_logits
        meta = SamplingMetadata.build(batch, generators=gens)
        toks.append(int(sampler(logits, meta).token_ids[row]))
    return toks


def test_seed_same_tokens_alone_and_in_batch():
    target = SP(temperature=1.0, top_p=0.95, seed=123)
    steps = [torch.randn(V, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    alone = _run_steps(0, [target], steps, [123])
    batch = [
        SP(temperature=0.0),
        SP(temperature=0.5, seed=7),
        SP(temperature=1.1, top_k=5),
        SP(temperature=0.9, min_p=0.1, seed=123),  # same seed, other row: its own generator
        SP(temperature=1.0),
        target,
        SP(temperature=2.0, top_p=0.5, seed=8),
        SP(temperature=0.3, repetition_penalty=1.2),
    ]
    seeds = [None, 7, None, 123, None, 123, 8, None]
    assert _run_steps(5, batch, steps, seeds) == alone
    # and the seed matters: another seed gives another sequence
    assert _run_steps(0, [target], steps, [124]) != alone


def test_random_sample_seeded_row_ignores_batch():
    probs = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(0)), -1)
    alone = random_sample(probs[3:4], [torch.Generator().manual_seed(5)])
    gens = [None, torch.Generator().manual_seed(9), None, torch.Generator().manual_seed(5), None]
    batched = random_sample(probs, gens, torch.Generator().manual_seed(0))
    assert batched[3] == alone[0]


def test_min_tokens_masks_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # EOS is the argmax
    logits[:, 7] = 9.0  # a user stop id is next
    params = [
        SP(temperature=0.0, min_tokens=3, stop_token_ids=(7,)),  # 2 < 3: masked
        SP(temperature=0.0, min_tokens=2, stop_token_ids=(7,)),  # 2 >= 2: not masked
        SP(temperature=0.0, min_tokens=3, ignore_eos=True),  # EOS not a stop id here
    ]
    meta = SamplingMetadata.build(params, output_token_ids=[[1, 1]] * 3, eos_token_ids=(2,))
    assert meta.stop_token_ids == [(2, 7), (2, 7), ()]
    pen = apply_penalties(logits, meta)
    assert torch.isinf(pen[0, [2, 7]]).all() and torch.isfinite(pen[0, :2]).all()
    assert torch.isfinite(pen[1:]).all()
    assert Sampler()(logits, meta).token_ids.tolist() == [0, 2, 2]


def test_logprobs_values_and_top_ids():
    logits, prompts, outputs = _penalty_case()
    params = [
        SP(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SP(temperature=0.5, logprobs=0),
        SP(temperature=1.0),  # did not ask
        SP(temperature=0.8, top_k=4, logprobs=5, frequency_penalty=1.0),
    ]
    meta = SamplingMetadata.build(params, prompts, outputs)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    # logprobs score the penalised logits, before temperature and filters
    ref = apply_penalties(logits, meta).log_softmax(-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp, top = out.logprobs[i]
        assert lp == pytest.approx(float(ref[i, out.token_ids[i]]), abs=1e-5)
        vals, ids = ref[i].topk(params[i].logprobs)
        assert list(top) == ids.tolist()
        assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-5)
    assert not torch.allclose(ref[0], logits[0].log_softmax(-1))  # penalty shows in logprobs


def test_metadata_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, V), SamplingMetadata.build([SP()]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_seed_is_batch_independent():
    dev = torch.device("cuda")
    logits = torch.randn(len(_WARP_ROWS), V, generator=torch.Generator().manual_seed(0)) * 3
    _assert_same_filter(
        _ours_warp(logits.to(dev), _WARP_ROWS).cpu(), _ours_warp(logits, _WARP_ROWS)
    )
    target = SP(temperature=1.0, top_p=0.95, seed=123)
    others = [SP(temperature=0.0), SP(temperature=0.7, seed=5), SP(top_k=3, logprobs=2)]
    sampler = Sampler(torch.Generator(dev).manual_seed(0))
    g_alone, g_batch = (torch.Generator(dev).manual_seed(123) for _ in range(2))
    g_other = torch.Generator(dev).manual_seed(5)
    for step in range(6):
        x = torch.randn(4, V, generator=torch.Generator().manual_seed(step)).to(dev, torch.bfloat16)
        alone = sampler(x[3:], SamplingMetadata.build([target], generators=[g_alone]))
        meta = SamplingMetadata.build(others + [target], generators=[None, g_other, None, g_batch])
        out = sampler(x, meta)
        assert out.token_ids.device.type == "cuda"
        assert out.token_ids[3] == alone.token_ids[0]
        assert out.token_ids[0] == x[0].float().argmax()
        assert out.logprobs[2] is not None and len(out.logprobs[2][1]) == 2
