"""The ``generate`` keywords a text-generation pipeline's ``_forward`` would pass for one batch.

Whatever this transformers version's ``_forward`` derives from the pipeline's options, it is
recorded by running ``_forward`` on a view of the pipeline whose model stands in for
``generate``: other threads' calls on the pipeline itself are untouched.
"""

from __future__ import annotations


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
