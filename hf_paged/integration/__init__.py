"""Hugging Face integration: what patches or stands in for Hugging Face objects, over one route
for a paged call (``route.py``).

The ``generate`` dispatcher (``dispatch.py``), ``AutoPagedModelForCausalLM`` (``auto.py``),
pipelines (``pipeline/``) and lm-eval's HFLM (``lm_eval/``); the front ends users call live in
``hf_paged.entrypoints``. They share the route (``route.py``: the call's preparation,
``prepare.py``; its plan, ``plan.py``; then native requests, the external-sampling loop,
``external.py``, or beams, ``beam_search.py``), the "can it run paged" checks
(``servable.py``), the engine owner (``engine_owner.py``) and the fallback (``fallback.py``).
Import the modules themselves: this package imports nothing (``import hf_paged`` stays light).
"""
