"""The built-in scheduling plugins and the function that registers them."""

from __future__ import annotations

from endpoint_picker.scheduling.plugins.affinity import (
    BoundedLoadFilter,
    InFlightLoadScorer,
    PrefixCacheScorer,
)
from endpoint_picker.scheduling.plugins.filters import CandidateSampler, StaleMetricsFilter
from endpoint_picker.scheduling.plugins.pickers import (
    MaxScorePicker,
    RandomPicker,
    SingleProfileHandler,
    WeightedRandomPicker,
)
from endpoint_picker.scheduling.plugins.precise import PrecisePrefixCacheScorer
from endpoint_picker.scheduling.plugins.predicted import (
    PredictedLatencyDetector,
    PredictedLatencyScorer,
)
from endpoint_picker.scheduling.plugins.scorers import (
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
)
from endpoint_picker.scheduling.plugins.session import SessionAffinityScorer
from endpoint_picker.scheduling.plugins.share import BoundedShareFilter
from endpoint_picker.scheduling.plugins.slo import SloAwareScorer, SloSaturationDetector
from endpoint_picker.scheduling.registry import PluginRegistry
from endpoint_picker.scheduling.saturation import UtilizationDetector

__all__ = [
    "BoundedLoadFilter",
    "BoundedShareFilter",
    "CandidateSampler",
    "InFlightLoadScorer",
    "KVCacheUtilizationScorer",
    "LoraAffinityScorer",
    "MaxScorePicker",
    "PrecisePrefixCacheScorer",
    "PredictedLatencyDetector",
    "PredictedLatencyScorer",
    "PrefixCacheScorer",
    "QueueScorer",
    "RandomPicker",
    "RunningRequestsSizeScorer",
    "SessionAffinityScorer",
    "SingleProfileHandler",
    "SloAwareScorer",
    "SloSaturationDetector",
    "StaleMetricsFilter",
    "UtilizationDetector",
    "WeightedRandomPicker",
    "register_builtins",
]


def register_builtins(registry: PluginRegistry) -> None:
    """Register every built-in plugin type under its reference-EPP type name."""
    registry.register("stale-metrics-filter", StaleMetricsFilter.from_params)
    registry.register("queue-scorer", QueueScorer.from_params)
    registry.register("kv-cache-utilization-scorer", KVCacheUtilizationScorer.from_params)
    registry.register("lora-affinity-scorer", LoraAffinityScorer.from_params)
    registry.register("running-requests-size-scorer", RunningRequestsSizeScorer.from_params)
    registry.register("random-picker", RandomPicker.from_params)
    registry.register("max-score-picker", MaxScorePicker.from_params)
    registry.register("weighted-random-picker", WeightedRandomPicker.from_params)
    registry.register("utilization-detector", UtilizationDetector.from_params)
    registry.register("single-profile-handler", SingleProfileHandler.from_params)
    registry.register("bounded-load-filter", BoundedLoadFilter.from_params)
    registry.register("bounded-share-filter", BoundedShareFilter.from_params)
    registry.register("candidate-sampler", CandidateSampler.from_params)
    registry.register("inflight-load-scorer", InFlightLoadScorer.from_params)
    registry.register("prefix-cache-scorer", PrefixCacheScorer.from_params)
    registry.register("precise-prefix-cache-scorer", PrecisePrefixCacheScorer.from_params)
    registry.register("session-affinity-scorer", SessionAffinityScorer.from_params)
    registry.register("slo-aware-scorer", SloAwareScorer.from_params)
    registry.register("slo-saturation-detector", SloSaturationDetector.from_params)
    registry.register("predicted-latency-scorer", PredictedLatencyScorer.from_params)
    registry.register("predicted-latency-detector", PredictedLatencyDetector.from_params)
