"""`python -m amdllm.course build|path|data`: the embedded default model (see amdllm.course.default_model)."""
import sys

from amdllm.course.default_model import main

sys.exit(main())
