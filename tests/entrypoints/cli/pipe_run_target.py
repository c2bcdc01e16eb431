"""A program for ``hf-paged run`` tests: prints what it sees; ``exit=N`` in argv exits with N."""

import json
import os
import sys

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv,
                "name": __name__,
                "backend": os.environ.get("HF_PAGED_BACKEND"),
                "path0": sys.path[0],
            }
        )
    )
    for arg in sys.argv[1:]:
        if arg.startswith("exit="):
            sys.exit(int(arg[5:]))
