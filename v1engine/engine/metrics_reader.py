"""vLLM's metrics reader: the Prometheus metrics of an engine (engine/metrics.py) as plain objects,
what `LLM.get_metrics()` returns.

    for metric in llm.get_metrics():
        if isinstance(metric, Histogram) and metric.name == "vllm:time_to_first_token_seconds":
            print(metric.count, metric.sum / max(metric.count, 1))

Names are the metric families' ("vllm:prompt_tokens", not the exposition's "..._total"); each
labelled series is one object. A histogram's `buckets` map each upper bound as Prometheus writes
it ("0.1", "+Inf") to the cumulative count of observations at or below it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as Family

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "get_metrics_snapshot"]


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every `vllm:` series of `registry` now, in the registry's order."""
    snapshot: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            for sample in family.samples:
                snapshot.append(Gauge(family.name, dict(sample.labels), sample.value))
        elif family.type == "counter":
            for sample in family.samples:
                if sample.name.endswith("_total"):  # not the `_created` timestamps
                    snapshot.append(Counter(family.name, dict(sample.labels), int(sample.value)))
        elif family.type == "histogram":
            snapshot += _histograms(family)
    return snapshot


def _histograms(family: Family) -> list[Histogram]:
    """One Histogram per label set of a histogram family's `_bucket`, `_count` and `_sum`."""
    by_labels: dict[tuple, Histogram] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        histogram = by_labels.setdefault(key, Histogram(family.name, labels, 0, 0.0, {}))
        suffix = sample.name[len(family.name) :]
        if suffix == "_bucket":
            histogram.buckets[sample.labels["le"]] = int(sample.value)
        elif suffix == "_count":
            histogram.count = int(sample.value)
        elif suffix == "_sum":
            histogram.sum = sample.value
    return list(by_labels.values())
