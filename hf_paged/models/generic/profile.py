"""The profile pass: one tiny forward whose attention calls are recorded, not served.

Per attention module it records the local query and KV heads, the K and V head dims, the scale,
the sliding window and the softcap the module passes, and how often it was called. From that
come the KV cache specs (one per attention module, in call order) and each module's
``AttentionLayerSpec``. Whatever the paged attention cannot reproduce exactly (a mask the model
built itself, attention sinks, a second call per layer, a non-causal module, keys that are not
the new tokens' own...) is collected as a named reason and raised as ``UnsupportedModelError``.

The recorded calls return plain causal attention within each profile sequence (with the window
and softcap), so the forwards' outputs are real ones, and two checks run on them:

* flattening: two sequences run as one flattened row must give each sequence's hidden states
  as when run alone. Anything that mixes tokens outside the attention function (recurrent,
  convolution or token-shift layers, attention computed by hand, positions derived from the
  row length) fails it.
* the head: ``compute_logits`` on the backbone's hidden states must equal the HF forward's
  logits (the causal LM's forward must do nothing else with its backbone's output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.attention.base import AttentionLayerSpec
from hf_paged.attention.kv_cache import KVCacheSpec
from hf_paged.models.protocol import UnsupportedModelError

# kwargs HF models pass to the attention function that do not change its math here (positions
# and lengths of the flattened batch are ours; flash-attention varlen hints are unused)
_IGNORED_KWARGS = {
    "position_ids", "cache_position", "use_cache", "output_attentions", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "position_embeddings", "layer_idx",
    "output_hidden_states", "return_dict", "past_key_values", "cache", "is_causal",
    "output_router_logits", "logits_to_keep",
}  # fmt: skip
# read into the spec; ``alibi_slopes`` ([H] tensor) is passed by the adapters (``adapters/``)
_READ_KWARGS = {"sliding_window", "softcap", "s_aux", "alibi_slopes"}


@dataclass
class LayerRecord:
    """One attention call of one forward: a KV layer of its own."""

    module_name: str
    call: int  # the module's n-th attention call in a forward (DiffLlama makes two)
    spec: AttentionLayerSpec
    sinks: bool = False  # the module passes attention sinks (``s_aux``, one logit per head)


class Recorder:
    """Collects one ``LayerRecord`` per attention call, in call order (a module called twice
    in a forward gets two records, so two KV layers).

    Args:
        module_names: id(module) -> qualified name, for the reasons' text.
        positions: [T] position of each token of the flattened row.
        segments: [T] which sequence each token belongs to (attention stays within one).
    """

    def __init__(self, module_names: dict[int, str], positions, segments):
        self.names = module_names
        self.positions, self.segments = positions, segments
        self.records: dict[tuple[int, int], LayerRecord] = {}  # (id(module), call) -> record
        self.calls: dict[int, int] = {}  # id(module) -> calls so far
        self.reasons: list[str] = []

    def refuse(self, name: str, why: str) -> None:
        msg = f"{name}: {why}"
        if msg not in self.reasons:
            self.reasons.append(msg)

    def record(self, module, query, key, value, mask, scaling, dropout, kwargs):
        name = self.names.get(id(module), type(module).__name__)
        call = self.calls.get(id(module), 0)
        self.calls[id(module)] = call + 1
        spec = self._spec(name, module, query, key, value, mask, scaling, dropout, kwargs)
        sinks = kwargs.get("s_aux")
        if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
            self.refuse(name, f"attention sinks of shape {tuple(sinks.shape)}, not one per head")
        self.records[(id(module), call)] = LayerRecord(name, call, spec, sinks is not None)
        return self._reference(query, key, value, spec, sinks), None

    def _spec(self, name, module, query, key, value, mask, scaling, dropout, kwargs):
        if query.dim() != 4 or query.shape[0] != 1:
            self.refuse(name, f"query of shape {tuple(query.shape)}, expected [1, H, T, D]")
        if mask is not None:
            self.refuse(name, "the model builds its own attention mask")
        if dropout:
            self.refuse(name, f"attention dropout {dropout}")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            self.refuse(name, "non-causal attention")
        if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
            self.refuse(name, "keys are not the new tokens' own (KV sharing or a memory)")
        if key.shape[-1] != query.shape[-1]:
            self.refuse(name, f"query head dim {query.shape[-1]} != key head dim {key.shape[-1]}")
        if query.shape[1] % key.shape[1]:
            self.refuse(name, f"{query.shape[1]} query heads over {key.shape[1]} KV heads")
        for k, val in kwargs.items():
            if k not in _IGNORED_KWARGS and k not in _READ_KWARGS and val is not None:
                self.refuse(name, f"an attention input the paged path does not implement ({k}=...)")
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        dim, dim_v = query.shape[-1], value.shape[-1]
        slopes = kwargs.get("alibi_slopes")
        if slopes is not None and tuple(slopes.shape) != (query.shape[1],):
            self.refuse(name, f"ALiBi slopes of shape {tuple(slopes.shape)}, not one per head")
        return AttentionLayerSpec(
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=dim,
            scale=float(scaling) if scaling is not None else dim**-0.5,
            sliding_window=int(window) if window else None,
            head_dim_v=dim_v if dim_v != dim else None,
            softcap=float(softcap) if softcap else None,
            alibi_slopes=tuple(float(x) for x in slopes.tolist()) if slopes is not None else None,
        )

    def _reference(self, query, key, value, spec: AttentionLayerSpec, sinks=None) -> torch.Tensor:
        """Causal attention within each sequence: [1, H, T, D] -> [1, T, H, Dv]."""
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        group = q.shape[0] // k.shape[0]
        if group > 1 and q.shape[0] % k.shape[0] == 0:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        t = q.shape[1]
        pos, seg = self.positions[:t], self.segments[:t]
        idx = torch.arange(t, device=q.device)
        mask = (idx[None, :] <= idx[:, None]) & (seg[None, :] == seg[:, None])  # [Tq, Tk]
        if spec.sliding_window is not None:
            mask &= (pos[:, None] - pos[None, :]) < spec.sliding_window
        scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
        if spec.softcap is not None:
            scores = spec.softcap * torch.tanh(scores / spec.softcap)
        if spec.alibi_slopes is not None:
            slopes = torch.tensor(spec.alibi_slopes, device=q.device).view(-1, 1, 1)
            scores = scores + slopes * (pos[None, :] - pos[:, None]).float()
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one extra logit per head that takes mass and gives no value
            sink = sinks.float().view(-1, 1, 1).expand(-1, t, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(0, 1).unsqueeze(0)
        return out.to(query.dtype).contiguous()

    def result(self, recurrent: bool = False) -> list[LayerRecord]:
        """The records in call order (none only for a model of ``recurrent`` layers alone).
        Raises UnsupportedModelError with every reason found."""
        if not self.records and not recurrent:
            self.reasons.append(
                "no attention call reached hf_paged's attention function (the model does not "
                "route attention through transformers' AttentionInterface)"
            )
        if self.reasons:
            raise UnsupportedModelError("; ".join(self.reasons))
        return list(self.records.values())


def kv_cache_spec(spec: AttentionLayerSpec) -> KVCacheSpec:
    return KVCacheSpec(
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v or spec.head_dim,
        sliding_window=spec.sliding_window,
    )


# profile sequences: lengths of the two sequences flattened into one row
_LENGTHS = (5, 4)


def profile_pass(model) -> list[LayerRecord]:
    """Run the profile forwards on a ``GenericForCausalLM`` whose weights are loaded.

    Returns:
        one record per attention module, in call order (= KV layer index).

    Raises:
        UnsupportedModelError: with every reason found.
    """
    names = {id(m): n for n, m in model.hf_model.named_modules()}
    dev = model.device
    g = torch.Generator().manual_seed(0)
    vocab = model.hf_model.config.get_text_config().vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).to(dev) for n in _LENGTHS]
    pos = [torch.arange(n, device=dev) for n in _LENGTHS]
    seg = [torch.full((n,), i, device=dev) for i, n in enumerate(_LENGTHS)]

    def backbone(i: slice, recorder=None):
        ids, p, s = torch.cat(seqs[i]), torch.cat(pos[i]), torch.cat(seg[i])
        rec = recorder or Recorder(names, p, s)
        with model.state.active(recorder=rec):
            return model._backbone(ids, p)

    recorder = Recorder(names, torch.cat(pos), torch.cat(seg))
    try:
        flat = backbone(slice(None), recorder)
        records = recorder.result(recurrent=model.recurrent is not None)
        alone = [backbone(slice(i, i + 1)) for i in range(len(seqs))]
        with model.state.active(recorder=Recorder(names, pos[0], seg[0])):
            full = model.hf_model(
                input_ids=seqs[0][None], position_ids=pos[0][None], use_cache=False
            )
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001  a model the flattened call cannot run
        raise UnsupportedModelError(f"the flattened forward failed: {type(e).__name__}: {e}") from e
    _check_flattening(flat, alone)
    _check_head(model, alone[0], full.logits[0])
    return records


def _close(a: torch.Tensor, b: torch.Tensor, half_tol: float = 2e-2) -> bool:
    tol = 1e-4 if a.dtype == torch.float32 else half_tol
    a, b = a.float(), b.float()
    return bool((a - b).norm() <= tol * b.norm() + 1e-6)


# Hidden states after every layer of a deep bf16/fp16 model differ between the flattened and the
# separate forwards by rounding alone (GEMMs of other shapes), a few percent of their norm on
# 32-layer 8B shapes; a layer that mixes the two sequences' tokens changes them by about their
# whole norm (independent sequences' states are uncorrelated), so 25% separates the two.
_FLATTEN_HALF_TOL = 0.25


def _check_flattening(flat: torch.Tensor, alone: list[torch.Tensor]) -> None:
    parts = zip(flat.split(_LENGTHS), alone, strict=True)
    if not all(_close(part, a, _FLATTEN_HALF_TOL) for part, a in parts):
        raise UnsupportedModelError(
            "sequences flattened into one row do not stay independent: the model mixes tokens "
            "outside its attention calls (recurrent, convolution or hand-written attention "
            "layers)"
        )


def _check_head(model, hidden: torch.Tensor, full_logits: torch.Tensor) -> None:
    try:
        split = model.head_logits(hidden)
    except Exception as e:  # noqa: BLE001
        raise UnsupportedModelError(
            f"the causal LM's head does not run apart from its backbone: {type(e).__name__}: {e}"
        ) from e
    if not _close(split, full_logits):
        raise UnsupportedModelError("the causal LM's forward does more than its backbone + head")
