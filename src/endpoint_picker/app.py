"""The composition root: builds every part from ``Settings`` and runs them as one app.

Nothing below this module constructs its own dependencies; everything is passed in here.
Background loops are named tasks owned by the app, cancelled and awaited on stop.

With ``epp serve --workers N`` (N > 1) the same app runs in two roles (``endpoint_picker.workers``
builds them): the parent keeps the pool source, the scrapers, the health port and the metrics
port and hands routing to its ``Routers`` (the worker processes); each worker (``WorkerRole``,
both in ``roles``) routes only: its datastore is fed by the parent, its ext_proc port is
shared by SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import platform
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import prometheus_client
import structlog

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import PoolFileSource
from endpoint_picker.director import Director, RoutingDecision
from endpoint_picker.errors import ConfigError
from endpoint_picker.extproc.limits import BodyBudget, StreamSlots
from endpoint_picker.extproc.server import (
    ExternalProcessor,
    ExtProcServer,
    HealthState,
    build_health_server,
    start_ext_proc_server,
)
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.extproc.tls import load_certificate, load_client_ca, self_signed_certificate
from endpoint_picker.flowcontrol import FlowController
from endpoint_picker.metrics.scraper import ScrapeManager
from endpoint_picker.roles import Routers, WorkerRole
from endpoint_picker.scheduling import build_scheduling, load_config, room_finder
from endpoint_picker.scheduling.config import EndpointPickerConfig
from endpoint_picker.settings import MetricsAuth, MetricsEndpointSettings, Settings
from endpoint_picker.status import (
    Authorizer,
    CachedReviews,
    DecisionLog,
    MetricsServer,
    PredictorRows,
    ReloadingTls,
    StaticTokens,
    StatusView,
)
from endpoint_picker.telemetry.metrics import EppMetrics, PoolStats
from endpoint_picker.telemetry.tasks import guarded
from endpoint_picker.types import format_hostport

if TYPE_CHECKING:  # imported when used: only a Kubernetes deployment loads the client
    from endpoint_picker.datastore.sources.kubernetes import (
        KubernetesAccessReviewer,
        KubernetesSource,
        LeaderElector,
    )

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class BoundPorts:
    ext_proc: int
    health: int
    metrics: int


def freeze_startup_heap() -> None:
    """Take what start-up built out of the garbage collector's full passes.

    A process that serves keeps nearly everything it imported and built before its first
    request (modules, protobuf descriptors, the pool, the placement ring): a few hundred
    thousand objects that every gen-2 collection walks again, 40-100 ms a time during which no
    pick is answered. Frozen (``gc.freeze``), they are skipped; what is built later is
    collected as usual. Process-wide, so the process's entry point asks for it (``epp serve``
    and a worker, once the pool is in and before ext_proc listens, so that the collection it
    starts with holds no request; a workers' parent, which routes nothing, once started), never
    ``App`` itself (tests run many apps in one process).
    """
    gc.collect()
    gc.freeze()


# glibc's M_MMAP_THRESHOLD (malloc.h): blocks at least this large get their own mapping.
_M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 128 * 1024


def return_large_blocks_to_os() -> bool:
    """Give request bodies' memory back to the OS when they are freed; True where it applies.

    glibc serves a block of 128 KiB or more from its own mapping, returned on ``free``, but
    raises that threshold to the largest such block freed so far: after the first 1 MB body,
    bodies come from the heap, which keeps what they leave (300 queued 1 MB requests that
    expired left 1.1 GiB of RSS with nothing referencing them). Setting the threshold fixes it
    where it is. Process-wide, so only entry points call it (``epp serve``, a worker), at start.
    """
    if platform.libc_ver()[0] != "glibc":
        return False  # musl and others already unmap large blocks on free
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))


class App:
    """One EPP process: datastore, sources, scrapers, scheduler, director and servers."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        datastore: Datastore | None = None,
        health: HealthState | None = None,
        routers: Routers | None = None,
        worker: WorkerRole | None = None,
        before_listen: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self._before_listen = before_listen  # once the pool is loaded, before ext_proc listens
        self._clock = clock
        self._rng = rng or random.Random()
        self._routers = routers
        self._worker = worker
        self.datastore = datastore or Datastore(settings.pool.pool_name)
        # The reference EPP (Go client) exports no *_created series; dashboards expect none.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.metrics = EppMetrics(self._pool_stats, self.datastore.is_configured_model)
        self.health = health or HealthState()
        self._tasks: list[asyncio.Task[None]] = []
        self._ext_server: ExtProcServer | None = None
        self._slots: StreamSlots | None = None
        self._servers: list[grpc.aio.Server] = []
        self._metrics_server: MetricsServer | None = None
        self.decisions = DecisionLog()  # the status page's recent decisions and refusals
        self._stopping = asyncio.Event()
        self.flow: FlowController[RoutingDecision] | None = None  # with the flowControl gate
        self._predictor: PredictorRows | None = None  # with a predicted-latency plugin
        self.ports = BoundPorts(0, 0, 0)
        self._draining = False
        self._source: PoolFileSource | None = None
        self._kubernetes: KubernetesSource | None = None
        self._elector: LeaderElector | None = None
        self._access_reviewer: KubernetesAccessReviewer | None = None  # the same client
        self._reviews: CachedReviews | None = None  # metrics-port auth through Kubernetes
        self._pool_synced = False  # Kubernetes: the first full sync is done and the pool exists
        self._leading = True  # Kubernetes HA: this replica holds the Lease (True without HA)
        self._scraper: ScrapeManager | None = None
        if worker is not None:
            return  # the parent reads the pool and scrapes; its channel feeds the datastore
        if settings.pool.pool_file is not None:
            self._source = PoolFileSource(
                settings.pool.pool_file,
                self.datastore,
                observer=self.metrics,
                poll_interval=settings.pool.reload_poll_interval,
                settle_time=settings.pool.reload_settle_time,
            )
        elif settings.pool.pool_name:
            self._kubernetes = self._build_kubernetes_source(settings.pool.pool_name)
        else:
            raise ConfigError("give --pool-file PATH, or --pool-name NAME to watch Kubernetes")
        self._scraper = ScrapeManager(
            settings.scrape,
            self.datastore.update_metrics,
            clock=clock,
            cpu_budget=settings.scrape.cpu_budget,
            on_unreachable=self.datastore.mark_unreachable,
            sliced=routers is None,  # a workers' parent routes nothing: no pick to let through
        )
        scraper = self._scraper
        self.metrics.track_scraping(
            lambda: scraper.interval, lambda: scraper.cpu_share, lambda: scraper.gate.deferred
        )

    def _refresh_interval(self) -> float:
        """Seconds between two scrapes of an endpoint now (a worker's parent scrapes; a
        worker's own status page is not served, but say the setting rather than fail)."""
        if self._scraper is None:
            return self.settings.scrape.refresh_interval
        return self._scraper.interval

    def _build_kubernetes_source(self, pool_name: str) -> KubernetesSource:
        from endpoint_picker.datastore.sources.kubernetes import (
            KubernetesAccessReviewer,
            KubernetesSource,
            LeaderElector,
            build_client,
            default_identity,
        )

        async def synced(ready: bool) -> None:
            self._pool_synced = ready
            await self._update_kubernetes_ready()

        async def leading(leader: bool) -> None:
            self._leading = leader
            await self._update_kubernetes_ready()

        k8s = self.settings.pool.kubernetes
        client = build_client(k8s)
        # the metrics port's tokens are checked with the same client (when auth asks for it)
        self._access_reviewer = KubernetesAccessReviewer(
            client, self.settings.server.metrics_endpoint.review_timeout
        )
        if k8s.leader_election:
            self._leading = False
            self._elector = LeaderElector(
                client,
                k8s.namespace,
                k8s.lease_name or f"endpoint-picker-{pool_name}",
                default_identity(),
                k8s,
                leading,
            )
        return KubernetesSource(client, self.datastore, pool_name, k8s, readiness=synced)

    def _build_metrics_access(self) -> tuple[Authorizer | None, ReloadingTls | None]:
        """Who may read the metrics port, and its TLS; ``ConfigError`` for a bad file."""
        endpoint = self.settings.server.metrics_endpoint
        tls = None
        if endpoint.cert_dir is not None:
            tls = ReloadingTls(
                endpoint.cert_dir,
                endpoint.client_ca_file,
                reload_interval=endpoint.cert_reload_interval,
            )
        elif endpoint.client_ca_file is not None:  # never plaintext when mTLS was asked for
            raise ConfigError("--metrics-client-ca-file needs --metrics-cert-dir")
        if endpoint.auth is MetricsAuth.TOKEN_FILE:
            if endpoint.token_file is None:
                raise ConfigError("token-file auth needs --metrics-token-file")
            tokens = StaticTokens(endpoint.token_file)
            tokens.load()
            return tokens, tls
        if endpoint.auth is MetricsAuth.KUBERNETES:
            return self._kubernetes_reviews(endpoint), tls
        return None, tls

    def _kubernetes_reviews(self, endpoint: MetricsEndpointSettings) -> CachedReviews:
        if self._access_reviewer is None:
            raise ConfigError(
                "--metrics-endpoint-auth checks tokens with the Kubernetes API: use the "
                "Kubernetes source (--pool-name without --pool-file) or --metrics-token-file"
            )
        self._reviews = CachedReviews(
            self._access_reviewer.review,
            allow_ttl=endpoint.allow_ttl,
            deny_ttl=endpoint.deny_ttl,
            max_entries=endpoint.cache_entries,
            max_concurrent=endpoint.max_concurrent_reviews,
            clock=self._clock,
        )
        return self._reviews

    async def _update_kubernetes_ready(self) -> None:
        # synced and (without HA, or) leading; never ready again once draining
        ready = self._pool_synced and self._leading and not self._draining
        await self.health.set_ready(ready)

    @property
    def elector(self) -> LeaderElector | None:
        """The Lease holder-or-candidate, with --ha-enable-leader-election (tests)."""
        return self._elector

    @property
    def streams_accepted(self) -> int:
        """ext_proc streams this process let in since it started serving."""
        return self._slots.accepted if self._slots is not None else 0

    @property
    def kubernetes(self) -> KubernetesSource | None:
        """The Kubernetes source, when it feeds the pool (tests wait on its first sync)."""
        return self._kubernetes

    def _pool_stats(self) -> PoolStats | None:
        pool = self.datastore.pool
        if pool is None:
            return None
        states = self.datastore.endpoint_states()
        count = len(states) or 1
        return PoolStats(
            name=pool.name,
            average_kv_cache_utilization=sum(s.metrics.kv_cache_usage for s in states) / count,
            average_queue_size=sum(s.metrics.waiting_queue_size for s in states) / count,
            ready_pods=len({s.endpoint.pod_name for s in states}),
        )

    def _scheduling_config(self) -> EndpointPickerConfig | None:
        """The scheduler config file, validated; None without one (the default config)."""
        config_path = self.settings.scheduling.config_file
        if config_path is None:
            return None
        try:
            text = config_path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read: {exc.strerror}", str(config_path)) from exc
        return load_config(text, str(config_path))

    def _build_director(self) -> Director:
        config = self._scheduling_config()
        components = build_scheduling(
            config,
            settings=self.settings.scheduling,
            staleness_threshold=self.settings.scrape.staleness_threshold,
            clock=self._clock,
            rng=self._rng,
            observer=self.metrics,
            record=self.decisions.record,
            inflight=self._worker.inflight if self._worker is not None else None,
        )
        lifecycle = components.lifecycle
        self.inflight = components.inflight  # the EPP's own in-flight count (tests, status)
        self._predictor = components.latency_predictor  # the status page's per-endpoint rows
        flow_config = config.flow_control if config is not None else None
        if flow_config is not None:
            room, datastore = room_finder(components.saturation_detector), self.datastore
            self.flow = FlowController[RoutingDecision](
                flow_config,
                lambda priority: not room(datastore.endpoint_states(), priority),
                clock=self._clock,
                observer=self.metrics,
            )
        # plugins that remember endpoints (the prefix index) forget the ones that leave
        self.datastore.on_endpoints_changed(
            lambda endpoints: lifecycle.endpoints_changed(e.hostport for e in endpoints)
        )
        return Director(
            self.datastore,
            components.scheduler,
            components.saturation_detector,
            allow_unknown_models=self.settings.pool.allow_unknown_models,
            extra_paths=self.settings.server.extra_inference_paths,
            rng=self._rng,
            lifecycle=components.lifecycle,
            request_headers=components.request_headers,
            session_tokens=components.session_tokens,
            flow=self.flow,
        )

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(guarded(name, coro), name=name)
        self._tasks.append(task)

    def _load_tls(self) -> tuple[tuple[bytes, bytes] | None, bytes | None]:
        """The ext_proc port's (key, chain) and client CA; a worker gets its parent's."""
        if self._worker is not None:
            return self._worker.tls, self._worker.client_ca
        server_settings = self.settings.server
        tls = None
        if server_settings.secure_serving:
            tls = (
                load_certificate(server_settings.cert_path)
                if server_settings.cert_path
                else self_signed_certificate()
            )
        client_ca = None
        if server_settings.client_ca_file is not None:
            if tls is None:  # never fall back to plaintext when mTLS was asked for
                raise ConfigError("--client-ca-file needs --secure-serving true")
            client_ca = load_client_ca(server_settings.client_ca_file)
        return tls, client_ca

    async def start(self) -> BoundPorts:
        """Load the pool and start serving; ``ConfigError`` when an input is invalid."""
        server_settings = self.settings.server
        # TLS material first: a bad file fails the start before anything runs or logs
        tls, client_ca = self._load_tls()
        metrics_auth, metrics_tls = (None, None)
        if self._worker is None:
            metrics_auth, metrics_tls = self._build_metrics_access()
        director = None
        if self._routers is None:
            director = self._build_director()
        else:
            self._scheduling_config()  # a bad config fails here, before any worker starts
        if self._scraper is not None:
            self.datastore.on_endpoints_changed(self._scraper.set_endpoints)
        if self._source is not None:
            self._source.load_initial()
        await self.health.start()
        if self._scraper is not None:
            await self._scraper.start()
            self._scraper.set_endpoints(self.datastore.endpoints)

        host = server_settings.bind_address
        health_address = format_hostport(host, server_settings.grpc_health_port)
        if director is not None:
            if self._worker is not None and self._worker.before_listen is not None:
                await self._worker.before_listen()
            if self._before_listen is not None:
                self._before_listen()
            ext_port = await self._start_ext_proc(director, tls, client_ca)
        else:
            assert self._routers is not None
            ext_port = await self._routers.start(tls, client_ca)
        health_port = metrics_port = 0
        if self._worker is None:  # a worker's parent serves these ports for all of them
            try:
                health_server, health_port = build_health_server(self.health, health_address)
            except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
                raise ConfigError(f"cannot listen on {health_address}: {exc}") from exc
            await health_server.start()
            self._servers.append(health_server)
            metrics_port = await self._start_metrics_server(metrics_auth, metrics_tls)
        if metrics_tls is not None:
            self._spawn("metrics-tls-reload", metrics_tls.watch())
        if self.flow is not None:
            self._spawn("flow-control-dispatch", self.flow.run())
        if self._source is not None:
            self._spawn("pool-file-watch", self._source.watch())
            await self.health.set_ready(self.datastore.loaded)
        if self._kubernetes is not None:  # ready at its first full sync, not before
            for name, coro in self._kubernetes.tasks():
                self._spawn(name, coro)
            if self._elector is not None:
                self._spawn("kubernetes-leader-election", self._elector.run())
        self.ports = BoundPorts(ext_port, health_port, metrics_port)
        log.info(
            "endpoint picker serving" if self._worker is None else "worker serving",
            pool=self.datastore.pool.name if self.datastore.pool else None,
            endpoints=len(self.datastore.endpoints),
            ext_proc_port=ext_port,
            health_port=health_port,
            metrics_port=metrics_port,
            workers=self.settings.server.workers,
            tls=tls is not None,
            client_auth=client_ca is not None,
            metrics_auth=self.settings.server.metrics_endpoint.auth.value,
            metrics_tls=metrics_tls is not None,
        )
        return self.ports

    async def _start_ext_proc(
        self,
        director: Director,
        tls: tuple[bytes, bytes] | None,
        client_ca: bytes | None,
    ) -> int:
        server_settings = self.settings.server
        # one budget and one stream count for the whole process, shared by every stream
        budget = BodyBudget(server_settings.max_buffered_bytes)
        slots = self._slots = StreamSlots(server_settings.max_concurrent_streams)
        self.metrics.track_limits(lambda: budget.reserved, lambda: slots.open)
        processor = ExternalProcessor(
            functools.partial(
                RequestStream,
                director,
                self.metrics,
                self._clock,
                server_settings.max_request_body_bytes,
                budget=budget,
                max_headers=server_settings.max_request_headers,
                max_header_bytes=server_settings.max_request_header_bytes,
                on_reject=self.decisions.rejected,
            ),
            slots,
            self.metrics,
        )
        # started first: on stop it is drained first, while health still says NOT_SERVING
        server, port = await start_ext_proc_server(
            server_settings.ext_proc_server,
            processor,
            self.health,
            server_settings.bind_address,
            server_settings.grpc_port,
            tls,
            client_ca,
            reuse_port=self._worker is not None,
        )
        self._ext_server = server
        return port

    async def _start_metrics_server(self, auth: Authorizer | None, tls: ReloadingTls | None) -> int:
        routers = self._routers
        status = StatusView(
            self.datastore,
            inflight=self.inflight if routers is None else routers.inflight,
            decisions=self.decisions if routers is None else routers.decisions,
            health=self,
            staleness_threshold=self.settings.scrape.staleness_threshold,
            engine_label=self.settings.scrape.engine_label,
            flow=self.flow,
            refresh_interval=self._refresh_interval,
            clock=self._clock,
            predictor=self._predictor if routers is None else None,
        )
        render = self.metrics.render
        if routers is not None:  # one view: the parent's families with the workers' summed in
            own = render
            render = lambda: routers.render(own())  # noqa: E731
        self._metrics_server = MetricsServer(
            render,
            status,
            auth=auth,
            tls=tls.context if tls is not None else None,
            refresh=routers.refresh if routers is not None else None,
        )
        host, port = self.settings.server.bind_address, self.settings.server.metrics_port
        try:
            return await self._metrics_server.start(host, port)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {format_hostport(host, port)}: {exc.strerror}"
            ) from exc

    def ready(self) -> bool:
        """Readiness, as the gRPC health service reports it (``/readyz``, the status page)."""
        return self.health.ready

    def note(self) -> str | None:
        """Why a ready EPP serves an older state, if it does (``/healthz``, the status page)."""
        if self._kubernetes is not None and not self._kubernetes.healthy:
            return "a Kubernetes watch is reconnecting; serving the last state"
        if self._source is not None and not self._source.healthy:
            # Still ready: the last good pool serves; a bad edit must not take the EPP out.
            return "pool file change refused; serving the last good pool"
        return None

    def kill_workers(self) -> None:
        """SIGKILL the worker processes, if this app has any (before ``os._exit``)."""
        if self._routers is not None:
            self._routers.kill()

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Drain: report NOT_SERVING, stop accepting, let open streams finish, then exit."""
        grace = self.settings.server.drain_timeout if drain_timeout is None else drain_timeout
        self._draining = True
        await self.health.set_ready(False)
        if self._elector is not None:  # a standby may lead while this replica drains
            await self._elector.release()
        log.info("draining", grace_seconds=grace)
        # ext_proc refuses new streams and lets open ones finish (in every worker, with
        # workers); the health port keeps answering NOT_SERVING until then, so probes and
        # Envoy see the drain, not a refusal.
        if self._ext_server is not None:
            await self._ext_server.stop(grace)
            self._ext_server = None
        if self._routers is not None:
            await self._routers.drain(grace)
        for server in self._servers:
            await server.stop(0)
        self._servers.clear()
        if self.flow is not None:  # whatever still waits gets its 503 now
            self.flow.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._kubernetes is not None:
            await self._kubernetes.close()
        if self._scraper is not None:
            await self._scraper.stop()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        if self._reviews is not None:
            await self._reviews.close()
        log.info("stopped")
