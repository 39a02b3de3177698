"""The Prometheus text exposition format (version 0.0.4), standard library only: ``LoaderMetrics.to_prometheus()``
and ``gigashuffle stats --prometheus`` both write it (``prometheus_client`` is not a dependency; the format is a
few lines of text). One family: a ``# HELP`` and a ``# TYPE`` line, then one sample per label set."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

# A metric name, optional {labels}, a value: what a scraper accepts of a sample line (no timestamps written here).
SAMPLE_LINE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
    r'(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*")*\})? (NaN|[+-]Inf|-?[0-9.]+(e[+-]?[0-9]+)?)$'
)


def value(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def label(text: object) -> str:
    """A label value, escaped as the format asks (backslash, double quote, newline)."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, object], float]]) -> list[str]:
    """The lines of one metric family: ``kind`` is ``counter`` or ``gauge``; each sample is (labels, value)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, x in samples:
        text = ",".join(f'{key}="{label(v)}"' for key, v in labels.items())
        lines.append(f"{name}{{{text}}} {value(float(x))}" if text else f"{name} {value(float(x))}")
    return lines
