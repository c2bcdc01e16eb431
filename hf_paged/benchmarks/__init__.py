"""The benchmarks' shared parts: request sets (``workloads.py``), random-weight models
(``random_models.py``), the record every result carries and its writing into a results folder
the caller names (``run_record.py``), the device between runs (``device_memory.py``), and the
systems they time (``runners.py``). ``evaluation/``'s scripts and ``hf-paged bench`` import them;
nothing here runs on import. Import the modules themselves: this package imports nothing
(``import hf_paged`` stays light).
"""
