"""The engine's plain-data side (no torch, checked by ``tests/test_package_layout.py``):
sequences, KV blocks and the prefix cache, the scheduler, requests and the one request loop, the
stop rule, and the contracts the scheduler hands the runner."""
