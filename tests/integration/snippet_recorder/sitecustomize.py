"""Records what each loader of a process delivered, for ``test_snippets.py``: a README script runs unchanged while
this directory is on its ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up, in every process torchrun
starts too) and ``GIGASHUFFLE_SNIPPET_RECORD`` names a folder.

``MultiprocessShuffledDataloader.__iter__`` is wrapped: each batch it yields appends one JSON line to
``<folder>/rank<RANK>-<pid>.jsonl``, the list of its rows' digests (every field but ``INDEX_KEY``, row by row), so
a test can tell whether a resumed run delivered rows that the first run delivered. ``DistributedDataParallel`` is
wrapped too: a process that builds one appends its world size to ``<folder>/ddp-rank<RANK>-<pid>``, so a test can
tell that torchrun's ranks trained one model rather than a model each. Nothing else changes; without the variable
this module does nothing.
"""

from __future__ import annotations

import os

FOLDER = os.environ.get("GIGASHUFFLE_SNIPPET_RECORD")


def _install(folder: str) -> None:
    import functools
    import hashlib
    import json

    import torch

    from gigashuffle import INDEX_KEY, MultiprocessShuffledDataloader

    def digests(batch: object) -> list[str]:
        groups = batch if isinstance(batch, list) else [batch]
        fields = [t for group in groups for key, t in sorted(group.items()) if key != INDEX_KEY]  # type: ignore[attr-defined]
        rows = len(fields[0])
        as_bytes = [t.detach().cpu().contiguous().reshape(rows, -1).view(torch.uint8).numpy() for t in fields]
        return [hashlib.blake2b(b"".join(f[r].tobytes() for f in as_bytes), digest_size=8).hexdigest()
                for r in range(rows)]  # fmt: skip

    original = MultiprocessShuffledDataloader.__iter__

    @functools.wraps(original)
    def recorded(self: MultiprocessShuffledDataloader):  # type: ignore[no-untyped-def]
        path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl")
        with open(path, "a") as out:
            for batch in original(self):
                out.write(json.dumps(digests(batch)) + "\n")
                out.flush()
                yield batch
                del batch  # hold no batch (and its ring slot) longer than the caller does

    MultiprocessShuffledDataloader.__iter__ = recorded  # type: ignore[method-assign]

    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def ddp_recorded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        ddp_init(self, *args, **kwargs)
        path = os.path.join(folder, f"ddp-rank{os.environ.get('RANK', '0')}-{os.getpid()}")
        with open(path, "a") as out:
            out.write(f"{torch.distributed.get_world_size()}\n")

    torch.nn.parallel.DistributedDataParallel.__init__ = ddp_recorded  # type: ignore[method-assign]


if FOLDER:
    _install(FOLDER)
