"""``--model hf-paged``: lm-eval's HFLM with every request on the paged engine.

Registered by ``hf_paged.integration.lm_eval.install_lm_eval()`` (``hf-paged run`` calls it).
lm-eval 0.4.13 discovers models only from its own table, so plain ``lm_eval --model hf-paged``
finds it only in a process where that ran: ``hf-paged run -m lm_eval --model hf-paged ...``.
"""

from __future__ import annotations

from lm_eval.models.huggingface import HFLM

from hf_paged.integration.lm_eval.install import install_lm_eval

install_lm_eval()  # HFLM's methods are the paged ones from here on


class HFPagedLM(HFLM):
    """HFLM (same ``--model_args``) whose generate_until / loglikelihood / loglikelihood_rolling
    run on the paged engine whatever the backend switch says; what the engine can't reproduce
    still runs stock, with a ``PagedFallbackWarning``."""

    always_paged = True
