"""Every SSM / conv / RG-LRU mixer on the engine's step == its stock module (fp32; TF32 off on
CUDA), on the CPU and on one GPU: whole prompt (and a one-token prompt), chunked prefill, a
mixed step, decode after prefill; on the GPU also a decode-only step captured in a CUDA graph
with persistent slot-index buffers == the same step eager, replayed with other slots (one of
them the dummy slot 0). Each family's own facts (state shapes, what it refuses) stay in its
file."""

from __future__ import annotations

import pytest
import torch

from tests.models.recurrent.ssm_cases import (
    FAMILIES,
    HIDDEN,
    Pool,
    check_chunked,
    check_decode,
    check_mixed,
    check_whole,
    close,
    make_meta,
)

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CPU_CASES = [pytest.param(f, id=f"{f}-cpu") for f in FAMILIES]
GPU_CASES = [pytest.param((f, "cuda"), id=f"{f}-cuda", marks=ON_GPU) for f in FAMILIES]
CASES = CPU_CASES + GPU_CASES


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    """fp32 parity: cuDNN's convolutions default to TF32, which stock and we would round apart."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("case", CASES, indirect=True)
@pytest.mark.parametrize("length", [37, 1])
def test_whole_prompt(case, length):
    check_whole(*case[:2], length=length)


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_chunked_prefill(case):
    mixer, module, _ = case
    # Mamba 2's SSD block is 8: 16 crosses blocks, 3 and 1 end inside them
    check_chunked(mixer, module, [1, 3, mixer.kernel - 1, mixer.kernel, 16])


@pytest.mark.parametrize("case", CASES, indirect=True)
@pytest.mark.parametrize("order", ["prefills_first", "interleaved"])
def test_mixed_step(case, order):
    check_mixed(*case[:2], order)


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_decode_after_prefill(case):
    check_decode(*case)


@pytest.mark.parametrize("case", GPU_CASES, indirect=True)
@torch.no_grad()
def test_decode_cuda_graph(case):
    mixer, _, _ = case
    n = 4
    pool = Pool(mixer, device="cuda")
    meta = make_meta([(s, 1, True) for s in (1, 2, 3, 4)], 0, "cuda")  # the static buffers
    hidden = torch.zeros(n, HIDDEN, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture
        mixer(hidden, meta, pool.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mixer(hidden, meta, pool.states)
    g = torch.Generator().manual_seed(5)
    for slots, has in [((5, 2, 7, 0), (True, False, True, True)), ((3, 6, 1, 8), (True,) * 4)]:
        x = torch.randn(n, HIDDEN, generator=g).cuda()
        eager_states = pool.clone()
        eager = mixer(x, make_meta(list(zip(slots, [1] * n, has)), 0, "cuda"), eager_states)
        hidden.copy_(x)
        meta.state_indices.copy_(torch.tensor(slots))
        meta.has_initial_state.copy_(torch.tensor(has))
        graph.replay()
        real = [i for i, s in enumerate(slots) if s != 0]  # slot 0 is the dummy: anything goes
        close(out[real], eager[real], f"graph replay, slots {slots}")
        for name, t in pool.states.items():
            close(t[1:], eager_states[name][1:], f"state {name!r} after replay, slots {slots}")
