"""`python -m dllm_operator` (and the dllm-operator console script)."""

import sys

from dllm_operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
