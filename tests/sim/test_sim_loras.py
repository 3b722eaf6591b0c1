"""The LoRA slots of one engine, as vLLM's scheduler counts them."""

from __future__ import annotations

from endpoint_picker_sim.loras import LoraSlots


def test_a_new_adapter_evicts_the_least_recently_used_one_no_request_runs() -> None:
    """Loading into full slots evicts the oldest idle resident; a running one stays, and only
    a first use pays the load; a third adapter waits while two run."""
    slots = LoraSlots(max_loras=2)
    assert slots.start("a")  # loaded: it paid a load
    assert slots.start("b")
    assert slots.blocked("c")
    assert not slots.blocked("a")
    assert not slots.blocked(None)
    slots.stop("b")
    assert not slots.start("a")  # resident: no load, and now the most recently used
    assert not slots.blocked("c")
    slots.stop("a")
    assert slots.start("c")  # evicts b, used before a; a still runs once
    assert list(slots.loaded) == ["a", "c"]


def test_counts_feed_the_info_label_and_unload_spares_a_running_adapter() -> None:
    """Waiting and running counts make vllm:lora_requests_info's labels; unloading an adapter a
    request runs keeps it resident."""
    slots = LoraSlots(max_loras=1)
    for lora in ("x", "x", None, "y"):
        slots.queued(lora)
    slots.dequeued("x")
    slots.start("x")
    assert slots.label() == ("x", "x,y")
    slots.unload("x")
    assert "x" in slots.loaded
    slots.stop("x")
    slots.unload("x")
    assert slots.loaded == {}
    assert slots.label() == ("", "x,y")
    assert (slots.id_of("y"), slots.id_of("x"), slots.id_of("y")) == (1, 2, 1)
