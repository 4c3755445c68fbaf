"""The Triton read path runs on CPU tensors under the interpreter, which triton reads when it is first imported
(other libraries of the test session, transformers among them, may import it before ``tests/kernels`` is
collected): set it here, before any test module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
