"""`python -m amdllm.cli ...`: the same as the `amdllm` command."""
import sys

from amdllm.cli import main

sys.exit(main())
