"""Per-layer cost of the SSM / conv / RG-LRU mixers (torch references) at released shapes, bf16,
on one GPU, beside the stock HF module on the same inputs.

Per family, one layer of its released size (random weights):
- ``prefill_ms``: one prompt of ``--prefill`` tokens, from a fresh slot (stock: its no-cache
  forward, the torch path it falls back to without ``mamba_ssm`` / ``causal_conv1d``);
- ``decode_ms``: one token for each of ``--batch`` sequences with states (stock: one cached
  decode step of a batch that many rows wide), eager, and ``decode_graph_ms`` replayed in a
  CUDA graph (ours only).
The Mamba 1 and RG-LRU scans walk a prompt token by token (no chunked kernel yet): their
prefill time is launch-bound and is what a kernel would remove.

Usage: PYTHONPATH=. python evaluation/bench_ssm_mixers.py [--prefill 2048] [--batch 64]
Writes ``${OUT:-evaluation/results}/bench_ssm_mixers.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path

import torch

from hf_paged.models.recurrent.base import RecurrentMeta
from hf_paged.models.recurrent.mamba import MambaMixer
from hf_paged.models.recurrent.mamba2 import Mamba2Mixer
from hf_paged.models.recurrent.rglru import RGLRUMixer
from hf_paged.models.recurrent.short_conv import ShortConvMixer

# name -> (model_type, module path, HF class, our class, released-size config fields)
SHAPES = {
    "falcon_mamba_7b": ("falcon_mamba", "falcon_mamba", "FalconMambaMixer", MambaMixer, dict(
        hidden_size=4096, intermediate_size=8192, state_size=16, time_step_rank=256,
        conv_kernel=4, num_hidden_layers=1)),
    "mamba2_2.7b": ("mamba2", "mamba2", "Mamba2Mixer", Mamba2Mixer, dict(
        hidden_size=2560, num_heads=80, head_dim=64, expand=2, state_size=128, n_groups=1,
        chunk_size=256, num_hidden_layers=1)),
    "nemotron_h_8b": ("nemotron_h", "nemotron_h", "NemotronHMamba2Mixer", Mamba2Mixer, dict(
        hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128,
        n_groups=8, chunk_size=128, layers_block_type=["mamba"], num_hidden_layers=1)),
    "lfm2_1.2b": ("lfm2", "lfm2", "Lfm2ShortConv", ShortConvMixer, dict(
        hidden_size=2048, conv_L_cache=3, layer_types=["conv"], num_hidden_layers=1)),
    "recurrent_gemma_2b": ("recurrent_gemma", "recurrent_gemma", "RecurrentGemmaRecurrentBlock",
                           RGLRUMixer, dict(hidden_size=2560, lru_width=2560,
                                            num_attention_heads=10, conv1d_width=4,
                                            block_types=["recurrent"], num_hidden_layers=1)),
}  # fmt: skip


def _module(model_type, path, cls_name, fields, device):
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**fields)
    cls = getattr(importlib.import_module(f"transformers.models.{path}.modeling_{path}"), cls_name)
    try:  # our init below draws every weight (Falcon-Mamba's own fails built alone in 5.24)
        module = cls(config, 0, initialize_mixer_weights=False)
    except TypeError:
        module = cls(config, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a sane scale: fan-in init, A in [-16, -1], dt near softplus(-2)
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "norm" in name or name.endswith(".D") or name == "D":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 - (2.0 if "dt" in name else 0))
    return module.to(device, torch.bfloat16).eval(), config


def _meta(n, length, has, device):
    cu = torch.arange(n + 1, dtype=torch.int32, device=device) * length
    return RecurrentMeta(cu, torch.arange(1, n + 1, device=device),
                         torch.full((n,), has, dtype=torch.bool, device=device),
                         num_prefills=0 if length == 1 else n, seq_lens=[length] * n)  # fmt: skip


def _ms(fn, iters) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / iters


def _graph_ms(fn, iters) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _ms(graph.replay, iters)


@torch.no_grad()
def bench(name, prefill, batch, iters) -> dict:
    from transformers import DynamicCache

    model_type, path, cls_name, ours, fields = SHAPES[name]
    module, config = _module(model_type, path, cls_name, fields, "cuda")
    mixer = ours.from_hf(module)
    d = config.hidden_size
    states = {s.name: torch.zeros(batch + 1, *s.shape, dtype=s.dtype, device="cuda")
              for s in mixer.state_specs()}  # fmt: skip
    x = torch.randn(prefill, d, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(batch, d, device="cuda", dtype=torch.bfloat16)
    pm, dm = _meta(1, prefill, False, "cuda"), _meta(batch, 1, True, "cuda")
    row = {"layer": name, "prefill_tokens": prefill, "decode_batch": batch}
    row["prefill_ms"] = _ms(lambda: mixer(x, pm, states), max(1, iters // 10))
    row["decode_ms"] = _ms(lambda: mixer(xb, dm, states), iters)
    row["decode_graph_ms"] = _graph_ms(lambda: mixer(xb, dm, states), iters)
    if cls_name == "RecurrentGemmaRecurrentBlock":
        pos = torch.arange(prefill, device="cuda")[None]
        row["stock_prefill_ms"] = _ms(lambda: module(x[None], pos, None, False),
                                      max(1, iters // 10))  # fmt: skip
        module(
            xb[:, None].expand(batch, 4, d).contiguous(),
            torch.arange(4, device="cuda")[None].expand(batch, 4),
            None,
            True,
        )
        step = torch.full((batch, 1), 4, device="cuda")
        row["stock_decode_ms"] = _ms(lambda: module(xb[:, None], step, None, True), iters)
    else:
        row["stock_prefill_ms"] = _ms(lambda: module(x[None]), max(1, iters // 10))
        cache = DynamicCache(config=config)
        module(xb[:, None].expand(batch, 4, d).contiguous(), cache)  # fill the cache
        row["stock_decode_ms"] = _ms(lambda: module(xb[:, None], cache), iters)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(prog="python evaluation/bench_ssm_mixers.py")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--only", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    rows = [bench(n, args.prefill, args.batch, args.iters) for n in args.only]
    out = Path(os.environ.get("OUT") or "evaluation/results") / "bench_ssm_mixers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
