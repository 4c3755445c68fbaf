"""The Triton read path runs on CPU tensors under the interpreter, which triton reads when a kernel is defined:
set it before any test module imports ``kvcert.kernels.triton_read``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
