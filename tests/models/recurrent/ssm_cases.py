"""The tiny HF mixer modules of the SSM / conv / RG-LRU families, the stock oracles that run
them (whole prompt without a cache; prompt then token-by-token decode through HF's own cache)
and a by-hand driver of our mixers over a small state pool.

Each family's config is built with its own fields (hidden 64) and its model built whole by
``AutoModelForCausalLM.from_config`` (so that ``layer_idx`` and the layer kinds are the
family's own); the first mixer module of the family's class is the one tested. Weights are
re-drawn by ``randomize_`` (A_log, D, dt_bias and the gate weights included).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.models.recurrent.base import RecurrentMeta
from hf_paged.testing import randomize_

HIDDEN = 64
_COMMON = {"hidden_size": HIDDEN, "vocab_size": 192, "num_hidden_layers": 2}
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
_MAMBA1 = {"state_size": 8, "intermediate_size": 128, "conv_kernel": 4, "time_step_rank": 8}
_M2_HEADS = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8,
             "mamba_d_conv": 4, "mamba_chunk_size": 8}  # fmt: skip

# family -> (model_type, HF mixer class name, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mamba": ("mamba", "MambaMixer", _MAMBA1),
    "falcon_mamba": ("falcon_mamba", "FalconMambaMixer", _MAMBA1),
    "jamba": ("jamba", "JambaMambaMixer", {
        **_ATTN, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
        "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 2, "num_experts_per_tok": 1}),
    "mamba2": ("mamba2", "Mamba2Mixer", {
        "num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 2, "state_size": 8,
        "chunk_size": 8, "conv_kernel": 4}),
    "bamba": ("bamba", "BambaMixer", {
        **_ATTN, **_M2_HEADS, "mamba_expand": 2, "attn_layer_indices": [1]}),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridMambaLayer", {
        **_ATTN, **_M2_HEADS, "mamba_expand": 2, "layer_types": ["mamba", "attention"],
        "num_local_experts": 2, "num_experts_per_tok": 1, "shared_intermediate_size": 64}),
    "nemotron_h": ("nemotron_h", "NemotronHMamba2Mixer", {
        **_ATTN, "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
        "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 8,
        "layers_block_type": ["mamba", "attention"]}),
    # Falcon-H1 in its three norm modes, with its muP multipliers away from 1
    "falcon_h1": ("falcon_h1", "FalconH1Mixer", {
        **_ATTN, "head_dim": 16, **_M2_HEADS, "mamba_d_ssm": 128, "mamba_rms_norm": False,
        "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.9], "ssm_in_multiplier": 1.3}),
    "falcon_h1_norm": ("falcon_h1", "FalconH1Mixer", {
        **_ATTN, "head_dim": 16, **_M2_HEADS, "mamba_d_ssm": 128, "mamba_rms_norm": True,
        "mamba_norm_before_gate": True, "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.9]}),
    "falcon_h1_gate_first": ("falcon_h1", "FalconH1Mixer", {
        **_ATTN, "head_dim": 16, **_M2_HEADS, "mamba_d_ssm": 128, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False}),
    "lfm2": ("lfm2", "Lfm2ShortConv", {
        **_ATTN, "conv_L_cache": 3, "conv_bias": True, "layer_types": ["conv", "full_attention"]}),
    "lfm2_no_bias": ("lfm2", "Lfm2ShortConv", {
        **_ATTN, "conv_L_cache": 3, "conv_bias": False, "layer_types": ["conv", "full_attention"]}),
    "recurrent_gemma": ("recurrent_gemma", "RecurrentGemmaRecurrentBlock", {
        **_ATTN, "head_dim": 16, "lru_width": 96, "conv1d_width": 4,
        "block_types": ["recurrent", "attention"]}),
}  # fmt: skip

MAMBA1 = ("mamba", "falcon_mamba", "jamba")
MAMBA2 = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "falcon_h1_norm",
          "falcon_h1_gate_first")  # fmt: skip


def build_module(family: str, seed: int = 0) -> tuple[nn.Module, object]:
    """The family's first mixer module of a tiny random fp32 model, and the model's config."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model_type, cls_name, overrides = FAMILIES[family]
    config = CONFIG_MAPPING[model_type](**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed).eval()
    module = next(m for m in model.modules() if type(m).__name__ == cls_name)
    return module, config


@torch.no_grad()
def hf_whole(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Stock on one whole sequence, no cache: ``x [L, D]`` -> ``[L, D]``."""
    if type(module).__name__ == "RecurrentGemmaRecurrentBlock":
        pos = torch.arange(x.shape[0], device=x.device)[None]
        return module(x[None], pos, None, use_cache=False)[0][0]
    return module(x[None])[0]


@torch.no_grad()
def hf_cached(module: nn.Module, config, prompt: torch.Tensor, steps: torch.Tensor):
    """Stock's cached path: ``prompt [L, D]`` in one call, then each row of ``steps [S, D]`` as a
    single-token call. Returns the outputs ``[L + S, D]`` and the final (conv, recurrent)
    states as stock keeps them (batch row 0)."""
    outs = []
    if type(module).__name__ == "RecurrentGemmaRecurrentBlock":
        module.conv1d_state = None  # the block keeps its own state: start a fresh sequence
        pos = torch.arange(prompt.shape[0], device=prompt.device)[None]
        outs.append(module(prompt[None], pos, None, True)[0][0])
        for s, row in enumerate(steps):
            pos = torch.tensor([[prompt.shape[0] + s]], device=prompt.device)
            outs.append(module(row[None, None], pos, None, True)[0][0])
        return torch.cat(outs), (module.conv1d_state[0], module.rg_lru.recurrent_states[0])
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    outs.append(module(prompt[None], cache)[0])
    for row in steps:
        # transformers 5.17's Falcon-H1 gate-first norm drops the length axis at one token
        outs.append(module(row[None, None], cache).reshape(1, -1))
    layer = cache.layers[module.layer_idx]
    rec = layer.recurrent_states[0]
    return torch.cat(outs), (layer.conv_states[0][0], None if rec is None else rec[0])


class Pool:
    """A state pool by hand: ``[num_slots + 1, *shape]`` per state of one mixer (slot 0 the
    dummy), filled with noise so that a slot read without ``has_initial_state`` shows."""

    def __init__(self, mixer, num_slots: int = 8, seed: int = 1, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.states = {
            s.name: torch.randn((num_slots + 1, *s.shape), generator=g).to(device, s.dtype)
            for s in mixer.state_specs()
        }

    def clone(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}


def make_meta(
    chunks: list[tuple[int, int, bool]], num_prefills: int, device="cpu"
) -> RecurrentMeta:
    """``chunks``: per sequence (slot, length, has_initial_state), prefills first."""
    lens = [n for _, n, _ in chunks]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return RecurrentMeta(
        cu_seqlens=cu,
        state_indices=torch.tensor([s for s, _, _ in chunks], dtype=torch.int64, device=device),
        has_initial_state=torch.tensor([h for _, _, h in chunks], dtype=torch.bool, device=device),
        num_prefills=num_prefills,
        seq_lens=lens,
    )


@torch.no_grad()
def run_chunks(mixer, states, slot: int, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One sequence ``x [L, D]`` through our mixer in consecutive chunks of ``sizes`` (the
    first starts fresh, the rest carry the slot's states); the outputs ``[L, D]``."""
    outs, start = [], 0
    for n in sizes:
        meta = make_meta([(slot, n, start > 0)], int(n > 1 or start == 0), x.device)
        outs.append(mixer(x[start : start + n], meta, states))
        start += n
    return torch.cat(outs)


def chunk_sizes(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 parity: differences of summation order only."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _inputs(length: int, seed: int, device) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(device)


def check_whole(mixer, module, length: int = 37) -> None:
    """(a) a whole prompt through our mixer == stock's forward on it (no cache)."""
    x = _inputs(length, 0, _device(module))
    pool = Pool(mixer, device=x.device)
    close(run_chunks(mixer, pool.states, 3, x, [length]), hf_whole(module, x), "whole prompt")


def check_chunked(mixer, module, sizes: list[int], length: int = 37) -> None:
    """(b) the prompt in consecutive chunks of each size, states carried == the whole prompt."""
    x = _inputs(length, 0, _device(module))
    expected = hf_whole(module, x)
    for size in sizes:
        pool = Pool(mixer, device=x.device)
        got = run_chunks(mixer, pool.states, 5, x, chunk_sizes(length, size))
        close(got, expected, f"chunks of {size}")


# per sequence of a mixed step: (slot, tokens before this step, tokens in this step)
MIXED_PLANS = {
    "prefills_first": [(2, 0, 9), (6, 5, 11), (1, 13, 2), (4, 7, 1), (7, 20, 1)],
    # the scheduler's order: running sequences (decodes, chunks) first, then new ones
    "interleaved": [(4, 7, 1), (6, 5, 11), (7, 20, 1), (1, 13, 2), (2, 0, 9), (3, 0, 1)],
}


@torch.no_grad()
def check_mixed(mixer, module, order: str = "prefills_first") -> None:
    """(c) one step of several sequences (a fresh prefill, prefill chunks continuing from
    their slots, single-token decodes; in ``MIXED_PLANS[order]``) == each sequence alone;
    other slots untouched."""
    plan = MIXED_PLANS[order]
    dev = _device(module)
    xs = [_inputs(done + n, 10 + i, dev) for i, (_, done, n) in enumerate(plan)]
    pool = Pool(mixer, device=dev)
    for (slot, done, _), x in zip(plan, xs):
        if done:
            run_chunks(mixer, pool.states, slot, x[:done], chunk_sizes(done, 4))
    before = pool.clone()
    chunks = [(slot, n, done > 0) for slot, done, n in plan]
    meta = make_meta(chunks, sum(1 for _, n, _ in chunks if n > 1), dev)
    out = mixer(torch.cat([x[done:] for (_, done, _), x in zip(plan, xs)]), meta, pool.states)
    row = 0
    for (slot, done, n), x in zip(plan, xs):
        close(out[row : row + n], hf_whole(module, x)[done:], f"slot {slot} in a mixed step")
        alone = {k: v.clone() for k, v in before.items()}
        run_chunks(mixer, alone, slot, x, [done, n] if done else [n])
        for name in pool.states:
            close(pool.states[name][slot], alone[name][slot], f"slot {slot} state {name!r}")
        row += n
    untouched = [s for s in range(len(pool.states[next(iter(pool.states))])) if s not in
                 {p[0] for p in plan}]  # fmt: skip
    for name, t in pool.states.items():
        assert torch.equal(t[untouched], before[name][untouched]), f"{name}: other slots written"


@torch.no_grad()
def check_decode(mixer, module, config, prompt_len: int = 13, steps: int = 6) -> None:
    """(d) a prefill then single-token decodes == stock's cached path token by token, outputs
    and final states (stock's conv window is the last ``K - 1`` inputs of what it keeps)."""
    x = _inputs(prompt_len + steps, 3, _device(module))
    expected, (conv, rec) = hf_cached(module, config, x[:prompt_len], x[prompt_len:])
    pool = Pool(mixer, device=x.device)
    got = run_chunks(mixer, pool.states, 2, x, [prompt_len] + [1] * steps)
    close(got, expected, "prefill + decode")
    width = pool.states["conv"].shape[-1]
    close(pool.states["conv"][2], conv[..., -width:].to(pool.states["conv"].dtype), "conv state")
    if rec is not None:
        close(pool.states["recurrent"][2], rec, "recurrent state")


def mixer_for(family: str, module: nn.Module):
    """Our mixer of ``family`` on ``module``."""
    from hf_paged.models.recurrent.mamba import MambaMixer
    from hf_paged.models.recurrent.mamba2 import Mamba2Mixer
    from hf_paged.models.recurrent.rglru import RGLRUMixer
    from hf_paged.models.recurrent.short_conv import ShortConvMixer

    if family in MAMBA1:
        return MambaMixer.from_hf(module)
    if family in MAMBA2:
        return Mamba2Mixer.from_hf(module)
    if family.startswith("lfm2"):
        return ShortConvMixer.from_hf(module)
    return {"recurrent_gemma": RGLRUMixer}[family].from_hf(module)
