"""A prometheus_client Collector that reads the scaler and the stats at scrape time.

Nothing is pushed from the training loop: every scrape reads the scaler's host snapshot
(``snapshot(wait=False)``: it never writes, nor waits on, the training thread's tensors) and
``NumericsStats.read()``, so the loop pays nothing between scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from dscale.metrics._training import HELP, TrainingFigures
from dscale.stats import NumericsStats

logger = logging.getLogger(__name__)

LABELS = ("rank", "local_rank", "node", "job_name")

# (counters() key, metric name without _total, help). Counters are exposed with a _total suffix.
_COUNTERS = (
    ("steps", "dscale_optimizer_steps", "Optimizer iterations attempted (update() calls)."),
    ("skipped_steps", "dscale_optimizer_steps_skipped", "Iterations skipped for inf/NaN grads."),
    ("growths", "dscale_scale_growths", "Times the loss scale grew."),
    ("backoffs", "dscale_scale_backoffs", "Times the loss scale backed off."),
    # The spike gate only (spike_signals): counted apart from the inf/NaN skips above.
    (
        "spike_skipped_steps",
        "dscale_optimizer_steps_spike_skipped",
        "Iterations skipped by the spike gate (loss or grad norm far above the window).",
    ),
)
_GAUGES = (
    ("scale", "dscale_loss_scale", "Current loss scale."),
    ("growth_tracker", "dscale_clean_steps_in_a_row", "Clean steps since the last growth/backoff."),
    ("skipped_in_a_row", "dscale_skipped_steps_in_a_row", "Consecutive skipped iterations."),
    # policy="predictive" only (dscale.scaler._program.predictive); NaN until measured.
    (
        "grad_max_abs",
        "dscale_grad_max_abs",
        "Largest finite unscaled gradient magnitude of the last clean step, max over ranks.",
    ),
    ("target_scale", "dscale_loss_scale_target", "Scale the predictive policy aims for."),
    (
        "margin_log2",
        "dscale_loss_scale_margin_log2",
        "log2 of the predictive headroom kept above the largest recent gradient (constant).",
    ),
    (
        "underflow_fraction",
        "dscale_grad_underflow_fraction_max",
        "Share of grad elements below fp16's min normal at the scale, max over ranks (sampled).",
    ),
    # The spike gate only; the loss and grad norm are the last step's, as the gate saw them.
    (
        "spike_skipped_in_a_row",
        "dscale_spike_skipped_steps_in_a_row",
        "Consecutive iterations skipped by the spike gate.",
    ),
    ("spike_window_values", "dscale_spike_window_values", "Values in the spike gate's window."),
    ("spike_loss", "dscale_step_loss", "Loss of the last iteration, mean over ranks."),
    (
        "spike_grad_norm",
        "dscale_step_grad_norm",
        "Grad norm of the last iteration: sqrt of the sum over ranks of each rank's squared norm.",
    ),
)


class ScaleSource(Protocol):
    """What the collector needs from a scaler: ``dscale.GradScaler.snapshot(wait=False)``."""

    def snapshot(self, *, wait: bool = True) -> Mapping[str, float | int]: ...


class MismatchSource(Protocol):
    """What the collector needs from the rank-agreement check."""

    mismatches: int


class ScalerCollector:
    """Exposes a scaler's counters and a ``NumericsStats`` as ``dscale_*`` metrics.

    Args:
        scaler: a ``dscale.GradScaler`` (anything with ``snapshot(wait=False)``).
        stats: optional numerics stats; without it the grad-norm, underflow and non-finite
            metrics are left out.
        labels: values for ``rank``, ``local_rank``, ``node``, ``job_name``, and any more
            labels every metric should carry (``attempt``).
        min_scale: exported as ``dscale_loss_scale_min`` so the collapse alert needs no threshold.
        rank_check: optional source of ``dscale_rank_scale_mismatch_total``.
        build_info: labels of ``dscale_build_info``.
        training: the loop's figures (``dscale_train_*`` gauges), when it reports them.
    """

    def __init__(
        self,
        scaler: ScaleSource,
        stats: NumericsStats | None = None,
        *,
        labels: Mapping[str, str],
        min_scale: float | None = None,
        rank_check: MismatchSource | None = None,
        build_info: Mapping[str, str] | None = None,
        training: TrainingFigures | None = None,
    ) -> None:
        missing = [k for k in LABELS if k not in labels]
        if missing:
            raise ValueError(f"labels is missing {missing}; pass a value for each of {LABELS}")
        self._scaler = scaler
        self._stats = stats
        self._training = training
        # LABELS first, then any others given (the launcher adds ``attempt``).
        self._label_names = (*LABELS, *sorted(k for k in labels if k not in LABELS))
        self._label_values = [str(labels[k]) for k in self._label_names]
        self._min_scale = min_scale
        self._rank_check = rank_check
        self._build_info = dict(build_info or {})

    def describe(self) -> list[Metric]:
        """Nothing to pre-register; metrics are produced per scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Read everything now. A failure is logged and re-raised, so the scrape shows an error."""
        try:
            metrics = list(self._collect())
        except Exception as exc:
            logger.warning(
                "dscale metrics scrape failed on rank %s (%s: %s); this scrape returns an error, "
                "training goes on",
                self._label_values[0],
                type(exc).__name__,
                exc,
            )
            raise
        yield from metrics

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self._label_names)
        g.add_metric(self._label_values, value)
        return g

    def _collect(self) -> Iterator[Metric]:
        # Host numbers only: a scrape thread must never touch the training thread's tensors.
        values = {k: float(v) for k, v in self._scaler.snapshot(wait=False).items()}
        for key, name, doc in _COUNTERS:
            if key in values:
                c = CounterMetricFamily(name, doc, labels=self._label_names)
                c.add_metric(self._label_values, values[key])
                yield c
        for key, name, doc in _GAUGES:
            if key in values:
                yield self._gauge(name, doc, values[key])
        if self._min_scale is not None:
            yield self._gauge("dscale_loss_scale_min", "The scaler's min_scale.", self._min_scale)
        if self._rank_check is not None:
            c = CounterMetricFamily(
                "dscale_rank_scale_mismatch",
                "Agreement checks that found ranks holding different loss scales.",
                labels=self._label_names,
            )
            c.add_metric(self._label_values, float(self._rank_check.mismatches))
            yield c
        if self._stats is not None:
            yield from self._collect_stats(self._stats)
        if self._training is not None:
            for name, value in self._training.values().items():
                yield self._gauge(name, HELP[name], value)
        info = InfoMetricFamily(
            "dscale_build", "dscale and torch versions.", labels=self._label_names
        )
        info.add_metric(self._label_values, self._build_info)
        yield info

    def _collect_stats(self, stats: NumericsStats) -> Iterator[Metric]:
        snap = stats.read()
        yield self._gauge(
            "dscale_grad_norm", "Global L2 grad norm of the last applied step.", snap.grad_norm
        )
        yield self._gauge(
            "dscale_grad_norm_scaled",
            "Global L2 grad norm of the last applied step, before unscaling.",
            snap.grad_norm_scaled,
        )
        yield self._gauge(
            "dscale_underflow_fraction",
            "Share of scaled grad elements that are zero or below fp16's min normal (sampled).",
            snap.underflow_fraction,
        )
        yield self._gauge(
            "dscale_last_step_skipped",
            "1 if the last iteration was skipped.",
            float(snap.last_step_skipped),
        )
        c = CounterMetricFamily(
            "dscale_nonfinite_grads",
            "Overflow steps on which a parameter's grad held inf/NaN (top-k names, then other).",
            labels=(*self._label_names, "param"),
        )
        for param, count in snap.nonfinite_grads.items():
            c.add_metric([*self._label_values, param], float(count))
        yield c
