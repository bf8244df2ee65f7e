"""The shadow numerics as Prometheus metrics, read at scrape time (host numbers only).

``dscale.metrics.start_exporter`` serves the ``ShadowNumerics`` made on its scaler by itself
(:class:`AttachedShadowCollector`). Gauges per (layer, tensor, format), the last sample's worst
rank: ``dscale_shadow_flushed_ratio``, ``dscale_shadow_saturated_ratio``; the window's worst:
``dscale_shadow_window_flushed_ratio``, ``dscale_shadow_window_saturated_ratio``; and
``dscale_shadow_samples_total``. Nothing is served before the first sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dscale.precision._shadow import shadow_of
from dscale.precision._shadow_stats import FIELDS


class ShadowCollector:
    """Exposes a :class:`dscale.precision.ShadowNumerics`."""

    def __init__(self, shadow: Any, *, labels: dict[str, str] | None = None) -> None:
        self._shadow = shadow
        self._labels = dict(labels) if labels is not None else {"rank": "0"}

    def describe(self) -> list[Metric]:
        """Nothing to pre-register; metrics are produced per scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Last sample and window, labelled ``layer``, ``tensor``, ``format``."""
        base, own = list(self._labels), list(self._labels.values())
        names = [*base, "layer", "tensor", "format"]
        for prefix, table in (("", self._shadow.snapshot()), ("window_", self._shadow.window())):
            when = "last sample" if not prefix else "worst sample of the window"
            gauges = {
                f: GaugeMetricFamily(
                    f"dscale_shadow_{prefix}{f}_ratio",
                    f"Share of elements the format would leave {f}, {when}, worst rank (0..1)",
                    labels=names,
                )
                for f in FIELDS
            }
            for key, row in sorted(table.items()):
                layer, tensor, fmt = key.rsplit("/", 2)
                for f, gauge in gauges.items():
                    gauge.add_metric([*own, layer, tensor, fmt], row[f])
            yield from gauges.values()
        samples = CounterMetricFamily(
            "dscale_shadow_samples", "Shadow numerics samples taken", labels=base
        )
        samples.add_metric(own, self._shadow.num_samples)
        yield samples


class AttachedShadowCollector:
    """The ``ShadowNumerics`` made on ``scaler``, looked up at each scrape (none: nothing)."""

    def __init__(self, scaler: Any, labels: dict[str, str]) -> None:
        self._scaler = scaler
        self._labels = dict(labels)

    def describe(self) -> list[Metric]:
        """Nothing to pre-register; metrics are produced per scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The attached shadow's metrics, or none."""
        shadow = shadow_of(self._scaler)
        if shadow is not None:
            yield from ShadowCollector(shadow, labels=self._labels).collect()
