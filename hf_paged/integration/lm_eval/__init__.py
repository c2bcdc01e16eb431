"""lm-eval's HFLM on the paged engine (``install.py``): ``generate_until``, loglikelihood and
loglikelihood_rolling served by one engine run each; ``--model hf-paged`` (``model.py``)."""

from hf_paged.integration.lm_eval.install import (
    HFLM_MODULE,
    MODEL_NAME,
    install_lm_eval,
    is_lm_eval_installed,
    uninstall_lm_eval,
)

__all__ = ["HFLM_MODULE", "MODEL_NAME", "install_lm_eval", "is_lm_eval_installed",
           "uninstall_lm_eval"]  # fmt: skip
