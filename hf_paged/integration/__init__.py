"""Hugging Face integration: every front end over one paged call (``paged_call.py``).

What patches or stands in for Hugging Face objects: the ``generate`` dispatcher
(``dispatch.py``), ``AutoPagedModelForCausalLM`` (``auto.py``), pipelines (``pipeline/``) and
lm-eval's HFLM (``lm_eval/``); the front ends users call live in ``hf_paged.entrypoints``. They share the call's preparation (``prepare.py``), its native plan
(``plan.py``), the external-sampling loop (``external.py``), the "can it run paged" checks
(``servable.py``), the engine owner (``engine_owner.py``) and the fallback (``fallback.py``).
Import the modules themselves: this package imports nothing (``import hf_paged`` stays light).
"""
