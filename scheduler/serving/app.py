"""The Ray Serve application (docs/serving.md): ``Ingress`` -> ``Worker`` (one per device) + ``Hub``.

- ``Ingress`` (FastAPI): the OpenAI routes, bearer-key check, validation and tokenization
  (scheduler/serving/api.py), the front end's in-flight bound, SSE streaming, metrics, the live
  dashboard (its data: scheduler/serving/dashboard.py, sampled every ``dashboard_tick_s``).
- ``Worker`` and ``Hub``: scheduler/serving/worker.py (the Triton-facing side, the control loop:
  scheduler/serving/engine_host.py).
- The tokens: with ``serve.stream_via: triton`` (the default) the ingress streams each request from
  the picked worker's tritonserver itself (scheduler/serving/routes.py); with ``worker``, through the
  worker replica.
- ``serve.triton_host: ingress``: no worker; each ingress replica (one per device) hosts the engine itself,
  Triton's core in its own process (``EngineHost`` with a ``TritonCore``: control loop, supervision, stats to
  the hub), and streams each request from it, without gRPC or a second actor.

Cancellation: when an HTTP client disconnects, Ray Serve's proxy cancels the ingress request; the
``asyncio.CancelledError`` raised in the ingress's stream lands in ``Generation._chunks``
(scheduler/serving/generation.py), which
cancels its stream: a ``routes.TritonStream`` closes its gRPC stream; a worker's
``DeploymentResponseGenerator`` makes Serve throw ``CancelledError`` into ``Worker.generate``, whose
``aclosing`` closes the Triton stream. Either way ``TritonClient.generate`` sends the ``cancel``
control op for the request id.
"""

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from edge.core.errors import ConfigError
from scheduler.serving import api
from scheduler.serving import dashboard
from scheduler.serving.config import BundleInfo, ServeConfig
from scheduler.serving.engine_host import HUB_TIMEOUT_S, EngineHost
from scheduler.serving.generation import Generation, complete, prepend, sse_events
from scheduler.serving.ingress_input import http_error, max_token_chars, parse_request, read_body
from scheduler.serving.loopback import replica_grpc_on_loopback
from scheduler.serving.metrics import CONTENT_TYPE, ServeMetrics
from scheduler.serving.rebind import ingress_port_rebindable
from scheduler.serving.stamps import stamp
from scheduler.serving.routes import Routes, TritonStream
from scheduler.serving.text_stream import TextStream
from scheduler.serving.worker import DEVICE_RESOURCE, Hub, Worker

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"


# @serve.ingress freezes (cloudpickles) this app and the class's methods when the class is defined:
# whatever the methods use must be defined above it.
fastapi_app = FastAPI(title="SmartExit", docs_url=None, redoc_url=None)
fastapi_app.add_exception_handler(HTTPException, http_error)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(fastapi_app)
class Ingress:
    """The OpenAI-compatible HTTP front end (routes in docs/serving.md)."""

    async def __init__(self, cfg: ServeConfig, worker: DeploymentHandle | None, hub: DeploymentHandle,
                       repo_dir: Path | None = None) -> None:
        from tokenizers import Tokenizer

        replica_grpc_on_loopback()
        ingress_port_rebindable()  # a replica replacing a crashed one binds the same port
        bundle = BundleInfo.load(cfg.bundle_dir)
        self._cfg = cfg = cfg.with_bundle(bundle)
        self._tok = Tokenizer.from_file(str(bundle.tokenizer_path))
        eos = self._tok.token_to_id(EOS)
        self._stop_ids = [] if eos is None else [eos]
        self._limits = api.Limits(cfg.model_name, cfg.max_tokens_limit, cfg.context_window,
                                  self._tok.get_vocab_size(), cfg.default_mode.value, cfg.default_sla_ttft_ms,
                                  cfg.default_sla_tpot_ms, max_token_chars(self._tok))
        self._metrics = ServeMetrics(bundle.exit_layers, bundle.num_layers, cfg.tps_window_s,
                                     sla_ttft_ms=cfg.default_sla_ttft_ms, sla_tpot_ms=cfg.default_sla_tpot_ms)
        self._worker, self._hub = None if worker is None else worker.options(stream=True), hub
        node = ray.get_runtime_context().get_node_id()
        # triton_host: ingress: this replica hosts its device's Triton (its core in this process) and streams from it
        self._host: EngineHost | None = None
        self._inflight, self._capacity = 0, cfg.max_inflight * cfg.replicas
        self._routes = None if cfg.stream_via != "triton" or worker is None else \
            Routes(cfg.triton_timeout_s, cfg.max_inflight, node)
        if worker is None:
            self._capacity = cfg.max_inflight
            self._host = EngineHost(cfg, hub, serve.get_replica_context().replica_tag, node)
            await self._host.open(repo_dir, in_process=True)
        self._created = int(time.time())
        self._dashboard = dashboard.Dashboard(self._metrics, bundle.exit_layers, bundle.num_layers,
                                              cfg.default_sla_ttft_ms, cfg.default_sla_tpot_ms, cfg.power_meter,
                                              cfg.dashboard_points, cfg.dashboard_tick_s)
        self._session = None if cfg.api_key is None else dashboard.session_token(cfg.api_key)
        self._page = dashboard.static_file(dashboard.PAGE)
        self._assets = {name: dashboard.static_file(name) for name in dashboard.ASSETS}
        self._sampler = asyncio.create_task(self._sample_dashboard(), name="smartexit-dashboard")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, api.parse_completion)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, api.parse_chat)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except api.ApiError as err:
            return self._error(err)
        return JSONResponse({"object": "list", "data": [
            {"id": self._cfg.model_name, "object": "model", "created": self._created, "owned_by": "smartexit",
             "max_model_len": self._cfg.context_window}]})

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        """200 when a worker's Triton answered its last control tick, else 503 (no key needed)."""
        try:
            state = await asyncio.wait_for(self._hub.health.remote(), HUB_TIMEOUT_S)
        except (RayError, RayServeException, asyncio.TimeoutError) as exc:
            return JSONResponse({"ready": False, "error": repr(exc)}, status_code=503)
        return JSONResponse(state, status_code=200 if state["ready"] else 503)

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except api.ApiError as err:
            return self._error(err, record=False)
        await self._refresh_replicas()
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)

    @fastapi_app.get("/dashboard")
    async def dashboard_page(self, request: Request) -> Response:
        """The live dashboard. With a key configured: ``?key=K`` answers 303 to ``/dashboard`` with a
        cookie (HttpOnly, SameSite=Strict, path /dashboard) holding ``session_token(K)``, not K."""
        key = request.query_params.get("key")
        if key is not None and self._cfg.api_key is not None:
            if not hmac.compare_digest(key.encode(), self._cfg.api_key.encode()):
                return self._error(api.ApiError(401, "invalid API key in ?key=", code="invalid_api_key"),
                                   record=False)
            resp = RedirectResponse("dashboard", status_code=303, headers=dashboard.PAGE_HEADERS)
            resp.set_cookie(dashboard.COOKIE, self._session, path="/dashboard", httponly=True, samesite="strict")
            return resp
        try:
            self._authorize(request, cookie=True)
        except api.ApiError as err:
            return self._error(err, record=False)
        return Response(self._page, media_type="text/html; charset=utf-8", headers=dashboard.PAGE_HEADERS)

    @fastapi_app.get("/dashboard/data")
    async def dashboard_data(self, request: Request) -> Response:
        """The dashboard's series (``?since=T``: only rows after unix time T)."""
        try:
            self._authorize(request, cookie=True)
            since = request.query_params.get("since")
            try:
                since = None if since is None else float(since)
            except ValueError:
                raise api.ApiError(400, f"since: must be unix seconds, got {since!r}", param="since") from None
        except api.ApiError as err:
            return self._error(err, record=False)
        return JSONResponse(self._dashboard.data(since), headers={"Cache-Control": "no-store"})

    @fastapi_app.get("/dashboard/static/{name:path}")
    async def dashboard_static(self, name: str) -> Response:
        """The page's script, style and the vendored uPlot (public code: no key needed)."""
        if name not in self._assets:
            return self._error(api.ApiError(404, f"no dashboard file {name!r}"), record=False)
        return Response(self._assets[name], media_type=dashboard.ASSETS[name],
                        headers={"Cache-Control": "max-age=3600", "X-Content-Type-Options": "nosniff"})

    async def _refresh_replicas(self) -> None:
        """The workers' latest stats (from the hub) and the in-flight count into the metrics."""
        try:
            self._metrics.set_replica_stats(await asyncio.wait_for(self._hub.snapshot.remote(), HUB_TIMEOUT_S))
        except (RayError, RayServeException, asyncio.TimeoutError) as exc:
            log.warning("metrics without the workers' stats: %r", exc)
            self._metrics.set_replica_stats({})
        self._metrics.inflight.set(self._inflight)
        await self._refresh_routes()

    async def _refresh_routes(self) -> None:
        """The ready workers' tritonservers (from the hub), with ``stream_via: triton``."""
        if self._routes is None:
            return
        try:
            await self._routes.update(await asyncio.wait_for(self._hub.routes.remote(), HUB_TIMEOUT_S))
        except (RayError, RayServeException, asyncio.TimeoutError) as exc:
            log.warning("routes not refreshed: %r", exc)

    async def _open_stream(self, payload: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
        """The request's chunk stream and what releases its slots when it ends.

        With ``triton_host: ingress``, a stream from this replica's own Triton core; with ``stream_via: triton``,
        from a ready tritonserver on this node, else (none ready here) through a worker.

        Raises:
            ApiError: 429 when each ready tritonserver here has ``max_inflight`` of our requests; 503 while this
                replica's own Triton restarts.
        """
        if self._host is not None:
            if self._host.restarting:
                raise api.ApiError(503, "Triton is restarting", code="unavailable",
                                   retry_after_s=self._cfg.retry_after_s)
            self._metrics.streams.labels(via="core").inc()
            return TritonStream(self._host.client, payload), self._release
        if self._routes is not None and not self._routes.known:
            await self._refresh_routes()
        if self._routes is None or not self._routes.known:
            self._metrics.streams.labels(via="worker").inc()
            return self._worker.generate.remote(payload), self._release
        picked = self._routes.pick()
        if picked is None:
            raise api.ApiError(429, f"every worker is at its limit of {self._cfg.max_inflight} requests in "
                               "flight", code="too_many_requests", retry_after_s=self._cfg.retry_after_s)
        url, client = picked
        self._routes.acquire(url, client)
        self._metrics.streams.labels(via="triton").inc()

        def release() -> None:
            self._routes.release(url, client)
            self._release()
        return TritonStream(client, payload), release

    async def _sample_dashboard(self) -> None:
        while True:
            await self._refresh_replicas()
            try:
                self._dashboard.sample()
            except Exception:  # a bad sample costs the dashboard one row, never the API
                log.exception("dashboard sample failed")
            await asyncio.sleep(self._cfg.dashboard_tick_s)

    async def set_policy(self, changes: dict[str, Any]) -> dict[str, Any]:
        """With ``triton_host: ingress``: :meth:`EngineHost.set_policy` of this replica's engine.

        Raises:
            ConfigError: no engine here (the workers host it), or the changes refused.
        """
        if self._host is None:
            raise ConfigError("this ingress hosts no engine (serve.triton_host: worker): switch the worker's policy")
        return await self._host.set_policy(changes)

    def check_health(self) -> None:
        """Serve's health check: with ``triton_host: ingress``, fails (the replica is replaced) when the
        control loop died."""
        if self._host is not None:
            self._host.check_health()

    def __del__(self) -> None:
        sampler = getattr(self, "_sampler", None)
        if sampler is not None:
            sampler.cancel()
        host = getattr(self, "_host", None)
        if host is not None:
            self._host = None
            host.close()

    def _authorize(self, request: Request, cookie: bool = False) -> None:
        """Raises ApiError 401 unless the request carries the key (``cookie``: or the dashboard's cookie)."""
        key = self._cfg.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return
        token = request.cookies.get(dashboard.COOKIE) if cookie else None
        if token is not None and hmac.compare_digest(token.encode(), self._session.encode()):
            return
        how = "open /dashboard?key=<key> or send" if cookie else "send"
        raise api.ApiError(401, f"invalid or missing API key: {how} 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _error(self, err: api.ApiError, record: bool = True) -> Response:
        if record:
            self._metrics.record_request(err.status)
        headers = err.headers() | ({"WWW-Authenticate": "Bearer"} if err.status == 401 else {})
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def _release(self) -> None:
        self._inflight -= 1

    async def _serve(self, request: Request, parse: Callable[..., api.GenerationRequest]) -> Response:
        t0 = time.monotonic()
        stamp("ingress_in")
        try:
            self._authorize(request)
            body = await read_body(request, self._cfg.max_body_bytes)
            req = await parse_request(parse, body, self._limits, self._tok)
            if self._inflight >= self._capacity:
                raise api.ApiError(429, f"the server is at its limit of {self._capacity} requests in flight",
                                   code="too_many_requests", retry_after_s=self._cfg.retry_after_s)
        except api.ApiError as err:
            return self._error(err)
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        text = TextStream(lambda ids: self._tok.decode(ids, skip_special_tokens=True), req.stop,
                              lstrip=req.kind == "chat")
        try:
            stream, release = await self._open_stream(req.payload(rid, self._stop_ids))
        except api.ApiError as err:
            return self._error(err)
        self._inflight += 1  # released by gen.finish
        gen = Generation(stream, req, text, self._metrics, t0, release)
        if req.stream:
            events = sse_events(gen, rid)
            try:
                first = await events.__anext__()  # a rejection still gets its HTTP status
                stamp("ingress_first", rid)
            except api.ApiError as err:
                return self._error(err, record=False)  # sse_events recorded it
            return StreamingResponse(prepend(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        status = 499  # the client went away (nginx's code), unless set below
        try:
            body = await complete(gen, rid)
            status = 200
            return JSONResponse(body)
        except api.ApiError as err:
            status = err.status
            return self._error(err, record=False)
        finally:
            gen.finish(status)


def build_app(cfg: ServeConfig, repo_dir: Path | None = None) -> serve.Application:
    """The application: ``Ingress`` bound to ``cfg.replicas`` workers and one hub.

    ``repo_dir``: the Triton model repository each worker launches tritonserver on (not needed when
    ``cfg.triton_url`` names a running server).
    Raises:
        ConfigError: the bundle is unreadable, or neither ``repo_dir`` nor ``triton_url`` is given.
    """
    if cfg.triton_url is None and repo_dir is None:
        raise ConfigError("serving needs a Triton model repository (repo_dir) or serve.triton_url")
    cfg = cfg.resolve_bundle(repo_dir)  # fail here, in the caller, rather than in a replica
    hub = Hub.bind(cfg.stats_ttl_s)
    if cfg.engine_in_ingress:  # one ingress replica per device, each with Triton's core in its process
        return Ingress.options(
            num_replicas=cfg.replicas, max_ongoing_requests=cfg.max_inflight + 32,
            ray_actor_options={"resources": {DEVICE_RESOURCE: 1}, "num_cpus": 0},
        ).bind(cfg, None, hub, Path(repo_dir))
    worker = Worker.options(
        num_replicas=cfg.replicas, max_ongoing_requests=cfg.max_inflight + 8,
        ray_actor_options={"resources": {DEVICE_RESOURCE: 1}, "num_cpus": 0},
    ).bind(cfg, None if repo_dir is None else Path(repo_dir), hub)
    return Ingress.options(max_ongoing_requests=cfg.max_inflight * cfg.replicas + 32).bind(cfg, worker, hub)


def run(cfg: ServeConfig, repo_dir: Path | None = None, name: str = "smartexit",
        blocking: bool = False, proxy_port: int | None = None) -> DeploymentHandle:
    """Start Serve's HTTP proxy on ``cfg.host:cfg.port`` (``proxy_port`` instead where the ingress
    replica itself serves ``cfg.port``: direct ingress, scheduler/serving/stack.py) and deploy
    :func:`build_app` (after the caller's ``ray.init(resources={"smartexit_device": N})``); the
    ingress's handle."""
    app = build_app(cfg, repo_dir)
    serve.start(http_options={"host": cfg.host, "port": cfg.port if proxy_port is None else proxy_port})
    # Serve logs every request and every hub push at INFO; on a 2-core device that costs the engine CPU
    return serve.run(app, name=name, route_prefix="/", blocking=blocking,
                     logging_config={"log_level": cfg.log_level, "enable_access_log": cfg.log_level == "INFO"})
