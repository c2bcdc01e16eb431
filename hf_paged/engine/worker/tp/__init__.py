"""Tensor parallelism over worker processes: rank 0's executor (``executor.py``), the worker
group and its shared-memory broadcast (``workers.py``, ``shm_broadcast.py``), the worker body
(``worker_main.py``) and its liveness signals (``worker_health.py``)."""
