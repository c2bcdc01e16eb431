"""``GenericForCausalLM``: any HF decoder served through its own modules (the model protocol).

The HF model is built on meta (``build.py``) with ``attn_implementation`` set to hf_paged's
registered function (``attention.py``). A step runs the HF backbone on the flattened batch,
``input_ids [1, T]`` and per-token ``position_ids [1, T]``, with no mask and no HF cache; the
attention function reads the step's metadata and the paged KV cache. Logits come from the HF
causal LM's own forward with its backbone swapped for the given hidden rows, so the model's
head code (Granite's ``logits_scaling``, Gemma2's final softcap, Cohere's ``logit_scale``) runs
as written, and only on the rows that are sampled.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from hf_paged import envs
from hf_paged.attention.base import AttentionMetadata
from hf_paged.attention.kv_cache import KVCacheSpec
from hf_paged.layers.attention import Attention
from hf_paged.layers.context import ModelContext
from hf_paged.models import peft
from hf_paged.models.generic import profile
from hf_paged.models.generic.attention import BINDING_ATTR, LayerBinding, StepState
from hf_paged.models.generic.build import backbone_of, build_on_meta, meta_tensor_attributes
from hf_paged.models.generic.recurrent import RecurrentLayers, recurrent_refusal
from hf_paged.models.generic.sinks import sink_backend
from hf_paged.models.generic.support import (
    UnsupportedModelError,
    check_supported,
    resolve_hf_class,
    static_refusal,
)
from hf_paged.models.generic.tp import apply_tp_plan, tp_plan_refusal
from hf_paged.models.generic.weights import (
    load_from_checkpoint,
    load_from_module,
    refresh_weights,
)
from hf_paged.models.loader import BaseWeights, iter_model_weights
from hf_paged.models.recurrent import registry
from hf_paged.models.recurrent.base import StateSpec
from hf_paged.refusal import Refusal


class GenericForCausalLM(nn.Module):
    """An HF causal LM (any decoder whose attention goes through ``AttentionInterface``) on the
    paged engine. ``kv_cache_specs`` is known after ``load_weights`` (its profile pass).

    Args:
        hf_config: the model's config; its class is resolved by ``support.resolve_hf_class``.
        ctx: attention backend and tensor-parallel communicator.
        dtype, device: of the parameters and activations.

    Raises:
        UnsupportedModelError: the model cannot be served exactly; the message names why.
    """

    def __init__(self, hf_config, ctx: ModelContext, dtype: torch.dtype, device):
        super().__init__()
        check_supported(hf_config, ctx.max_model_len)
        self.ctx = ctx
        self.device = torch.device(device)
        self.dtype = dtype
        try:
            self.hf_model = build_on_meta(hf_config, dtype, self.device)
        except Exception as e:  # noqa: BLE001  e.g. init code that needs real tensors
            raise UnsupportedModelError(
                f"building on the meta device failed: {type(e).__name__}: {e}"
            ) from e
        refusal = recurrent_refusal(self.hf_model, ctx.tp_size)
        if refusal is not None:
            raise UnsupportedModelError(refusal.detail)
        # rank's part of each sharded parameter (empty at tp 1); the collectives are installed
        self.shard_rules = apply_tp_plan(self.hf_model, ctx.comm) if ctx.tp_size > 1 else {}
        self.backbone = backbone_of(self.hf_model)
        self.state = StepState()
        self._head_hidden: torch.Tensor | None = None  # set while compute_logits runs the head
        self._head_output_cls = None  # the backbone's output class, seen in the profile pass
        self._install_head_switch()
        self.kv_cache_specs: list[KVCacheSpec] | None = None  # set by the profile pass
        # recurrent layers (``recurrent.py``), set after loading: their mixers, and per mixer the
        # states one sequence needs (the runner's state pool); empty without such layers
        self.recurrent: RecurrentLayers | None = None
        self.state_specs: list[list[StateSpec]] = []
        self.layer_specs: list = []
        self.supports_cuda_graph = True
        self.cuda_graph_reason: str | None = None
        self.fuse = self.device.type == "cuda"  # fusions.py after loading (CUDA: for speed)
        self.fusion_stats: dict[str, int] = {}
        self._type_buffers: list[tuple[nn.Module, int]] = []  # see _token_type_buffers

    @classmethod
    def build(cls, hf_config, ctx: ModelContext, dtype: torch.dtype, device) -> GenericForCausalLM:
        """What ``registry.build_model`` calls (the model builds on meta itself)."""
        return cls(hf_config, ctx, dtype, device)

    @staticmethod
    def unsupported_refusal(hf_config) -> Refusal | None:
        """Why the generic path refuses ``hf_config`` before building it, or None."""
        return static_refusal(hf_config)

    @staticmethod
    def tp_refusal(hf_config, tp_size: int) -> Refusal | None:
        """Why this path cannot split ``hf_config`` over ``tp_size`` ranks, or None: judged on a
        meta build in the calling process, before any worker starts (each would fail alike)."""
        try:
            model = build_on_meta(hf_config, torch.float32, torch.device("cpu"))
        except Exception:  # noqa: BLE001  the build in the worker says why, by name
            return None
        why = recurrent_refusal(model, tp_size)  # names tensor_parallel_size itself
        if why is not None:
            return why
        return tp_plan_refusal(model, tp_size)

    @staticmethod
    def hf_class(hf_config) -> type:
        """The transformers class built for ``hf_config``."""
        return resolve_hf_class(hf_config)

    # ---- protocol ---------------------------------------------------------------------------

    def load_weights(self, source) -> None:
        """Weights from a checkpoint directory or an in-memory HF model, then the profile pass.

        Raises:
            UnsupportedModelError: the profile pass found something the engine can't run.
            ValueError / FileNotFoundError: the weights do not match or are not there.
        """
        if isinstance(source, (nn.Module, BaseWeights)):
            # a PEFT model: its LoRA merged, or (``BaseWeights``) its base weights for LoRA slots
            merge = not isinstance(source, BaseWeights)
            hf = source if merge else source.model
            params = None
            if peft.is_peft_model(hf) or peft.tuner_modules(hf):
                params = dict(iter_model_weights(hf, merge_lora=merge))
            load_from_module(self.hf_model, peft.unwrap(hf), self.device, self.shard_rules, params)
        elif isinstance(source, (str, os.PathLike)):
            load_from_checkpoint(self.hf_model, source, self.device, self.dtype, self.shard_rules)
        else:
            raise TypeError(f"source={type(source).__name__} is not a directory or an nn.Module")
        left = meta_tensor_attributes(self.hf_model)
        if left:
            raise UnsupportedModelError(f"tensors computed at init cannot be rebuilt: {left[:4]}")
        if self.fuse:
            from hf_paged.models.generic.fusions import apply_fusions

            try:
                self.fusion_stats = apply_fusions(self.hf_model)
            except Exception as e:  # noqa: BLE001  a module shape the rewrites did not expect
                raise UnsupportedModelError(
                    f"the CUDA fusions failed on this model: {type(e).__name__}: {e}"
                ) from e
        self._type_buffers = _token_type_buffers(self.hf_model)
        if registry.recurrent_modules(self.hf_model):  # after the fusions: they swap modules
            self.recurrent = RecurrentLayers(self.hf_model)
            self.state_specs = self.recurrent.state_specs()
        self._profile()
        if self.device.type == "cuda" and self.supports_cuda_graph:
            from hf_paged.models.generic.graph_probe import cuda_graph_refusal

            refusal = cuda_graph_refusal(self, self.ctx.kv_block_size)
            self.cuda_graph_reason = None if refusal is None else refusal.detail
            self.supports_cuda_graph = self.cuda_graph_reason is None

    def refresh_weights(self, weights, dry_run: bool = False) -> int:
        """Copy ``(HF name, full tensor)`` pairs into the parameters, in place (the protocol's
        optional refresh; ``weights.refresh_weights``). Returns how many were copied."""
        return refresh_weights(self.hf_model, weights, self.shard_rules, dry_run)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        embeds=None,  # StepEmbeds: prompt-embedding rows (``worker/step_inputs.py``)
    ) -> torch.Tensor:  # [T, hidden]
        with self.state.active(meta=meta):
            if self.recurrent is None:
                return self._backbone(input_ids, positions, embeds)
            self.recurrent.begin(meta)
            try:
                return self._backbone(input_ids, positions, embeds)
            finally:
                self.recurrent.end()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] through the HF model's own head code (on rank 0; None on
        the other ranks)."""
        logits = self.head_logits(hidden)
        return logits if self.ctx.tp_rank == 0 else None

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` on every rank (the head is replicated)."""
        self._head_hidden = hidden.unsqueeze(0)
        try:
            dummy = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = self.hf_model(input_ids=dummy, use_cache=False)
        finally:
            self._head_hidden = None
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0]

    # ---- internals --------------------------------------------------------------------------

    def _backbone(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  embeds=None) -> torch.Tensor:  # fmt: skip
        if self._type_buffers and input_ids.shape[0] > self._type_buffers[0][1]:
            self._type_buffers = _grow_token_types(self._type_buffers, input_ids.shape[0])
        # [T] -> [1, T]; M-RoPE's [3, T] -> [3, 1, T]
        pos = positions[None] if positions.dim() == 1 else positions[:, None]
        if embeds is None:
            out = self.backbone(input_ids=input_ids[None], position_ids=pos, use_cache=False)
        else:
            out = self.backbone(position_ids=pos, use_cache=False, **self._embed_inputs(
                input_ids, embeds))  # fmt: skip
        self._head_output_cls = type(out)
        return out[0][0]  # last_hidden_state [1, T, hidden] -> [T, hidden]

    def _embed_inputs(self, input_ids: torch.Tensor, embeds) -> dict:
        """The backbone's keyword inputs for a step with prompt embeddings: the ids' embeddings
        with the rows put in place, and DeepStack's rows with their positions (Qwen3-VL's text
        model adds them after its first layers, in position order)."""
        hidden = self.backbone.get_input_embeddings()(input_ids[None])[0]  # [T, H]
        kwargs = {"inputs_embeds": embeds.scatter(hidden)[None]}
        if embeds.deepstack is not None:
            mask = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            mask[embeds.deepstack_index] = True
            kwargs["visual_pos_masks"] = mask[None]  # [1, T]
            kwargs["deepstack_visual_embeds"] = list(embeds.deepstack.to(hidden.dtype))
        return kwargs

    def _install_head_switch(self) -> None:
        """The backbone's forward returns ``_head_hidden`` while ``compute_logits`` runs."""
        backbone, owner = self.backbone, self
        real_forward = type(backbone).forward

        def forward(module, *args, **kwargs):
            if owner._head_hidden is not None:  # what the real forward returns, hidden only
                return owner._head_output_cls(last_hidden_state=owner._head_hidden)
            return real_forward(module, *args, **kwargs)

        backbone.forward = types.MethodType(forward, backbone)

    @torch.no_grad()
    def _profile(self) -> None:
        """Profile pass (``profile.py``), then one hf_paged ``Attention`` per attention module."""
        from hf_paged.models.registry import default_dtype

        self.state.rope_calls, self.state.rope_mismatch = 0, False
        records = profile.profile_pass(self)
        modules = dict(self.hf_model.named_modules())
        per_module: dict[str, list] = {}
        with default_dtype(self.dtype):  # the backend choice reads the model dtype from it
            for i, rec in enumerate(records):  # KV layer i = the i-th attention call
                per_module.setdefault(rec.module_name, []).append(
                    (Attention(rec.spec, self.ctx, i), rec.sinks)
                )
        for name, calls in per_module.items():
            binding = LayerBinding(tuple(a for a, _ in calls), tuple(s for _, s in calls))
            modules[name].__dict__[BINDING_ATTR] = binding
        sink_backends = [sink_backend(a.backend) for calls in per_module.values()
                         for a, has_sinks in calls if has_sinks]  # fmt: skip
        if any(not b.supports_cuda_graph for b in sink_backends):
            self.supports_cuda_graph = False
            self.cuda_graph_reason = "attention sinks run on a torch path that syncs the host"
        self.kv_cache_specs = [profile.kv_cache_spec(r.spec) for r in records]
        # rope handed to the attention layer (rope.py) when every profiled rope call's outputs
        # went straight into an attention call
        st = self.state
        st.defer_rope = envs.HF_PAGED_FUSED and st.rope_calls > 0 and not st.rope_mismatch
        self.layer_specs = [r.spec for r in records]


def _token_type_buffers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(module, length) of each ``token_type_ids`` buffer ``[1, N]`` (BERT-style
    embeddings), shortest first. BigBird slices it by the step's length
    (``token_type_ids[:, :seq_length]``), and a flattened step of many prompts is longer than
    ``N`` (``max_position_embeddings``): ``_grow_token_types`` pads it with zeros first.

    Raises:
        UnsupportedModelError: such a buffer is not all zeros (a flattened step would give its
            tokens the types of other positions).
    """
    found = []
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if name != "token_type_ids" or buf.dim() != 2 or buf.shape[0] != 1:
                continue
            if buf.is_floating_point() or bool(buf.any()):
                raise UnsupportedModelError(
                    f"{type(module).__name__}.token_type_ids is not an all-zero index buffer"
                )
            found.append((module, buf.shape[1]))
    return sorted(found, key=lambda f: f[1])


def _grow_token_types(buffers: list, length: int) -> list[tuple[nn.Module, int]]:
    """The buffers of ``_token_type_buffers``, each replaced by zeros of ``[1, length]``."""
    grown = []
    for module, n in buffers:
        if n < length:
            old = module._buffers["token_type_ids"]
            module._buffers["token_type_ids"] = torch.zeros(
                1, length, dtype=old.dtype, device=old.device
            )
            n = length
        grown.append((module, n))
    return grown
