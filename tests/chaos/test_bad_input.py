"""Bad input from the dataset: every kind must end in an error from next() that says what was wrong.

The writer that meets the bad chunk raises; the trainer raises ``WorkerDied`` carrying the writer's traceback
(never respawning a child that raised). The message must name the field (``chunk[0]['x']``) or carry the
dataset's own exception text and function name. The dataset stamps the wall-clock time of its first bad chunk
into a file, so the test measures the time from the fault to the trainer's exception.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from chaos_datasets import ChaosDataset
from timing import startup_deadline

from gigashuffle import GigashuffleError, WorkerDied

# "Within a few seconds": 10 s on an idle 2-core machine, more when a start-up takes longer than 2.5 s right now (a
# loaded machine schedules the dying writer, its zygote and the trainer as late as it starts a process). It stays
# under the 30 s of redis_timeout_s, a wait the error must not come after, until a start-up takes 7.5 s.
RAISE_LIMIT_S = startup_deadline(10.0, 4)

# fault -> (when it may first happen: "first", "later" or "any", strings the error must contain)
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ragged": ("any", ("chunk[0]['check']", "rows")),
    "extra_field": ("later", ("'surprise'", "differ from the first chunk")),
    "dtype": ("later", ("chunk[0]['x']", "int32")),
    "shape": ("later", ("chunk[0]['x']", "int64[12]")),
    "non_tensor": ("any", ("chunk[0]['x']", "list")),
    "tensors_chunk": ("any", ("chunk[0] must be a non-empty dict of tensors", "got Tensor")),
    "complex": ("any", ("chunk[0]['x']", "complex64")),
    "object_np": ("any", ("chunk[0]['x']", "object")),
    "str_np": ("any", ("chunk[0]['x']", "<U")),
    "writer_mismatch": ("first", ("chunk[0]['x']", "float64")),
    "empty": ("first", ("empty chunks", "writer_max_retries")),
    "raise_iter": ("first", ("chaos dataset exploded in __iter__", "_explode_in_iter")),
    "raise_late": ("thousand", ("chaos dataset exploded after", "_explode_late")),
}
SEEDED_TWICE = ("ragged", "raise_late")  # first chunk vs a later one; a thousand chunks plus a random few


def _params() -> list[Any]:
    return [(fault, seed) for fault in CASES for seed in (range(2) if fault in SEEDED_TWICE else range(1))]


@pytest.mark.parametrize(("fault", "seed"), _params())
def test_bad_chunk_is_reported(chaos: Any, redis_url: str, fault: str, seed: int) -> None:
    when, expected = CASES[fault]
    rng = chaos.begin("bad input", fault, seed, redis_url)
    if when == "first" or (when == "any" and seed == 0):
        after = 0
    elif when == "thousand":
        after = 1000 + rng.randint(0, 100)
    else:
        after = rng.randint(1, 40)
    marks = chaos.tmp_path / "marks"
    marks.mkdir()
    dataset = ChaosDataset(rows=8, fault=fault, fault_after=after, mark_dir=str(marks))
    cfg = chaos.config(bs=8, writer_max_retries=5, num_writers=2 if fault == "writer_mismatch" else rng.choice((1, 2)))
    loader = chaos.loader(dataset, cfg)
    consumer = chaos.consumer(loader)
    limit = time.monotonic() + 180.0
    with pytest.raises(GigashuffleError) as excinfo:
        while time.monotonic() < limit:
            consumer.next()
    raised = time.time()
    err = excinfo.value
    text = f"{err}\n{getattr(err, 'traceback_text', '')}"
    for needle in expected:
        assert needle in text, f"{needle!r} is not in the error:\n{text}"
    assert isinstance(err, WorkerDied), f"{type(err).__name__}: {err}"
    assert err.role == "writer" and err.exitcode == 1 and err.traceback_text, (err.role, err.exitcode)
    stamps = [float(p.read_text()) for p in Path(marks).glob("fault-*")]
    assert stamps, "the dataset never reached its fault"
    detect_s = raised - min(stamps)
    assert detect_s < RAISE_LIMIT_S, f"the error came {detect_s:.1f} s after the bad chunk"
    consumer.assert_unique()
    last = str(err).split("\n", 1)[0]
    chaos.finish(f"error: WorkerDied ({fault})", detect_s=detect_s, fault_after=after, batches=consumer.batches,
                 message=last[:300])  # fmt: skip
