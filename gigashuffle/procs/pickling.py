"""How the trainer pickles what its children need: by value for whatever ``__main__`` defines.

NOTE [ Pickling the dataset ]
The children are forked from the zygote, whose ``__main__`` is ``gigashuffle.procs.zygote``, not the training script:
the zygote never runs the trainer's main module (a script without an ``if __name__ == "__main__":`` guard would
build a second loader there). A class defined in ``python -c``, a notebook, a REPL or a script's ``__main__``
therefore cannot be found by name in a child; cloudpickle stores such classes and functions by value (it does
so for ``__main__`` by default) and everything importable by reference, as pickle would. The children load the
payload with plain ``pickle.loads``; cloudpickle's reconstructors are importable there.

Some libraries register objects in ``sys.modules`` that are not plain modules (torch's ``torch.classes`` and
``torch.ops`` namespaces are ``ModuleType`` subclasses, which cloudpickle's module reducer does not take).
cloudpickle sends a by-value function the submodules its code names, so a method that uses ``torch`` and reads an
attribute called ``classes`` or ``ops`` drags such an object in, and it cannot be pickled. They travel by reference
instead: the child imports the same name.
"""

from __future__ import annotations

import importlib
import io
import pickle
import sys
import types
from typing import Any

import cloudpickle


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        # What sys.modules holds that is not a plain module: named, since it cannot be pickled by value.
        self._namespaces = {
            id(value): name
            for name, value in list(sys.modules.items())
            if value is not None and type(value) is not types.ModuleType
        }

    def reducer_override(self, obj: Any) -> Any:
        name = self._namespaces.get(id(obj))
        if name is not None:
            return importlib.import_module, (name,)
        return super().reducer_override(obj)


def dumps_by_value(obj: Any) -> bytes:
    """Pickle ``obj`` for a child of this loader; what ``__main__`` defines travels by value."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()
