"""Imported at Python's start by ``hf_paged_backend.pth`` when ``HF_PAGED_BACKEND`` is set (the
.pth line reads the variable itself; unset, nothing here runs).

``import hf_paged`` puts the ``generate`` and ``pipeline`` dispatchers on for when transformers
loads, and they read the switch: so ``HF_PAGED_BACKEND=paged python script.py`` runs the script's
``generate`` calls on the engine although the script never imports hf_paged, as ``hf-paged run``
does. That import loads no torch and no transformers. A failure here must not stop Python from
starting: it is said in one warning instead.
"""

try:
    import hf_paged  # noqa: F401  (its import installs the dispatchers)
except Exception as e:  # noqa: BLE001  (whatever it is, the interpreter must start)
    import warnings

    warnings.warn(
        f"HF_PAGED_BACKEND is set but hf_paged could not be imported at start-up "
        f"({type(e).__name__}: {e}); the switch does nothing in this process",
        RuntimeWarning,
        stacklevel=1,
    )
