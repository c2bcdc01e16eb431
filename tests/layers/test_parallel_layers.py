"""Sharding math of the tensor-parallel layers, checked rank by rank without a process group.

A fake communicator stands in for rank r of N: its collectives return the local tensor, so the
test can combine the per-rank results itself (sum for all_reduce, concat for gathers) and compare
with the unsharded layer.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_paged.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from hf_paged.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from hf_paged.testing import FakeComm


def _as_slice(tmp_path, tensors: dict[str, torch.Tensor]):
    """Save tensors and return {name: lazy safetensors slice} (kept open by the caller)."""
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    f = safe_open(str(path), framework="pt")
    return f, {name: f.get_slice(name) for name in tensors}


@pytest.fixture(params=["tensor", "slice"])
def source(request, tmp_path):
    """Feed weight loaders either full tensors or lazy safetensors slices."""

    def make(tensors):
        if request.param == "tensor":
            return tensors
        f, slices = _as_slice(tmp_path, tensors)
        request.addfinalizer(lambda: f.__exit__(None, None, None))
        return slices

    return make


@pytest.mark.parametrize(
    "heads, kv_heads, tp",
    [(4, 2, 1), (4, 2, 2), (4, 1, 2), (4, 2, 4), (8, 2, 4), (8, 4, 2)],
)
def test_qkv_shards_heads_and_replicates_kv(heads, kv_heads, tp, source):
    hidden, d = 8, 2
    full = {
        "q": torch.randn(heads * d, hidden),
        "k": torch.randn(kv_heads * d, hidden),
        "v": torch.randn(kv_heads * d, hidden),
    }
    src = source(full)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=False, comm=FakeComm(rank, tp))
        for sid in "qkv":
            layer.weight_loader(layer.weight, src[sid], sid)
        hpr, kv_local = heads // tp, max(1, kv_heads // tp)
        assert (layer.num_heads, layer.num_kv_heads) == (hpr, kv_local)
        kv_start = rank * kv_heads // tp
        expected = torch.cat(
            [
                full["q"][rank * hpr * d : (rank + 1) * hpr * d],
                full["k"][kv_start * d : (kv_start + kv_local) * d],
                full["v"][kv_start * d : (kv_start + kv_local) * d],
            ]
        )
        assert torch.equal(layer.weight, expected)
        # every local q head is served by the global kv head HF would pair it with
        for j in range(hpr):
            local_kv = j // (hpr // kv_local)
            assert kv_start + local_kv == (rank * hpr + j) // (heads // kv_heads)


def test_qkv_rejects_bad_head_splits():
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(8, 2, 6, 2, bias=False, comm=FakeComm(0, 4))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(8, 2, 12, 6, bias=False, comm=FakeComm(0, 4))
    with pytest.raises(ValueError, match="not a multiple"):
        QKVParallelLinear(8, 2, 12, 3, bias=False, comm=FakeComm(0, 4))


def test_merged_column_concatenates_local_shards(source):
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    gb, ub = torch.randn(6), torch.randn(6)
    src = source({"gate": gate, "up": up, "gb": gb, "ub": ub})
    x = torch.randn(3, 4)
    outs = []
    for rank in range(2):
        layer = MergedColumnParallelLinear(4, [6, 6], bias=True, comm=FakeComm(rank, 2))
        layer.weight_loader(layer.weight, src["gate"], 0)
        layer.weight_loader(layer.weight, src["up"], 1)
        layer.weight_loader(layer.bias, src["gb"], 0)
        layer.weight_loader(layer.bias, src["ub"], 1)
        rows = slice(rank * 3, rank * 3 + 3)
        assert torch.equal(layer.weight, torch.cat([gate[rows], up[rows]]))
        assert torch.equal(layer.bias, torch.cat([gb[rows], ub[rows]]))
        outs.append(layer(x))
    # rank r computes [gate_r | up_r]; reassembling gives the full projections
    g = torch.cat([o[:, :3] for o in outs], dim=1)
    u = torch.cat([o[:, 3:] for o in outs], dim=1)
    torch.testing.assert_close(g, x @ gate.T + gb)
    torch.testing.assert_close(u, x @ up.T + ub)


def test_column_and_row_parallel_compose_to_full_mlp(source):
    w1, b1, w2, b2 = torch.randn(8, 4), torch.randn(8), torch.randn(4, 8), torch.randn(4)
    src = source({"w1": w1, "b1": b1, "w2": w2, "b2": b2})
    x = torch.randn(5, 4)
    partial = []
    for rank in range(2):
        comm = FakeComm(rank, 2)
        col = ColumnParallelLinear(4, 8, bias=True, comm=comm)
        row = RowParallelLinear(8, 4, bias=True, comm=comm)
        col.weight_loader(col.weight, src["w1"])
        col.weight_loader(col.bias, src["b1"])
        row.weight_loader(row.weight, src["w2"])
        row.weight_loader(row.bias, src["b2"])
        assert torch.equal(row.weight, w2[:, rank * 4 : rank * 4 + 4])
        assert torch.equal(row.bias, b2)  # bias replicated, added once after the reduce
        partial.append(row(col(x)) - b2)  # what this rank feeds into all_reduce
    torch.testing.assert_close(sum(partial) + b2, (x @ w1.T + b1) @ w2.T + b2)


def test_replicated_linear_loads_everything(source):
    w = torch.randn(3, 4)
    layer = ReplicatedLinear(4, 3, bias=False, comm=FakeComm(1, 2))
    layer.weight_loader(layer.weight, source({"w": w})["w"])
    assert torch.equal(layer.weight, w)


def test_shape_mismatch_raises(source):
    layer = ColumnParallelLinear(4, 8, bias=False, comm=FakeComm(0, 2))
    with pytest.raises(ValueError, match=r"shape \[8, 5\], expected \[8, 4\]"):
        layer.weight_loader(layer.weight, source({"w": torch.randn(8, 5)})["w"])


@pytest.mark.parametrize("vocab, tp", [(10, 1), (10, 2), (11, 2), (11, 4)])
def test_vocab_parallel_embedding_and_lm_head(vocab, tp, source):
    weight = torch.randn(vocab, 6)
    src = source({"w": weight})
    ids = torch.tensor([0, vocab - 1, 3, 7 % vocab, 5])
    hidden = torch.randn(4, 6)
    emb_sum, logit_parts = 0, []
    for rank in range(tp):
        comm = FakeComm(rank, tp)
        emb = VocabParallelEmbedding(vocab, 6, comm=comm)
        head = ParallelLMHead(vocab, 6, comm=comm)
        emb.weight_loader(emb.weight, src["w"])
        head.weight_loader(head.weight, src["w"])
        per = -(-vocab // tp)
        assert emb.weight.shape == (per, 6)
        real = weight[rank * per : (rank + 1) * per]
        assert torch.equal(emb.weight[: len(real)], real)
        assert not emb.weight[len(real) :].any()  # padding rows are zero
        emb_sum = emb_sum + emb(ids)
        logit_parts.append(torch.nn.functional.linear(hidden, head.weight))
    torch.testing.assert_close(emb_sum, weight[ids])
    torch.testing.assert_close(torch.cat(logit_parts, dim=-1)[:, :vocab], hidden @ weight.T)


def test_lm_head_slices_padding_at_world_one():
    head = ParallelLMHead(10, 6)
    head.weight_loader(head.weight, torch.randn(10, 6))
    assert head(torch.randn(2, 6)).shape == (2, 10)
