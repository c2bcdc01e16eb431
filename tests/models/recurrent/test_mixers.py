"""The SSM / conv / RG-LRU mixers on one GPU (fp32, TF32 off): the four stock oracles on CUDA
for every family, and a decode-only step captured in a CUDA graph with persistent slot-index
buffers == the same step eager, replayed with other slots (one of them the dummy slot 0)."""

from __future__ import annotations

import pytest
import torch

from tests.models.recurrent.ssm_cases import (
    FAMILIES,
    HIDDEN,
    Pool,
    build_module,
    check_chunked,
    check_decode,
    check_mixed,
    check_whole,
    close,
    make_meta,
    mixer_for,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    """fp32 parity: cuDNN's convolutions default to TF32, which stock and we would round apart."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request):
    module, config = build_module(request.param)
    module = module.cuda()
    return mixer_for(request.param, module), module, config


def test_oracles_cuda(case):
    mixer, module, config = case
    check_whole(mixer, module)
    check_chunked(mixer, module, [1, mixer.kernel, 16])
    check_mixed(mixer, module)
    check_mixed(mixer, module, "interleaved")
    check_decode(mixer, module, config)


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
