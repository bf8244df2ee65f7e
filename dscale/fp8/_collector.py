"""Float8NumericsCollector: the sampled FP8 numerics as Prometheus metrics, read at scrape time.

``dscale.metrics.start_exporter`` serves it by itself (:class:`AttachedFloat8Collector`: the
numerics and fallback made on its scaler, with the exporter's labels). By hand::

    exporter.registry.register(Float8NumericsCollector(numerics, fallback, rank=rank))

Gauges per (layer, tensor), the last sample's worst rank: ``dscale_fp8_flushed_ratio``,
``dscale_fp8_subnormal_ratio``, ``dscale_fp8_saturated_ratio``, ``dscale_fp8_amax``,
``dscale_fp8_scale``; under the rowwise recipe also ``dscale_fp8_rows_saturated_ratio``,
``dscale_fp8_rows_flushed_ratio``, under MXFP8 and NVFP4 ``dscale_fp8_blocks_clamped_ratio``,
``dscale_fp8_blocks_nonfinite_ratio``, under all three ``dscale_fp8_scale_spread_binades``
(dscale/fp8/_granular.py), under NVFP4 ``dscale_fp8_tensor_scale`` (dscale/fp8/_nvfp4.py);
``dscale_fp8_samples_total``; with a fallback,
``dscale_fp8_fallback_layers`` (switched layers) and ``dscale_fp8_fallback{layer}`` (1 when
switched). Nothing is read before the first sample; a scrape never touches a device tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dscale.fp8 import _attached

SHARES = {
    "flushed": "non-zero elements cast to zero (underflow)",
    "subnormal": "elements cast to a subnormal FP8 value",
    "saturated": "elements beyond the FP8 maximum (clamped)",
}

#: The rowwise and MXFP8 fields (dscale/fp8/_granular.py): metric name and help.
OWN_FIELDS = {
    "rows_saturated": ("rows_saturated_ratio", "Share of rows holding a saturated element"),
    "rows_flushed": ("rows_flushed_ratio", "Share of rows holding a flushed element"),
    "blocks_clamped": (
        "blocks_clamped_ratio",
        "Share of blocks with a non-zero value whose scale the format clamped (MXFP8: E8M0 "
        "at its floor; NVFP4: E4M3 below 2^-6 or above 448 given the tensor scale)",
    ),
    "blocks_nonfinite": (
        "blocks_nonfinite_ratio",
        "Share of blocks holding (MXFP8) or decoding to (NVFP4) an inf or NaN",
    ),
    "scale_spread": (
        "scale_spread_binades",
        "log2 of the largest over the smallest row scale (rowwise) or block scale (MXFP8, NVFP4)",
    ),
    "tensor_scale": ("tensor_scale", "NVFP4 per-tensor float32 scale, amax / (448 x 6)"),
}


class Float8NumericsCollector:
    """Exposes a :class:`Float8Numerics` (and optionally a :class:`Float8Fallback`)."""

    def __init__(
        self,
        numerics: Any,
        fallback: Any = None,
        *,
        rank: int = 0,
        labels: dict[str, str] | None = None,
    ) -> None:
        self._numerics = numerics
        self._fallback = fallback
        # The exporter's labels (rank, job_name, ...) when given, else rank alone.
        self._labels = dict(labels) if labels is not None else {"rank": str(rank)}

    def describe(self) -> list[Metric]:
        """Nothing to pre-register; metrics are produced per scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The last sample, as gauges labelled ``rank``, ``layer``, ``tensor``."""
        snap = self._numerics.snapshot()
        base, own = list(self._labels), list(self._labels.values())
        names = [*base, "layer", "tensor"]
        gauges = {
            share: GaugeMetricFamily(
                f"dscale_fp8_{share}_ratio",
                f"Share of {text}, last sample, worst rank (0..1)",
                labels=names,
            )
            for share, text in SHARES.items()
        }
        fields = getattr(self._numerics, "fields", ())
        extra = {
            f: GaugeMetricFamily(
                f"dscale_fp8_{OWN_FIELDS[f][0]}",
                f"{OWN_FIELDS[f][1]}, last sample, worst rank",
                labels=names,
            )
            for f in fields
            if f in OWN_FIELDS
        }
        amax = GaugeMetricFamily("dscale_fp8_amax", "Largest magnitude, last sample", labels=names)
        scale = GaugeMetricFamily("dscale_fp8_scale", "FP8 cast scale, last sample", labels=names)
        for key, row in sorted(snap.items()):
            layer, tensor = key.rsplit("/", 1)
            values = [*own, layer, tensor]
            for share, gauge in gauges.items():
                gauge.add_metric(values, row[share])
            amax.add_metric(values, row["amax"])
            scale.add_metric(values, row["scale"])
            for field, gauge in extra.items():
                gauge.add_metric(values, row[field])
        yield from gauges.values()
        yield from extra.values()
        yield amax
        yield scale
        samples = CounterMetricFamily(
            "dscale_fp8_samples", "FP8 numerics samples taken", labels=base
        )
        samples.add_metric(own, self._numerics.num_samples)
        yield samples
        if self._fallback is not None:
            fallen = set(self._fallback.fallen)
            count = GaugeMetricFamily(
                "dscale_fp8_fallback_layers", "Layers switched to high precision", labels=base
            )
            count.add_metric(own, len(fallen))
            yield count
            per = GaugeMetricFamily(
                "dscale_fp8_fallback",
                "1 when the layer runs in high precision",
                labels=[*base, "layer"],
            )
            for layer in sorted(self._fallback.runs):
                per.add_metric([*own, layer], 1.0 if layer in fallen else 0.0)
            yield per


class AttachedFloat8Collector:
    """The FP8 numerics (and fallback) made on ``scaler``, looked up at each scrape.

    ``start_exporter`` registers one for every scaler: it serves nothing until a
    ``Float8Numerics`` is made on that scaler (before or after the exporter started).
    """

    def __init__(self, scaler: Any, labels: dict[str, str]) -> None:
        self._scaler = scaler
        self._labels = dict(labels)

    def describe(self) -> list[Metric]:
        """Nothing to pre-register; metrics are produced per scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The attached numerics' metrics, or none."""
        numerics = _attached.numerics_of(self._scaler)
        if numerics is None:
            return
        fallback = _attached.fallback_of(self._scaler)
        yield from Float8NumericsCollector(numerics, fallback, labels=self._labels).collect()
