"""Integration fixtures: `ext_proc_server` runs a test on both gRPC stacks of the ext_proc port."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from endpoint_picker.app import App
from endpoint_picker.settings import EXT_PROC_SERVERS, Settings


@pytest.fixture(params=EXT_PROC_SERVERS)
def ext_proc_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every ``App`` the test builds serves ext_proc on this stack (grpcio, then h2),
    whatever its settings say: the protocol, limits, TLS and drain tests hold for both."""
    kind: str = request.param
    build = App.__init__

    def init(self: App, settings: Settings, *args: Any, **kwargs: Any) -> None:
        server = replace(settings.server, ext_proc_server=kind)
        build(self, replace(settings, server=server), *args, **kwargs)

    monkeypatch.setattr(App, "__init__", init)
    return kind
