"""MiniMax lightning attention mixer (``lightning.py``) against the HF module, CPU fp32: one
sequence cut into chunks at several boundaries then decoded, and several sequences mixed in one
flattened step, equal the HF module run on each whole sequence."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.base import RecurrentMeta
from hf_paged.models.recurrent.delta_rule import ChunkLayout
from hf_paged.models.recurrent.lightning import (
    LightningAttentionMixer,
    linear_attention_chunked,
    linear_attention_step,
)
from hf_paged.models.recurrent.state_pool import StatePool
from hf_paged.testing import build_tiny

ATOL, RTOL = 2e-5, 1e-4


def _module():
    config, model = build_tiny("minimax")
    i = config.layer_types.index("linear_attention")
    return model.model.layers[i].self_attn


def _hf_out(module, x):
    with torch.no_grad():
        return module(x[None], position_embeddings=None, attention_mask=None)[0][0]


def _run(mixer, xs, steps):
    pool = StatePool([mixer.state_specs()], num_slots=len(xs), device="cpu")
    slot = {s: pool.alloc() for s in xs}
    done = {s: 0 for s in xs}
    outs = {s: [] for s in xs}
    for step in steps:
        lens = [n for _, n in step]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        meta = RecurrentMeta(cu, torch.tensor([slot[s] for s, _ in step]),
                             torch.tensor([done[s] > 0 for s, _ in step]),
                             sum(1 for n in lens if n > 1), lens)  # fmt: skip
        x = torch.cat([xs[s][done[s] : done[s] + n] for s, n in step])
        with torch.no_grad():
            out, none = mixer.hf_result(mixer(x, meta, pool.layers[0])[None])
        assert none is None
        at = 0
        for s, n in step:
            outs[s].append(out[0, at : at + n])
            done[s] += n
            at += n
    return {s: torch.cat(o) for s, o in outs.items()}


@pytest.mark.parametrize("chunks", [[70], [16, 16, 38], [1, 1, 68], [64, 6], [17, 53]],
                         ids=lambda c: "-".join(map(str, c)))  # fmt: skip
def test_chunked_prefill_then_decode_equals_hf(chunks):
    module = _module()
    mixer = LightningAttentionMixer.from_hf(module)
    x = torch.randn(sum(chunks) + 5, module.qkv_proj.in_features,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    out = _run(mixer, {0: x}, [[(0, n)] for n in chunks] + [[(0, 1)]] * 5)[0]
    torch.testing.assert_close(out, _hf_out(module, x), atol=ATOL, rtol=RTOL)


def test_mixed_steps_equal_each_sequence_alone():
    module = _module()
    mixer = LightningAttentionMixer.from_hf(module)
    g = torch.Generator().manual_seed(1)
    xs = {s: torch.randn(n, module.qkv_proj.in_features, generator=g)
          for s, n in {0: 40, 1: 9, 2: 70, 3: 3}.items()}  # fmt: skip
    steps = [[(0, 20), (1, 5)], [(0, 20), (2, 16), (1, 1)], [(2, 54), (1, 1), (3, 1)],
             [(1, 1), (3, 1)], [(3, 1), (1, 1)]]  # fmt: skip
    out = _run(mixer, xs, steps)
    for s, x in xs.items():
        n = out[s].shape[0]
        torch.testing.assert_close(out[s], _hf_out(module, x[:n]), atol=ATOL, rtol=RTOL)


def test_chunked_form_equals_token_steps():
    g = torch.Generator().manual_seed(3)
    lens, h, d = [1, 5, 16, 37], 3, 8
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    gl = -torch.rand(t, h, generator=g)
    s0 = torch.randn(len(lens), h, d, d, generator=g)
    o, s1 = linear_attention_chunked(q, k, v, gl, s0, ChunkLayout(lens, 16, "cpu"))
    at = 0
    for i, n in enumerate(lens):
        s = s0[i : i + 1]
        for r in range(at, at + n):
            o_r, s = linear_attention_step(q[r : r + 1], k[r : r + 1], v[r : r + 1],
                                           gl[r : r + 1], s)  # fmt: skip
            torch.testing.assert_close(o[r], o_r[0], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(s1[i], s[0], atol=1e-4, rtol=1e-5)
        at += n
