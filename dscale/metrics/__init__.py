"""Prometheus metrics for dscale: one /metrics endpoint per rank, read at scrape time."""

from dscale.metrics._collector import ScalerCollector
from dscale.metrics._exporter import DEFAULT_PORT, MetricsExporter, start_exporter
from dscale.metrics._log import MetricsLog
from dscale.metrics._rank_check import RankScaleCheck
from dscale.metrics._training import TrainingFigures

__all__ = [
    "DEFAULT_PORT",
    "MetricsExporter",
    "MetricsLog",
    "RankScaleCheck",
    "ScalerCollector",
    "TrainingFigures",
    "start_exporter",
]
