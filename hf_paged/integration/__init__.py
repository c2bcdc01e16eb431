"""Hugging Face integration: every front end over one paged call (``paged_call.py``).

Front ends: the ``generate`` dispatcher (``dispatch.py``), ``AutoPagedModelForCausalLM``
(``auto.py``), pipelines (``pipeline/``), ``Dataset.map`` (``datasets_map.py``) and lm-eval's
HFLM (``lm_eval/``). They share the call's preparation (``prepare.py``), its native plan
(``plan.py``), the external-sampling loop (``external.py``), the "can it run paged" checks
(``servable.py``), the engine owner (``engine_owner.py``) and the fallback (``fallback.py``).
Import the modules themselves: this package imports nothing (``import hf_paged`` stays light).
"""
