"""The status JSON: the pool, its models, every endpoint with its metrics and their age."""

from __future__ import annotations

from dataclasses import replace

from endpoint_picker.datastore import (
    ClusterState,
    Datastore,
    InferenceModel,
    InferenceObjective,
    InferencePool,
    Pod,
)
from endpoint_picker.datastore.health import FailureKind, OutlierDetector
from endpoint_picker.datastore.objects import API_V1ALPHA2, TargetModel
from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.lifecycle import Routed
from endpoint_picker.scheduling.predictor import LatencyPredictor
from endpoint_picker.settings import OutlierSettings
from endpoint_picker.status.decisions import DecisionLog
from endpoint_picker.status.view import StatusView
from endpoint_picker.types import Criticality, MetricsSnapshot

ENGINE_LABEL = "inference.networking.k8s.io/engine-type"


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


class Health:
    def __init__(self, ready: bool = True, note: str | None = None) -> None:
        self._ready, self._note = ready, note

    def ready(self) -> bool:
        return self._ready

    def note(self) -> str | None:
        return self._note


class InFlight:
    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def count(self, hostport: str) -> int:
        return self.counts.get(hostport, 0)


class Queues:
    waiting = 3

    def waiting_in(self, priority: int) -> int:
        return {1: 1, 7: 2}.get(priority, 0)


def pod(name: str, ip: str, **labels: str) -> Pod:
    return Pod(name, "ns", (("app", "vllm"), *labels.items()), ip, True)


def cluster(*pods: Pod) -> ClusterState:
    pool = InferencePool("pool", "ns", API_V1ALPHA2, (("app", "vllm"),), (8000,))
    food = InferenceModel(
        "food", "ns", "food-review", Criticality.STANDARD,
        (TargetModel("food-v1", 3), TargetModel("food-v2", 1)), "pool", None, 0,
    )  # fmt: skip
    base = InferenceModel("base", "ns", "base", Criticality.CRITICAL, (), "pool", None, 1)
    gold = InferenceObjective("gold", "ns", 7, "pool")
    return ClusterState(pools=(pool,), models=(food, base), pods=pods, objectives=(gold,))


def view(store: Datastore, clock: Clock, **kwargs: object) -> StatusView:
    args: dict[str, object] = {
        "inflight": InFlight({}),
        "decisions": DecisionLog(),
        "health": Health(),
        "staleness_threshold": 2.0,
        "engine_label": ENGINE_LABEL,
        "clock": clock,
        "wall_clock": lambda: 1_700_000_000.0,
    }
    args.update(kwargs)
    return StatusView(store, **args)  # type: ignore[arg-type]


def test_before_the_pool_loads_the_status_is_empty_and_not_ready() -> None:
    """No pool: null pool, no models or endpoints, not ready."""
    status = view(Datastore(), Clock(), health=Health(ready=False)).snapshot()
    assert status["pool"] is None
    assert (status["models"], status["endpoints"], status["decisions"]) == ([], [], [])
    assert status["ready"] is False
    assert status["flowControl"] is None
    assert status["version"] == 1
    assert status["time"] == 1_700_000_000.0


def test_pool_and_models_with_their_traffic_split() -> None:
    """The pool's identity, and each model's criticality and split as weights and percents."""
    store = Datastore()
    store.apply(cluster())
    status = view(store, Clock(), health=Health(note="pool file change refused")).snapshot()
    assert status["pool"] == {
        "name": "pool",
        "namespace": "ns",
        "apiVersion": API_V1ALPHA2,
        "selector": {"app": "vllm"},
        "targetPorts": [8000],
    }
    assert status["note"] == "pool file change refused"
    base, food = status["models"]
    assert base == {"name": "base", "criticality": "Critical", "targets": [], "objective": None}
    assert food["criticality"] == "Standard"
    assert food["targets"] == [
        {"name": "food-v1", "weight": 3, "percent": 75.0},
        {"name": "food-v2", "weight": 1, "percent": 25.0},
    ]


def test_endpoints_show_metrics_age_staleness_unreachability_and_in_flight_counts() -> None:
    """Fresh metrics are shown with their age; old or missing ones are stale; an endpoint
    known to be down says why; in-flight counts are the EPP's own."""
    clock = Clock()
    store = Datastore()
    store.apply(cluster(pod("a", "10.0.0.1"), pod("b", "10.0.0.2", **{ENGINE_LABEL: "sglang"}),
                        pod("c", "10.0.0.3")))  # fmt: skip
    a, b, _ = store.endpoints
    store.update_metrics(
        a,
        MetricsSnapshot(
            waiting_queue_size=3,
            running_requests=5,
            kv_cache_usage=0.421234,
            active_adapters=frozenset({"food-v2", "food-v1"}),
            max_active_adapters=4,
            updated_at=clock.now - 0.25,
        ),
    )
    store.update_metrics(b, MetricsSnapshot(updated_at=clock.now - 5))
    store.mark_unreachable(b.hostport, "connection refused")
    status = view(store, clock, inflight=InFlight({a.hostport: 2})).snapshot()
    first, second, third = status["endpoints"]
    assert first == {
        "name": "a",
        "namespace": "ns",
        "address": "10.0.0.1:8000",
        "engine": "vllm",
        "waiting": 3,
        "running": 5,
        "kvCacheUsage": 0.4212,
        "activeAdapters": ["food-v1", "food-v2"],
        "waitingAdapters": [],
        "maxAdapters": 4,
        "metricsAgeSeconds": 0.25,
        "stale": False,
        "unreachable": None,
        "inFlight": 2,
        "outlier": None,
        "predictor": None,
        "kvEvents": None,
    }
    assert (second["engine"], second["stale"], second["metricsAgeSeconds"]) == ("sglang", True, 5)
    assert second["unreachable"] == "connection refused"
    assert (third["stale"], third["metricsAgeSeconds"]) == (True, None)  # never scraped
    assert status["inFlight"] == 2
    clock.now += 2.0  # a's metrics now 2.25 s old: past the threshold
    assert view(store, clock).snapshot()["endpoints"][0]["stale"] is True


def test_endpoints_show_their_ejection_state_until_when_and_failures() -> None:
    """An ejected endpoint shows its state, time left, end (wall clock) and failures; a failing
    one its count; a healthy one null."""
    clock = Clock()
    store = Datastore()
    store.apply(cluster(pod("a", "10.0.0.1"), pod("b", "10.0.0.2"), pod("c", "10.0.0.3")))
    ready = [e.hostport for e in store.endpoints]
    outliers = OutlierDetector(OutlierSettings(), clock=clock)
    for _ in range(5):
        outliers.failed("10.0.0.2:8000", FailureKind.STATUS_5XX, ready)
    outliers.failed("10.0.0.3:8000", FailureKind.RETRIED, ready)
    clock.now += 10
    first, second, third = view(store, clock, outliers=outliers).snapshot()["endpoints"]
    assert first["outlier"] is None
    assert second["outlier"] == {
        "state": "ejected",
        "consecutiveFailures": 5,
        "ejections": 1,
        "secondsLeft": 20.0,
        "ejectedUntil": 1_700_000_020.0,
        "lastFailure": "5xx",
        "probeInFlight": False,
    }
    assert (third["outlier"]["state"], third["outlier"]["consecutiveFailures"]) == ("ok", 1)


def plain_request() -> LLMRequest:
    return LLMRequest("r", Api.COMPLETIONS, "m", b"{}", {}, target_model="m")


def test_endpoints_show_the_latency_predictors_error_and_coefficients() -> None:
    """With a predicted-latency plugin each endpoint's row has its model: the TTFT error, the
    sample counts and the coefficients by feature name (None before any model)."""
    clock = Clock()
    store = Datastore()
    store.apply(cluster(pod("a", "10.0.0.1"), pod("b", "10.0.0.2")))
    a, _ = store.endpoints
    predictor = LatencyPredictor(clock)
    for i in range(3):
        request = replace(plain_request(), request_id=f"r{i}", stream=True)
        predictor.expect(
            request.request_id, {a.hostport: ((1.0, 2.0, 0, 0, 0, 0, 0, 0), (1, 1, 0, 0))}
        )
        predictor.on_routed(Routed(request, a.hostport))
        clock.now += 0.2
        predictor.on_started(request.request_id)
    first, second = view(store, clock, predictor=predictor).snapshot()["endpoints"]
    row = first["predictor"]
    assert (row["ttftSamples"], row["tpotSamples"]) == (3, 0)
    assert 0 < row["ttftRelativeError"] < 1
    assert set(row["ttftCoefficients"]) == {
        "1", "uncached_ktok", "ahead_ktok", "waiting_x10", "running_x10", "kv", "adapter_load",
        "adapter_wait",
    }  # fmt: skip
    assert second["predictor"] is None


def test_flow_control_queues_by_priority_including_the_pools_objectives() -> None:
    """With flow control on, the waiting total and the non-empty bands, objectives' too."""
    store = Datastore()
    store.apply(cluster())
    status = view(store, Clock(), flow=Queues()).snapshot()
    assert status["flowControl"] == {"waiting": 3, "byPriority": {"7": 2, "1": 1}}


def test_a_large_pool_is_described_in_steps_that_let_the_event_loop_run() -> None:
    """The served page equals the one-go snapshot, and between its steps other callbacks
    (the requests being routed) run: 300 endpoints at 64 a step yield four times."""
    import asyncio

    store = Datastore()
    store.apply(cluster(*(pod(f"p{i}", f"10.0.{i // 250}.{i % 250 + 1}") for i in range(300))))
    status_view = view(store, Clock())

    async def main() -> tuple[dict[str, object], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        stepped = await status_view.snapshot_in_steps(64)
        task.cancel()
        return stepped, ticks - before

    stepped, ticks = asyncio.run(main())
    assert stepped == status_view.snapshot()
    assert len(stepped["endpoints"]) == 300  # type: ignore[arg-type]
    assert ticks >= 4
