"""The GPU smoke test borrows the integration tests' datasets (``UniqueIds``, ``check_unique_batch``); the zygote
takes this sys.path, so the writer processes import them too."""

from __future__ import annotations

import os
import sys

_INTEGRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration")
if _INTEGRATION not in sys.path:
    sys.path.insert(0, _INTEGRATION)
