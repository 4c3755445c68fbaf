"""Make the shared test helpers of this folder (``bounds_adversarial``, ``bounds_stats``) importable.

The project runs pytest with ``--import-mode=importlib``, which does not put test folders on ``sys.path``;
the helpers are also used by ``benchmarks/soundness_fuzz.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
