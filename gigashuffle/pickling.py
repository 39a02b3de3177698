"""How the trainer pickles what its children need: by value for whatever ``__main__`` defines.

NOTE [ Pickling the dataset ]
The children are forked from the zygote, whose ``__main__`` is ``gigashuffle.zygote``, not the training script:
the zygote never runs the trainer's main module (a script without an ``if __name__ == "__main__":`` guard would
build a second loader there). A class defined in ``python -c``, a notebook, a REPL or a script's ``__main__``
therefore cannot be found by name in a child; cloudpickle stores such classes and functions by value (it does
so for ``__main__`` by default) and everything importable by reference, as pickle would. The children load the
payload with plain ``pickle.loads``; cloudpickle's reconstructors are importable there.
"""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle


def dumps_by_value(obj: Any) -> bytes:
    """Pickle ``obj`` for a child of this loader; what ``__main__`` defines travels by value."""
    payload: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return payload
