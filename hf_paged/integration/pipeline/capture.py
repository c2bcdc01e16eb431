"""The ``generate`` keywords a generating pipeline's ``_forward`` would pass for one batch
(text-generation and image-text-to-text).

Whatever this transformers version's ``_forward`` derives from the pipeline's options, it is
recorded by running ``_forward`` on a view of the pipeline whose model stands in for
``generate``: other threads' calls on the pipeline itself are untouched.

``KwargsCache`` records it once per call and shape of batch: ``_forward`` derives the keywords
from the call's options (fixed for the call: the pipeline's options, the model's generation
config) and from the batch only through its tensors and whether the prompt is empty, so a batch
with the same input keys, the same number of rows and a non-empty / empty prompt alike takes the
recorded keywords with its own tensors (ids and mask; an image batch's pixels and token types
too). Stock's ``_forward`` deep-copies the model's generation
config for every batch (``to_diff_dict``): about 1 ms a batch, the largest per-item cost of a
pipeline at ``batch_size=1`` after tokenization.
"""

from __future__ import annotations

import torch


class _Captured(Exception):
    """Raised by ``_CaptureModel.generate``: carries the keywords it was called with."""

    def __init__(self, kwargs: dict):
        super().__init__("generate call captured")
        self.kwargs = kwargs


class _CaptureModel:
    """Stands in for the pipeline's model in one ``_forward`` call: records ``generate``'s
    keywords."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, *args, **kwargs):
        if args:
            raise TypeError("a pipeline's generate call is expected to pass keywords only")
        raise _Captured(kwargs)


def capture_generate_kwargs(pipe, inputs: dict, forward_params: dict) -> dict:
    """The keywords ``pipe._forward(inputs, **forward_params)`` calls ``model.generate`` with.

    Raises:
        RuntimeError: the pipeline's ``_forward`` did not call ``generate``; and what
            ``_forward`` raises for bad options.
    """
    view = object.__new__(type(pipe))  # same class, same attributes, another model
    view.__dict__.update(pipe.__dict__)
    view.model = _CaptureModel(pipe.model)
    model_inputs = pipe._ensure_tensor_on_device(dict(inputs), device=pipe.device)
    try:
        view._forward(model_inputs, **forward_params)
    except _Captured as c:
        return c.kwargs
    raise RuntimeError("the pipeline's _forward did not call model.generate")


class KwargsCache:
    """``capture_generate_kwargs`` for the batches of one pipeline call (see the module
    docstring): the first batch of each shape class is captured, later ones reuse its keywords
    with their own tensors."""

    def __init__(self, pipe, forward_params: dict):
        self._pipe = pipe
        self._forward_params = forward_params
        self._captured: dict[tuple, dict] = {}

    @staticmethod
    def _shape_class(inputs: dict) -> tuple:
        ids = inputs["input_ids"]
        return (frozenset(inputs), ids.shape[0], ids.shape[1] == 0)

    def get(self, inputs: dict) -> dict:
        """The keywords ``pipe._forward(inputs, **forward_params)`` calls ``generate`` with."""
        key = self._shape_class(inputs)
        known = self._captured.get(key)
        if known is None or known["input_ids"] is None:  # an empty prompt: captured each time
            kwargs = capture_generate_kwargs(self._pipe, inputs, self._forward_params)
            self._captured[key] = kwargs
            return kwargs
        tensors = self._pipe._ensure_tensor_on_device(
            {k: v for k, v in inputs.items() if k in known and isinstance(v, torch.Tensor)},
            device=self._pipe.device,
        )
        return {**known, **tensors}
