"""The benchmarks' shared parts: request sets, random-weight models and the environment record
(``workloads.py``), and the systems they time (``runners.py``). ``evaluation/``'s scripts and
``hf-paged bench`` import them; nothing here runs on import. Import the modules themselves: this
package imports nothing (``import hf_paged`` stays light).
"""
