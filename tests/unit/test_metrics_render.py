"""``LoaderMetrics.to_prometheus()``: the Prometheus text format, with no loader running."""

from __future__ import annotations

import math

from gigashuffle import LoaderMetrics, WriterMetrics


def _metrics(**overrides: object) -> LoaderMetrics:
    fields: dict[str, object] = dict(
        queue="q.1", rank=3, interval_s=2.0, batches=10, wait_s=1.5, wait_share=0.25, wait_per_batch_s=0.05,
        rows_per_s=40.0, writers=(WriterMetrics(0, 11, 100, 50.0, 0.9, 0.05), WriterMetrics(1, 12, 0, 0.0, 0.0, 0.0)),
        gather_per_batch_s=math.nan, readers_starved=0.5, fill_mean=0.75, fill_min=0.5, fill_samples=3,
        row_age_rows=12.0, row_age_s=0.1, node_rows_per_s=50.0, lock_busy_share=0.01, restarts=2,
    )  # fmt: skip
    fields.update(overrides)
    return LoaderMetrics(**fields)  # type: ignore[arg-type]


def test_every_figure_has_help_type_and_one_labelled_sample() -> None:
    text = _metrics().to_prometheus()
    lines = text.splitlines()
    assert text.endswith("\n")
    samples = [line for line in lines if not line.startswith("#")]
    names = {line.split("{", 1)[0] for line in samples}
    for name in names:
        assert f"# TYPE {name} counter" in lines or f"# TYPE {name} gauge" in lines
        assert any(line.startswith(f"# HELP {name} ") for line in lines)
    assert 'gigashuffle_batches_total{queue="q.1",rank="3"} 10.0' in lines
    assert 'gigashuffle_restarts_total{queue="q.1",rank="3"} 2.0' in lines
    assert 'gigashuffle_gather_per_batch_seconds{queue="q.1",rank="3"} NaN' in lines
    assert 'gigashuffle_writer_in_dataset_share{queue="q.1",rank="3",writer="0"} 0.9' in lines
    assert 'gigashuffle_writer_rows_per_second{queue="q.1",rank="3",writer="1"} 0.0' in lines


def test_prefix_and_label_escaping() -> None:
    text = _metrics(queue='a"b\\c').to_prometheus(prefix="job")
    assert 'job_wait_share{queue="a\\"b\\\\c",rank="3"} 0.25' in text.splitlines()


def test_host_to_device_series_only_with_a_device() -> None:
    assert "h2d_per_batch_seconds" not in _metrics().to_prometheus()
    lines = _metrics(h2d_per_batch_s=0.00025, writers_per_batch=1.5).to_prometheus().splitlines()
    assert 'gigashuffle_h2d_per_batch_seconds{queue="q.1",rank="3"} 0.00025' in lines
    assert "# TYPE gigashuffle_h2d_per_batch_seconds gauge" in lines
    assert 'gigashuffle_writers_per_batch{queue="q.1",rank="3"} 1.5' in lines
