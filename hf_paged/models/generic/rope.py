"""Deferred rotary embedding: the paged attention layer rotates q and k itself.

Most HF decoders rotate q and k with a module-level ``apply_rotary_pos_emb`` copied from
Llama's (``q * cos + rotate_half(q) * sin``: ten elementwise launches per layer), then pass the
results straight to the attention function. The native path does that rotation and the KV-cache
write in one launch (``layers.attention.Attention`` with ``RopeInputs``). Here, for a modeling
module whose ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's (same code, docstrings
aside), the module global is wrapped: inside a generic engine step that deferred rope was
enabled for, it returns q and k unrotated and leaves cos/sin with the step state; the attention
function then finds its own query/key among them and hands the rotation to ``Attention``.
Anywhere else (stock models in the same process, the profile pass, other inputs) the wrapper
calls the original.

The profile pass enables it per model only if every attention call's query and key were the
very tensors the preceding rope call returned (nothing ran on them in between); a step that
breaks this raises instead of attending unrotated keys.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass

import torch

_WRAPPED_ATTR = "_hf_paged_deferred_rope"


@dataclass
class PendingRope:
    """The last rope call of a forward: the tensors it returned and its cos/sin [T, D]."""

    q: torch.Tensor
    k: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    consumed: bool = False  # the profile pass saw an attention call take q and k


def code_body(fn) -> str | None:
    """``fn``'s code as an AST dump without its docstring and name (None: no source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return ast.dump(ast.Module(body=body, type_ignores=[])) + ast.dump(node.args)


def plain_function(fn):
    """The function behind ``fn``: transformers >= 5.25 with the ``kernels`` package makes a
    module-level function such as ``apply_rotary_pos_emb`` a hub-kernel ``Func`` module whose
    forward calls the function it was made from (a closure variable ``func``); anything else is
    returned as it is."""
    forward = getattr(type(fn), "forward", None) if isinstance(fn, torch.nn.Module) else None
    if forward is None or not inspect.isfunction(forward):
        return fn
    inner = inspect.getclosurevars(forward).nonlocals.get("func")
    return inner if inspect.isfunction(inner) else fn


@functools.cache
def _reference() -> tuple[str | None, str | None]:
    from transformers.models.llama import modeling_llama as llama

    return (code_body(plain_function(llama.apply_rotary_pos_emb)),
            code_body(plain_function(llama.rotate_half)))  # fmt: skip


def _is_llama_rope(module_globals: dict) -> bool:
    fn, rot = module_globals.get("apply_rotary_pos_emb"), module_globals.get("rotate_half")
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, _WRAPPED_ATTR, False) else fn
    fn, rot = plain_function(fn), plain_function(rot)
    if not (inspect.isfunction(fn) and inspect.isfunction(rot)):
        return False
    ref_fn, ref_rot = _reference()
    return ref_fn is not None and code_body(fn) == ref_fn and code_body(rot) == ref_rot


def _wrap(original):
    from hf_paged.models.generic.attention import current_state

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        state = current_state()
        if state is None:
            return original(q, k, cos, sin, *args, **kwargs)
        if state.recorder is not None:  # profile pass: rotate, and see where the outputs go
            state.rope_calls += 1
            prev = state.pending_rope  # its outputs must have reached an attention call
            state.rope_mismatch |= (prev is not None and not prev.consumed) or bool(args or kwargs)
            state.rope_mismatch |= not _deferrable(q, k, cos)
            q, k = original(q, k, cos, sin, *args, **kwargs)
            state.pending_rope = PendingRope(q, k, cos[0], sin[0])
            return q, k
        if not state.defer_rope or args or kwargs or not _deferrable(q, k, cos):
            return original(q, k, cos, sin, *args, **kwargs)
        state.pending_rope = PendingRope(q, k, cos[0], sin[0])
        return q, k

    setattr(apply_rotary_pos_emb, _WRAPPED_ATTR, True)
    return apply_rotary_pos_emb


def _deferrable(q, k, cos) -> bool:
    """[1, H, T, D] q and k with [1, T, D] cos of one dtype (the flattened generic row)."""
    return (
        q.dim() == 4 and k.dim() == 4 and q.shape[0] == 1 and cos.dim() == 3
        and cos.shape[0] == 1 and q.shape[2] == k.shape[2] == cos.shape[1]
        and q.shape[3] == k.shape[3] == cos.shape[2] and q.dtype == k.dtype == cos.dtype
    )  # fmt: skip


def install(model: torch.nn.Module) -> list[str]:
    """Wrap ``apply_rotary_pos_emb`` in every modeling module of ``model``'s submodules whose
    rope is Llama's; the names of the modules wrapped (or already wrapped)."""
    done = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(name)
        if mod is None or not _is_llama_rope(vars(mod)):
            continue
        if not getattr(mod.apply_rotary_pos_emb, _WRAPPED_ATTR, False):
            mod.apply_rotary_pos_emb = _wrap(mod.apply_rotary_pos_emb)
        done.append(name)
    return done
