"""Variable-length fields: ``stack`` names the field and two shapes when a chunk's values differ, and ``FixedLength``
(a ``transform=`` of ``sources.Chunked`` and ``TarReader``) gives them one length, recording the real one."""

from __future__ import annotations

import pickle

import pytest
import torch

from gigashuffle.sources import FixedLength, chunks


def test_values_of_different_shapes_name_the_field_the_shapes_and_the_fix() -> None:
    samples = [{"y": i, "ids": torch.arange(i + 1)} for i in range(3)]
    with pytest.raises(
        ValueError, match=r"field 'ids' has values of different shapes \(\[1\] and \[2\]\).*FixedLength"
    ):
        list(chunks(iter(samples), 3))


def test_fixed_length_pads_cuts_and_records_the_real_length() -> None:
    fix = FixedLength({"ids": 4, "frames": 2}, pad=-1)
    samples = [
        {"ids": list(range(n)), "frames": torch.ones(n + 1, 3) * n, "y": n} for n in (1, 4, 6)
    ]  # token ids as a list, frames as (T, 3), a label that passes as it is
    (chunk,) = list(chunks(map(fix, samples), 3))
    group = chunk[0]
    assert group["ids"].tolist() == [[0, -1, -1, -1], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert group["ids_length"].tolist() == [1, 4, 4]
    assert group["frames"].shape == (3, 2, 3) and group["frames_length"].tolist() == [2, 2, 2]
    assert group["frames"][0].tolist() == [[1.0] * 3, [1.0] * 3] and group["y"].tolist() == [1, 4, 6]
    assert set(group) == {"ids", "ids_length", "frames", "frames_length", "y"}
    again = pickle.loads(pickle.dumps(fix))  # it travels to the writers with the dataset
    assert again({"ids": [7], "frames": torch.zeros(1, 3)})["ids"].tolist() == [7, -1, -1, -1]
    plain = FixedLength({"ids": 2}, length_field=None)({"ids": torch.tensor([5, 6, 7])})
    assert plain.keys() == {"ids"} and plain["ids"].tolist() == [5, 6]


@pytest.mark.parametrize(
    ("make", "error", "text"),
    [
        (lambda: FixedLength({"ids": 0}), ValueError, r"lengths\['ids'\]=0 is invalid: use a positive int"),
        (lambda: FixedLength({"ids": True}), ValueError, r"lengths\['ids'\]=True is invalid"),
        (lambda: FixedLength({"ids": 4}, length_field="length"), ValueError, r"length_field='length' is invalid"),
        (lambda: FixedLength({"ids": 4})({"x": [1]}), KeyError, r"a sample has no field 'ids'; its fields are \['x'\]"),
        (lambda: FixedLength({"ids": 4})({"ids": 3}), ValueError, r"field 'ids' is a scalar"),
        (lambda: FixedLength({"ids": 4})({"ids": "abc"}), TypeError, r"sample field 'ids' is a str"),
    ],
)
def test_fixed_length_refuses_what_it_cannot_fix_naming_it(make: object, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        make()  # type: ignore[operator]
