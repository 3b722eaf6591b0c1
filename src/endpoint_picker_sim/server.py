"""One simulated vLLM server: an aiohttp app in front of one engine task.

Routes as vLLM serves them: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models,
/v1/load_lora_adapter, /v1/unload_lora_adapter, /reset_prefix_cache (vLLM's dev-mode route),
/health, /metrics; and the simulator's own POST /sim/restart. With ``kv_events`` configured the
server publishes its KV-cache events over ZeroMQ as vLLM does (``kvpublisher``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from endpoint_picker_sim import api
from endpoint_picker_sim.api import ApiError, Prompt
from endpoint_picker_sim.clock import Clock, ScaledClock
from endpoint_picker_sim.config import ServerConfig
from endpoint_picker_sim.engine import Engine
from endpoint_picker_sim.kvpublisher import KvEventPublisher
from endpoint_picker_sim.metrics import MetricsRenderer, restrict
from endpoint_picker_sim.request import SimRequest
from endpoint_picker_sim.tokenids import ApproxTokenIds, HfTokenIds, TokenIdScheme
from endpoint_picker_sim.tokenizer import generate_text, tokenize_ids, tokenize_text

log = logging.getLogger("endpoint_picker_sim")

_JSON = "application/json"
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(exc: ApiError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body(), content_type=_JSON)


class SimServer:
    """A vLLM look-alike: OpenAI routes, LoRA management, /metrics, and its engine task."""

    def __init__(
        self,
        config: ServerConfig,
        index: int = 0,
        clock: Clock | None = None,
        servers: int = 1,
        token_ids: TokenIdScheme | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.servers = servers
        self.clock = clock or ScaledClock(config.engine.time_scale)
        # Token ids when a tokenizer file is given or events are published (they carry ids);
        # the caller may share one loaded tokenizer between the servers of a process.
        if token_ids is None and config.tokenizer is not None:
            token_ids = HfTokenIds(config.tokenizer)
        if token_ids is None and config.kv_events is not None:
            token_ids = ApproxTokenIds()
        self.token_ids = token_ids
        self.engine = Engine(config.engine, self.clock, token_ids)
        self.publisher: KvEventPublisher | None = None
        self.renderer = MetricsRenderer(config.model, config.engine)
        seed = None if config.seed is None else config.seed + index
        self.rng = random.Random(seed)
        self.adapters: dict[str, str] = {m.name: m.path for m in config.lora_modules}
        self.created = int(time.time())
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self.url = ""
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/completions", self._guard(self.completions)),
                web.post("/v1/chat/completions", self._guard(self.chat)),
                web.get("/v1/models", self.models),
                web.post("/v1/load_lora_adapter", self._guard(self.load_lora)),
                web.post("/v1/unload_lora_adapter", self._guard(self.unload_lora)),
                web.post("/reset_prefix_cache", self._guard(self.reset_prefix_cache)),
                web.post("/sim/restart", self.restart),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
            ]
        )
        return app

    async def start(self, host: str, port: int) -> None:
        """Open the KV-event sockets, start the engine task and listen on ``host:port``."""
        if self.config.kv_events is not None:
            self.publisher = KvEventPublisher(self.config.kv_events, host, self.index,
                                              self.servers)  # fmt: skip
            self.publisher.start()
            self.engine.blocks.events = []
            self.engine.on_events = self.publisher.publish
        self._engine_task = asyncio.create_task(self.engine.run(), name=f"sim-engine-{host}")
        self._engine_task.add_done_callback(self._engine_done)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        # The bound port, so port 0 (tests) reports the one the kernel chose.
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{host}:{self.port}"

    def _engine_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("engine task of %s failed", self.url, exc_info=task.exception())
            # Release every waiting handler; new requests get a 500 (see _generate).
            self.engine.shutdown()

    async def stop(self) -> None:
        """Abort in-flight requests, close the listener, stop the engine task."""
        self.engine.shutdown()
        if self._runner is not None:
            await self._runner.cleanup()
        task = self._engine_task
        if task is not None:
            task.cancel()
            # A failure was logged by _engine_done already; stopping must not raise it again.
            await asyncio.wait([task])
        if self.publisher is not None:
            await self.publisher.stop()

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def _guard(handler: _Handler) -> _Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as exc:
                return _error(exc)

        return guarded

    def _inject_failure(self) -> None:
        faults = self.config.faults
        if faults.failure_rate and self.rng.random() < faults.failure_rate:
            code = self.rng.choice(faults.failure_codes)
            raise ApiError(code, "Simulated failure.", api.ERROR_TYPES.get(code, "Error"))

    def _resolve_model(self, model: str | None) -> tuple[str, str | None]:
        if model is None or model == self.config.model:
            return self.config.model, None
        if model in self.adapters:
            return model, model
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")

    def _make_request(self, prompt: Prompt, lora: str | None, *, chat: bool) -> SimRequest:
        bs = self.config.engine.block_size
        ids: tuple[int, ...] | None = prompt.token_ids
        if ids is None and self.token_ids is not None:
            ids = tuple(self.token_ids.encode(prompt.text or "", chat=chat))
        if ids is not None:
            tok = tokenize_ids(ids, bs, lora)
        else:
            tok = tokenize_text(prompt.text or "", bs, lora)
        limit = self.config.engine.max_model_len
        if tok.num_tokens + prompt.max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{tok.num_tokens + prompt.max_tokens} tokens ({tok.num_tokens} in the messages, "
                f"{prompt.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
            )
        return SimRequest(
            max(tok.num_tokens, 1),
            tok.block_hashes,
            prompt.max_tokens,
            lora,
            prompt.text,
            ids if self.token_ids is not None else None,
        )

    # -- generation -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        self._inject_failure()
        data = api.parse_json(await request.read())
        prompt = api.parse_completion(data, 16)
        return await self._generate(request, prompt, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        self._inject_failure()
        data = api.parse_json(await request.read())
        prompt = api.parse_chat(data, self.config.default_chat_max_tokens)
        return await self._generate(request, prompt, chat=True)

    async def _generate(
        self, request: web.Request, prompt: Prompt, *, chat: bool
    ) -> web.StreamResponse:
        model, lora = self._resolve_model(prompt.model)
        req = self._make_request(prompt, lora, chat=chat)
        if self._engine_task is None or self._engine_task.done():
            raise ApiError(500, "The engine is not running.", "InternalServerError")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{self.index}-{next(self._ids)}"
        created = int(time.time())
        self.engine.add(req)
        try:
            if prompt.stream:
                return await self._stream(request, req, prompt, rid, created, model, chat)
            await req.tokens(req.max_tokens)
            if req.finish_reason == "abort":
                raise ApiError(503, "The server is shutting down.", "ServiceUnavailableError")
            text = generate_text(0, req.generated)
            use = api.usage(req.prompt_len, req.generated)
            reason = req.finish_reason or "length"
            body = api.response_body(chat, rid, created, model, text, reason, use)
            return web.Response(body=body, content_type=_JSON)
        finally:
            # The client went away or the server stops: give the blocks back.
            self.engine.abort(req)

    async def _stream(
        self,
        request: web.Request,
        req: SimRequest,
        prompt: Prompt,
        rid: str,
        created: int,
        model: str,
        chat: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        head: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        interval = self.config.stream_interval
        sent = 0
        try:
            while True:
                target = 1 if sent == 0 else min(sent + interval, req.max_tokens)
                have = await req.tokens(target)
                if chat and sent == 0 and (have > 0 or req.finished):
                    # vLLM sends the role chunk with the first output, not on acceptance: the
                    # first body bytes of a stream mean the prefill is done (the EPP counts on
                    # it); a request aborted before any token still gets it
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    await resp.write(
                        api.sse({**head, "choices": [{**first, "finish_reason": None}]})
                    )
                if have > sent:
                    text = generate_text(sent, have - sent)
                    last = req.finish_reason == "length" and have == req.max_tokens
                    if chat:
                        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
                    else:
                        choice = {"index": 0, "text": text, "logprobs": None}
                    choice["finish_reason"] = "length" if last else None
                    choice["stop_reason"] = None
                    await resp.write(api.sse({**head, "choices": [choice]}))
                    sent = have
                if req.finished:
                    break
            if prompt.include_usage:
                use = api.usage(req.prompt_len, sent)
                await resp.write(api.sse({**head, "choices": [], "usage": use}))
            await resp.write(api.SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return resp

    # -- models and adapters --------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the base model, then each adapter with ``parent`` = the base."""
        cfg = self.config

        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {
                "id": mid,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [],
            }

        cards = [card(cfg.model, cfg.model, None, cfg.engine.max_model_len)]
        cards += [card(name, path, cfg.model, None) for name, path in self.adapters.items()]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": cards}), content_type=_JSON
        )

    async def load_lora(self, request: web.Request) -> web.Response:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"}."""
        data = api.parse_json(await request.read())
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "InvalidUserInput")  # fmt: skip
        if name in self.adapters:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.",
                           "InvalidUserInput")  # fmt: skip
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        """POST /v1/unload_lora_adapter {"lora_name"}."""
        data = api.parse_json(await request.read())
        name = data.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.",
                           "InvalidUserInput")  # fmt: skip
        if name not in self.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        self.engine.loras.unload(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache[?reset_running_requests=true]: 200, as vLLM answers whether
        or not the reset succeeded (refused while blocks are in use, unless running requests are
        reset too: preempted, to be recomputed)."""
        flag = request.query.get("reset_running_requests", "false").lower()
        if flag not in ("true", "false", "1", "0"):
            raise ApiError(400, f"reset_running_requests must be a boolean, got {flag!r}.")
        done = self.engine.reset_prefix_cache(flag in ("true", "1"))
        outcome = {True: "done", False: "refused (blocks in use)", None: "after this step"}
        log.info("%s: prefix cache reset %s", self.url, outcome[done])
        return web.Response()

    async def restart(self, request: web.Request) -> web.Response:
        """POST /sim/restart (the simulator's own): behave as a crashed and restarted vLLM. Every
        in-flight request fails, the KV cache is empty, no event announces it, and the next
        KV-event batch is seq 0 with an empty replay buffer. Counters are kept (the bench's deltas
        stay meaningful)."""
        self.engine.restart()
        if self.publisher is not None:
            self.publisher.restart()
        log.info("%s: restarted (cache emptied, requests aborted)", self.url)
        return web.Response()

    # -- probes ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 with an empty body."""
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics, with the configured delay and failure rate."""
        faults = self.config.faults
        if faults.metrics_delay_ms:
            await asyncio.sleep(faults.metrics_delay_ms / 1000.0)
        if faults.metrics_failure_rate and self.rng.random() < faults.metrics_failure_rate:
            return web.Response(status=500, text="Simulated metrics failure.")
        text = self.renderer.render(self.engine)
        if names := request.query.getall("name[]", []):  # as prometheus_client honours it
            text = restrict(text, names)
        return web.Response(body=text.encode(), headers={"Content-Type": _METRICS_TYPE})
