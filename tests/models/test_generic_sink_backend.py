"""Attention-sink layers of the generic path (GPT-OSS) run their own backend when it takes
sinks, and only a backend that is not CUDA-graph safe turns decode graphs off for them. The
profile pass and the binding need no kernel launch, so this runs on CPU."""

from __future__ import annotations

import pytest
import torch

from hf_paged.testing import build_tiny


def _sink_model(backend_name: str):
    from hf_paged.attention import get_backend
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.generic.attention import BINDING_ATTR
    from hf_paged.models.registry import build_model

    config, hf = build_tiny("gpt_oss")
    ctx = ModelContext(get_backend(backend_name), kv_block_size=16)
    model = build_model(config, ctx, torch.float32, "cpu", "generic")
    model.load_weights(hf)
    bindings = [m.__dict__[BINDING_ATTR] for m in model.hf_model.modules()
                if BINDING_ATTR in m.__dict__]  # fmt: skip
    return model, bindings


def test_sink_layers_keep_a_graph_safe_backend():
    pytest.importorskip("triton")
    from hf_paged.models.generic.sinks import sink_backend

    model, bindings = _sink_model("triton")
    assert bindings and all(any(b.sinks) for b in bindings)
    for b in bindings:
        assert all(sink_backend(a.backend).name == "triton" for a in b.attns)
    assert model.ctx.fallbacks == {}
    assert model.supports_cuda_graph and model.cuda_graph_reason is None


def test_sink_layers_on_the_torch_reference_decode_eagerly():
    from hf_paged.attention.base import AttentionBackend
    from hf_paged.models.generic.sinks import sink_backend

    model, _ = _sink_model("torch")
    assert not model.supports_cuda_graph and "sinks" in model.cuda_graph_reason

    class NoSinks(AttentionBackend):  # a backend without ``sinks=``: the reference runs them
        supports_cuda_graph = True

        def forward(self, *args, **kwargs):
            raise AssertionError("not called")

    assert sink_backend(NoSinks()).name == "torch"
