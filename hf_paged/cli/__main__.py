"""``python -m hf_paged.cli``: the ``hf-paged`` command."""

from hf_paged.cli import main

raise SystemExit(main())
