"""Float8NumericsCollector: the sampled FP8 numerics as Prometheus metrics, read at scrape time.

Register it beside dscale's own collector::

    exporter = dscale.metrics.start_exporter(scaler)
    exporter.registry.register(Float8NumericsCollector(numerics, fallback, rank=rank))

Gauges per (layer, tensor), the last sample's worst rank: ``dscale_fp8_flushed_ratio``,
``dscale_fp8_subnormal_ratio``, ``dscale_fp8_saturated_ratio``, ``dscale_fp8_amax``,
``dscale_fp8_scale``; ``dscale_fp8_samples_total``; with a fallback,
``dscale_fp8_fallback_layers`` (switched layers) and ``dscale_fp8_fallback{layer}`` (1 when
switched). Nothing is read before the first sample; a scrape never touches a device tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

SHARES = {
    "flushed": "non-zero elements cast to zero (underflow)",
    "subnormal": "elements cast to a subnormal FP8 value",
    "saturated": "elements beyond the FP8 maximum (clamped)",
}


class Float8NumericsCollector:
    """Exposes a :class:`Float8Numerics` (and optionally a :class:`Float8Fallback`)."""

    def __init__(self, numerics: Any, fallback: Any = None, *, rank: int = 0) -> None:
        self._numerics = numerics
        self._fallback = fallback
        self._rank = str(rank)

    def describe(self) -> list[Metric]:
        """Nothing to pre-register; metrics are produced per scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The last sample, as gauges labelled ``rank``, ``layer``, ``tensor``."""
        snap = self._numerics.snapshot()
        names = ["rank", "layer", "tensor"]
        gauges = {
            share: GaugeMetricFamily(
                f"dscale_fp8_{share}_ratio",
                f"Share of {text}, last sample, worst rank (0..1)",
                labels=names,
            )
            for share, text in SHARES.items()
        }
        amax = GaugeMetricFamily("dscale_fp8_amax", "Largest magnitude, last sample", labels=names)
        scale = GaugeMetricFamily("dscale_fp8_scale", "FP8 cast scale, last sample", labels=names)
        for key, row in sorted(snap.items()):
            layer, tensor = key.rsplit("/", 1)
            values = [self._rank, layer, tensor]
            for share, gauge in gauges.items():
                gauge.add_metric(values, row[share])
            amax.add_metric(values, row["amax"])
            scale.add_metric(values, row["scale"])
        yield from gauges.values()
        yield amax
        yield scale
        samples = CounterMetricFamily(
            "dscale_fp8_samples", "FP8 numerics samples taken", labels=["rank"]
        )
        samples.add_metric([self._rank], self._numerics.num_samples)
        yield samples
        if self._fallback is not None:
            fallen = set(self._fallback.fallen)
            count = GaugeMetricFamily(
                "dscale_fp8_fallback_layers", "Layers switched to high precision", labels=["rank"]
            )
            count.add_metric([self._rank], len(fallen))
            yield count
            per = GaugeMetricFamily(
                "dscale_fp8_fallback", "1 when the layer runs in high precision", labels=names[:2]
            )
            for layer in sorted(self._fallback.runs):
                per.add_metric([self._rank, layer], 1.0 if layer in fallen else 0.0)
            yield per
