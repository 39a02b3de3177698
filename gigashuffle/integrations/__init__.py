"""Adapters for the training frameworks: each module imports its framework, installed with the matching extra.

``gigashuffle.integrations.state`` (no framework) holds what they share: the rank-keyed state contract and the
gather of every rank's state for frameworks that save from rank 0 only (NOTE [ Rank-keyed state ]).

- ``lightning``: ``GigashuffleDataModule`` and ``GigashuffleCallback`` (``pip install gigashuffle[lightning]``);
- ``transformers``: ``GigashuffleTrainer`` (``pip install gigashuffle[transformers]``);
- ``accelerate``: ``register(accelerator, loader)`` (``pip install gigashuffle[accelerate]``);
- ``torch.distributed.checkpoint``: ``state.RankKeyedState(loader)`` is a ``Stateful`` (torch only).

The library never imports this package (an import-linter contract in pyproject.toml).
"""
