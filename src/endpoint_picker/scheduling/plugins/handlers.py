"""Built-in profile handlers: which profiles run for a request, and whose result answers it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState


class SingleProfileHandler:
    """Runs the only profile once; its result is the answer (the build checks there is one)."""

    __slots__ = ()

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> SingleProfileHandler:
        return cls()

    def pick_profiles(
        self,
        request: LLMRequest,
        profiles: Sequence[str],
        results: Mapping[str, Sequence[EndpointState]],
    ) -> Sequence[str]:
        return () if results else profiles[:1]

    def primary(self, request: LLMRequest, results: Mapping[str, Sequence[EndpointState]]) -> str:
        return next(iter(results))
