"""Gated DeltaNet mixer (``gated_delta.py``) against the HF module it wraps, on CPU in fp32.

The oracle is the HF module run on a whole sequence with no cache. The mixer runs the same
sequence cut into chunks at several boundaries (chunked prefill carrying the conv window and
the delta-rule state in a pool slot), then one token at a time (decode), and several sequences
mixed in one flattened step; every output row must match the HF module's row.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.base import RecurrentMeta
from hf_paged.models.recurrent.delta_rule import ChunkLayout, delta_rule_chunked, delta_rule_step
from hf_paged.models.recurrent.gated_delta import GatedDeltaNetMixer
from hf_paged.models.recurrent.state_pool import StatePool
from hf_paged.testing import build_tiny

FAMILIES = ("qwen3_5_text", "qwen3_next", "olmo_hybrid")
ATOL, RTOL = 2e-5, 1e-4


def _module(model_type: str):
    _, model = build_tiny(model_type)
    layer = model.model.layers[0]
    return layer.linear_attn


def _hf_out(module, x: torch.Tensor) -> torch.Tensor:  # x [L, D] -> [L, D]
    with torch.no_grad():
        return module(hidden_states=x[None])[0]


def _meta(lens: list[int], slots: list[int], has: list[bool]) -> RecurrentMeta:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return RecurrentMeta(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        state_indices=torch.tensor(slots, dtype=torch.long),
        has_initial_state=torch.tensor(has),
        num_prefills=sum(1 for n in lens if n > 1),
        seq_lens=list(lens),
    )


def _run_schedule(mixer, xs: dict[int, torch.Tensor], steps: list[list[tuple[int, int]]]):
    """Run ``steps`` (each a list of (sequence, tokens)) on a pool; the rows each sequence got."""
    pool = StatePool([mixer.state_specs()], num_slots=len(xs) + 1, device="cpu")
    slot = {s: pool.alloc() for s in xs}
    done = {s: 0 for s in xs}
    outs = {s: [] for s in xs}
    for step in steps:
        rows = [xs[s][done[s] : done[s] + n] for s, n in step]
        meta = _meta([n for _, n in step], [slot[s] for s, _ in step],
                     [done[s] > 0 for s, _ in step])  # fmt: skip
        with torch.no_grad():
            out = mixer(torch.cat(rows), meta, pool.layers[0])
        at = 0
        for s, n in step:
            outs[s].append(out[at : at + n])
            done[s] += n
            at += n
    return {s: torch.cat(o) for s, o in outs.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize(
    "chunks",
    [[70], [16, 16, 16, 16, 6], [1, 1, 1, 67], [64, 6], [63, 2, 5], [65, 5]],
    ids=lambda c: "-".join(map(str, c)),
)
def test_chunked_prefill_then_decode_equals_hf(model_type, chunks):
    module = _module(model_type)
    mixer = GatedDeltaNetMixer.from_hf(module)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(chunks) + 6, module.hidden_size, generator=g)
    steps = [[(0, n)] for n in chunks] + [[(0, 1)] for _ in range(6)]  # then 6 decodes
    out = _run_schedule(mixer, {0: x}, steps)[0]
    ref = _hf_out(module, x)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_mixed_steps_equal_each_sequence_alone(model_type):
    module = _module(model_type)
    mixer = GatedDeltaNetMixer.from_hf(module)
    g = torch.Generator().manual_seed(2)
    lens = {0: 40, 1: 9, 2: 70, 3: 3}
    xs = {s: torch.randn(n, module.hidden_size, generator=g) for s, n in lens.items()}
    steps = [
        [(0, 20), (1, 5)],  # two prefill chunks
        [(0, 20), (2, 16), (1, 1)],  # prefills and a decode
        [(2, 54), (1, 1), (3, 1)],  # a one-token prompt beside them, without a state
        [(1, 1), (3, 1)],  # decode-only steps (the CUDA-graph path)
        [(3, 1), (1, 1)],
    ]
    out = _run_schedule(mixer, xs, steps)
    for s, x in xs.items():
        got = out[s]
        torch.testing.assert_close(got, _hf_out(module, x[: got.shape[0]]), atol=ATOL, rtol=RTOL)


def test_chunked_form_equals_token_steps():
    """``delta_rule_chunked`` over ragged sequences == ``delta_rule_step`` token by token."""
    g = torch.Generator().manual_seed(3)
    lens, h, dk, dv = [1, 5, 16, 37], 3, 8, 6
    t = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    gl = -torch.rand(t, h, generator=g)
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(len(lens), h, dk, dv, generator=g)
    o, s1 = delta_rule_chunked(q, k, v, gl, beta, s0, ChunkLayout(lens, 16, "cpu"))
    at = 0
    for i, n in enumerate(lens):
        s = s0[i : i + 1]
        for r in range(at, at + n):
            o_r, s = delta_rule_step(q[r : r + 1], k[r : r + 1], v[r : r + 1], gl[r : r + 1],
                                     beta[r : r + 1], s)  # fmt: skip
            torch.testing.assert_close(o[r], o_r[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s1[i], s[0], atol=1e-5, rtol=1e-5)
        at += n


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="seq_lens"):
        ChunkLayout([3, 0], 16, "cpu")
    with pytest.raises(ValueError, match="projection layout"):
        GatedDeltaNetMixer(torch.nn.Linear(2, 2))
