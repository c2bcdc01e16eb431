"""The engine's tensor side: the ModelRunner (one per rank) and what only it uses (step inputs,
decode CUDA graphs, the KV budget, prompt scoring), the executors that reach it, and ``tp/``
(ranks 1..N-1 in worker processes)."""
