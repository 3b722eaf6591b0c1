"""bounded-share-filter: bounds an endpoint's recent share of routed requests, not its queue now."""

from __future__ import annotations

import pytest
from tests.unit.scheduling.builders import HEADER, build, endpoint, request

from endpoint_picker.errors import ConfigError
from endpoint_picker.scheduling.lifecycle import InFlight, LifecycleListener, PoolListener, Routed
from endpoint_picker.scheduling.plugins import BoundedLoadFilter, BoundedShareFilter
from endpoint_picker.types import EndpointState


def _route(guard: BoundedShareFilter, hostport: str, times: int) -> None:
    for _ in range(times):
        guard.on_routed(Routed(request(), hostport))


def _names(kept: object) -> list[str]:
    assert isinstance(kept, list | tuple)
    return [e.endpoint.pod_name for e in kept]


def test_even_traffic_keeps_an_endpoint_whose_queue_is_momentarily_long() -> None:
    """Under even traffic a queue that is long for a moment is no hot spot: the share bound keeps
    the prefix's holder where the instantaneous load bound sends its requests elsewhere."""
    pool = [endpoint("a", queue=30), endpoint("b", queue=12), endpoint("c", queue=12)]
    guard = BoundedShareFilter(slack=0.15, window=512, inflight=InFlight())
    for _ in range(200):
        for e in pool:
            _route(guard, e.endpoint.hostport, 1)
    assert _names(guard.filter(request(), pool)) == ["a", "b", "c"]
    loaded = BoundedLoadFilter(1.5, 4, InFlight()).filter(request(), pool)
    assert [e.endpoint.pod_name for e in loaded] == ["b", "c"]  # what the instantaneous bound does


def test_a_hot_endpoint_is_removed_while_its_load_is_above_the_mean() -> None:
    """An endpoint routed most requests lately is removed while it is also busier than the
    mean now, and kept once its load is at or below the mean (a fast server that drains)."""
    guard = BoundedShareFilter(slack=0.15, window=512, inflight=InFlight())
    hot, cold = endpoint("hot", running=20), endpoint("cold", running=4)
    _route(guard, hot.endpoint.hostport, 300)
    _route(guard, cold.endpoint.hostport, 100)
    assert _names(guard.filter(request(), [hot, cold])) == ["cold"]
    drained = endpoint("hot", running=4)
    drained = EndpointState(hot.endpoint, drained.metrics)
    assert _names(guard.filter(request(), [drained, cold])) == ["hot", "cold"]


def test_shares_decay_so_an_old_hot_spot_is_forgiven() -> None:
    """Counts decay by 1/window per request: after a window's worth of even traffic the once
    hot endpoint is back within the bound."""
    guard = BoundedShareFilter(slack=0.15, window=64, inflight=InFlight())
    hot, cold = endpoint("hot", queue=9), endpoint("cold")
    _route(guard, hot.endpoint.hostport, 500)
    assert _names(guard.filter(request(), [hot, cold])) == ["cold"]
    for _ in range(400):
        _route(guard, hot.endpoint.hostport, 1)
        _route(guard, cold.endpoint.hostport, 1)
    assert _names(guard.filter(request(), [hot, cold])) == ["hot", "cold"]


def test_the_filter_never_removes_every_endpoint_and_forgets_those_that_left() -> None:
    """The least-routed candidate is always kept; an endpoint that left the pool is forgotten
    (it counts toward nothing when it comes back)."""
    guard = BoundedShareFilter(slack=0.0, window=512, inflight=InFlight())
    a, b = endpoint("a", queue=50), endpoint("b", queue=40)
    _route(guard, a.endpoint.hostport, 100)
    _route(guard, b.endpoint.hostport, 10)
    assert _names(guard.filter(request(), [a, b])) == ["b"]
    assert _names(guard.filter(request(), [a])) == ["a"]  # the only candidate
    guard.on_endpoints(frozenset({b.endpoint.hostport}))
    assert _names(guard.filter(request(), [a, b])) == ["a", "b"]  # a starts from nothing


def test_the_filter_hears_the_traffic_it_bounds_when_built_from_a_config() -> None:
    """Configured by name, the filter subscribes to routing and pool events, and a scheduler
    built with it stops sending to an endpoint that took more than its share."""
    components = build(
        HEADER + "plugins:\n- type: bounded-share-filter\n  parameters: {slack: 0.1, window: 64}\n"
        "- type: queue-scorer\n"
    )
    guards = [s for s in components.subscribers.lifecycle if isinstance(s, BoundedShareFilter)]
    assert len(guards) == 1
    assert isinstance(guards[0], LifecycleListener)
    assert guards[0] in components.subscribers.pool
    assert isinstance(guards[0], PoolListener)
    # the favourite has the shortest waiting queue (the queue scorer's pick), but took every
    # request lately and runs more than the other
    favourite, other = endpoint("fav", queue=0, running=20), endpoint("other", queue=1)
    _route(guards[0], favourite.endpoint.hostport, 100)
    result = components.scheduler.schedule(request(), [favourite, other])
    assert result.endpoints[0].endpoint.pod_name == "other"


@pytest.mark.parametrize(
    ("params", "message"),
    [("{slack: -1}", "slack"), ("{window: 0}", "window"), ("{slack: many}", "slack")],
)
def test_bad_parameters_are_refused_by_name(params: str, message: str) -> None:
    """A negative slack or an empty window is a config error that names the parameter."""
    with pytest.raises(ConfigError, match=message):
        build(HEADER + f"plugins:\n- type: bounded-share-filter\n  parameters: {params}\n")
