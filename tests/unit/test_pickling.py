"""What the trainer sends its children: ``__main__``-style classes by value, module-like namespaces by name."""

from __future__ import annotations

import pickle

import torch

from gigashuffle.procs.pickling import dumps_by_value


def test_a_by_value_class_that_names_torch_namespaces_pickles() -> None:
    """A method that uses torch and reads attributes called ``classes`` and ``ops`` drags torch.classes and
    torch.ops (ModuleType subclasses in sys.modules) into the by-value pickle: they must travel by name."""

    class UsesNamespaces:  # local: cloudpickle sends it by value, as it would a class from __main__
        classes = 3

        def make(self) -> torch.Tensor:
            return torch.zeros(self.classes) + torch.ops.aten.add(torch.ones(1), 1)

    restored = pickle.loads(dumps_by_value(UsesNamespaces()))
    assert torch.equal(restored.make(), torch.full((3,), 2.0))
