"""``python -m hf_paged.entrypoints.cli``: the ``hf-paged`` command."""

from hf_paged.entrypoints.cli import console_main

console_main()
