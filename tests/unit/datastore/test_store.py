"""The datastore: atomic swaps, metrics views, listeners."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.errors import ConfigError
from endpoint_picker.types import Endpoint, MetricsSnapshot


def state(*pods: dict[str, object], pools: int = 1):  # type: ignore[no-untyped-def]
    docs = [pool(f"p{i}" if i else "pool") for i in range(pools)]
    return parse_pool_text(pool_yaml(*docs, *pods), "t")


def test_invalid_state_keeps_the_last_good_one() -> None:
    """A rejected apply leaves the previous pool, endpoints and metrics untouched."""
    store = Datastore()
    store.apply(state(pod("a", "127.0.0.2")))
    endpoint = store.endpoints[0]
    store.update_metrics(endpoint, MetricsSnapshot(waiting_queue_size=3, updated_at=1.0))
    with pytest.raises(ConfigError):
        store.apply(state(pod("a", "127.0.0.2"), pools=2))
    assert store.endpoint_states()[0].metrics.waiting_queue_size == 3


def test_metrics_view_is_consistent_and_refreshed() -> None:
    """A view taken before an update keeps its values; the next view has the new ones."""
    store = Datastore()
    store.apply(state(pod("a", "127.0.0.2"), pod("b", "127.0.0.3")))
    a, _ = store.endpoints
    before = store.endpoint_states()
    store.update_metrics(a, MetricsSnapshot(kv_cache_usage=0.5, updated_at=2.0))
    after = store.endpoint_states()
    assert before[0].metrics.kv_cache_usage == 0.0
    assert after[0].metrics.kv_cache_usage == 0.5


def test_updates_for_removed_endpoints_are_dropped_and_listeners_told() -> None:
    """Listeners hear of endpoint changes; late metrics for a removed endpoint vanish."""
    store = Datastore()
    seen: list[tuple[str, ...]] = []
    store.on_endpoints_changed(lambda eps: seen.append(tuple(e.hostport for e in eps)))
    store.apply(state(pod("a", "127.0.0.2"), pod("b", "127.0.0.3")))
    store.apply(state(pod("a", "127.0.0.2")))
    store.update_metrics(Endpoint("b", "default", "127.0.0.3", 8000), MetricsSnapshot(updated_at=1))
    assert seen == [("127.0.0.2:8000", "127.0.0.3:8000"), ("127.0.0.2:8000",)]
    assert [s.hostport for s in store.endpoint_states()] == ["127.0.0.2:8000"]


def test_unreachable_endpoints_leave_the_view_and_return_with_fresh_metrics() -> None:
    """An endpoint marked unreachable leaves the view (all of them stay when all are); its
    next good scrape brings it back with those metrics, in pool order; every view between
    reads the latest metrics of the others."""
    store = Datastore()
    store.apply(state(pod("a", "127.0.0.2"), pod("b", "127.0.0.3"), pod("c", "127.0.0.4")))
    a, b, c = store.endpoints
    assert [s.metrics.waiting_queue_size for s in store.endpoint_states()] == [0, 0, 0]
    store.mark_unreachable(b.hostport, "connect failure")
    store.update_metrics(c, MetricsSnapshot(waiting_queue_size=7, updated_at=1.0))
    view = store.endpoint_states()
    assert [(s.hostport, s.metrics.waiting_queue_size) for s in view] == [
        (a.hostport, 0),
        (c.hostport, 7),
    ]
    store.update_metrics(b, MetricsSnapshot(waiting_queue_size=4, updated_at=2.0))
    assert [s.metrics.waiting_queue_size for s in store.endpoint_states()] == [0, 4, 7]
    for endpoint in (a, b, c):
        store.mark_unreachable(endpoint.hostport, "down")
    assert len(store.endpoint_states()) == 3  # none reachable: route on all rather than none
    store.apply(state(pod("c", "127.0.0.4"), pod("a", "127.0.0.2")))  # b gone
    assert {s.hostport: s.metrics.waiting_queue_size for s in store.endpoint_states()} == {
        a.hostport: 0,
        c.hostport: 7,
    }
    store.update_metrics(a, MetricsSnapshot(waiting_queue_size=2, updated_at=3.0))
    store.update_metrics(b, MetricsSnapshot(waiting_queue_size=9, updated_at=3.0))  # late
    # a is back; c is still unreachable, so now it leaves the view
    assert [(s.hostport, s.metrics.waiting_queue_size) for s in store.endpoint_states()] == [
        (a.hostport, 2)
    ]


def test_configured_model_names_cover_target_models() -> None:
    """InferenceModel names and their target models are configured; other names are not."""
    store = Datastore()
    assert not store.is_configured_model("m")
    store.apply(parse_pool_text(pool_yaml(pool(), model("m", targets={"m-v1": 1, "m-v2": 0})), "t"))
    assert [store.is_configured_model(n) for n in ("m", "m-v1", "m-v2", "x")] == [
        True,
        True,
        True,
        False,
    ]


def test_pods_sharing_an_address_are_one_endpoint_with_one_warning() -> None:
    """Two Ready pods on one ip:port make one endpoint (the first pod by name keeps it), and
    the datastore warns once per change of the duplicate set, not on every apply."""
    store = Datastore()
    pods = (pod("c", "127.0.0.2"), pod("a", "127.0.0.2"), pod("b", "127.0.0.3"))
    with capture_logs() as logs:
        store.apply(state(*pods))
        store.apply(state(*pods, pod("d", "127.0.0.4", ready=False)))  # same duplicates
        store.apply(state(*pods[1:]))  # c gone: no duplicate left
        store.apply(state(*pods))  # back: warned again
    assert [(e.pod_name, e.hostport) for e in store.endpoints] == [
        ("a", "127.0.0.2:8000"),
        ("b", "127.0.0.3:8000"),
    ]
    assert [s.hostport for s in store.endpoint_states()] == ["127.0.0.2:8000", "127.0.0.3:8000"]
    warnings = [e for e in logs if e["event"].startswith("pods share an address")]
    assert len(warnings) == 2
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["duplicates"] == [
        "127.0.0.2:8000 is the address of 2 pods: default/a (kept), default/c"
    ]
    state_now = store.state
    assert state_now is not None
    assert state_now.pod_count == 3


def test_a_pool_with_only_not_ready_pods_counts_its_pods() -> None:
    """NotReady pods are no endpoint but still pods of the pool (what the file guard reads)."""
    store = Datastore()
    store.apply(state(pod("a", "127.0.0.2", ready=False), pod("b", "", ready=False)))
    assert store.endpoints == ()
    assert store.state is not None
    assert store.state.pod_count == 2
