"""asv benchmarks of gigashuffle (see asv.conf.json at the repository root)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# With environment_type "existing" asv does not install the project, so a checkout that was not
# pip-installed into the interpreter would not find gigashuffle: fall back to the working tree.
if importlib.util.find_spec("gigashuffle") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
