"""The GPU's LoRA slots of one simulated engine, as vLLM's scheduler counts them.

At most ``max_loras`` adapters run at once; a waiting request whose adapter is not running
while every slot is taken is skipped (it keeps its place in the queue). An adapter stays
resident after its last request ends, so the next request for it pays no load time; a new
adapter takes a free slot or evicts the least recently used resident that no running request
needs. The counts of running and waiting requests per adapter feed
``vllm:lora_requests_info``.
"""

from __future__ import annotations


def _add(counts: dict[str, int], lora: str) -> None:
    counts[lora] = counts.get(lora, 0) + 1


def _remove(counts: dict[str, int], lora: str) -> None:
    left = counts[lora] - 1
    if left:
        counts[lora] = left
    else:
        del counts[lora]


class LoraSlots:
    """Requests per adapter (running, waiting), the resident adapters and vLLM's adapter ids.

    Every method takes a request's adapter, ``None`` for the base model (nothing to count)."""

    __slots__ = ("ids", "loaded", "max_loras", "running", "waiting")

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        # Adapters resident in the GPU's LoRA slots, least recently used first.
        self.loaded: dict[str, None] = {}
        # vLLM's lora_int_id: adapters numbered from 1 in the order this engine first serves them.
        self.ids: dict[str, int] = {}

    def queued(self, lora: str | None) -> None:
        """A request for ``lora`` joined the queue (new, or preempted back to its head)."""
        if lora is not None:
            _add(self.waiting, lora)

    def dequeued(self, lora: str | None) -> None:
        """A request for ``lora`` left the queue (admitted, or aborted while waiting)."""
        if lora is not None:
            _remove(self.waiting, lora)

    def blocked(self, lora: str | None) -> bool:
        """Whether a request for ``lora`` must wait for a slot: its adapter is not running and
        every slot runs another."""
        return lora is not None and lora not in self.running and len(self.running) >= self.max_loras

    def start(self, lora: str | None) -> bool:
        """A request for ``lora`` starts running; True when its adapter had to be loaded first."""
        if lora is None:
            return False
        load = lora not in self.loaded
        if load:
            if len(self.loaded) >= self.max_loras:
                self._evict()
        else:
            del self.loaded[lora]  # most recently used: to the end
        self.loaded[lora] = None
        _add(self.running, lora)
        return load

    def stop(self, lora: str | None) -> None:
        """A request for ``lora`` stopped running (finished, preempted or aborted)."""
        if lora is not None:
            _remove(self.running, lora)

    def unload(self, lora: str) -> None:
        """``/v1/unload_lora_adapter``: free the adapter's slot unless a request runs it."""
        if lora not in self.running:
            self.loaded.pop(lora, None)

    def id_of(self, lora: str) -> int:
        """vLLM's ``lora_int_id`` of ``lora`` (numbered on first use)."""
        return self.ids.setdefault(lora, len(self.ids) + 1)

    def label(self) -> tuple[str, str]:
        """The running and the waiting adapters, as ``vllm:lora_requests_info`` labels them."""
        return ",".join(sorted(self.running)), ",".join(sorted(self.waiting))

    def restart(self) -> None:
        """A restarted server has no adapter resident and numbers them afresh."""
        self.loaded.clear()
        self.ids.clear()

    def _evict(self) -> None:
        """Free a slot: the least recently used adapter no running request needs."""
        for name in self.loaded:
            if name not in self.running:
                del self.loaded[name]
                return
