"""The OpenAI-compatible HTTP door of a scheduler replica (``--http-port``): Starlette on uvicorn.

A thin layer over the same ``Frontend`` as the gRPC servicer: each request becomes
a ``pb.GenerateRequest`` (``openai_request.parse``; a batch of prompts one per prompt,
``batch``; ``echo`` read first), then ``Frontend.prepare`` and
``Frontend.generate`` exactly as ``GenerationServicer.Generate`` calls them. No
second scheduling path; the tokens, stop strings, caps and admission control are
the gRPC API's. ``/v1/responses`` is a chat completion on the same path,
translated before and after (``responses``, ``responses_stream``). docs/http.md
describes the endpoints, the field mapping, the status codes and the stream format.

The first chunk of a completion is awaited before the answer starts, so that a
refusal at submission (429 over ``--max-pending-requests``, 409, 504) is an HTTP
status rather than an error inside a 200 stream. A client that hangs up, while
waiting or mid-stream, closes the frontend's generator, which aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.auth import SecretFile, bearer
from pagedserve.lora import Adapter
from pagedserve.security import ReloadingSSLContext
from scheduler_svc.core.request import Request as Req
from scheduler_svc.frontend import batch, echo, responses, tokenize, tools
from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import openai_response as answer
from scheduler_svc.frontend.conversations import Conversations
from scheduler_svc.frontend.models import Models
from scheduler_svc.frontend.openai_request import ApiError, Parsed, refused
from scheduler_svc.frontend.refusals import InvalidArgument, Kind
from scheduler_svc.frontend.responses import Call
from scheduler_svc.frontend.responses_stream import Events
from scheduler_svc.frontend.responses_stream import encode as stream_event
from scheduler_svc.frontend.service import Frontend
from scheduler_svc.frontend.streams import Chunk
from scheduler_svc.frontend.validate import Limits

log = logging.getLogger(__name__)
T = TypeVar("T")
OPEN_PATHS = frozenset({"/health", "/ping"})  # for probes: no API key
DONE = b"data: [DONE]\n\n"
SHUTDOWN_GRACE_S = 5  # as the gRPC server's grace on drain


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


class ClientGone(Exception):
    """The client hung up before the answer started."""


class BearerAuth:
    """ASGI middleware: every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``
    with a key of ``--api-key-file``, compared in constant time; else 401 before the body
    is read."""

    def __init__(self, app: ASGIApp, keys: SecretFile) -> None:
        self.app, self.keys = app, keys

    def allowed(self, scope: Scope) -> bool:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k == b"authorization"]
        ok = False
        for candidate in bearer(headers):
            ok |= self.keys.matches(candidate)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        err = refused(Kind.UNAUTHENTICATED, "missing or invalid API key (header Authorization: Bearer <key>)")
        await error_response(err)(scope, receive, send)


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (Starlette
    leaves it suspended when a send fails), so that the request behind it is aborted."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self.events = events
        self.on_close: Callable[[], None] | None = None  # the door's in-flight count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                self.on_close()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone (``work`` cancelled) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise refused(Kind.REQUEST_TOO_LARGE, f"request: {size} bytes, over the limit of {limit}")
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise refused(Kind.REQUEST_TOO_LARGE, f"request: over the limit of {limit} bytes")
    except ClientDisconnect:
        raise ClientGone from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise refused(Kind.INVALID_ARGUMENT, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise refused(Kind.INVALID_ARGUMENT, "the body must be a JSON object")
    return body


@dataclass(slots=True)
class Door:
    """The endpoints; ``max_request_bytes`` (``--max-request-bytes``) bounds the translated
    request as on gRPC, and four times it the JSON body (token ids take more room in JSON).
    ``metrics``: what ``/metrics`` serves (the replica's registry, under ``--metrics-prefix``)."""

    frontend: Frontend
    max_request_bytes: int
    models: Models
    metrics: CollectorRegistry | None = None
    version: str = ""
    in_flight: int = 0  # completions being answered here, streams until they end: /load

    @property
    def conversations(self) -> Conversations:
        """``/v1/responses``' stored conversations, in this replica's Redis."""
        return Conversations(self.frontend.store)

    @property
    def model(self) -> str:
        """The id answers report: the first served name, else the model directory."""
        return self.models.id

    async def list_models(self, request: Request) -> Response:
        """The model's cards, then one per registered LoRA adapter (``parent``: the model's id, as vLLM)."""
        cards = self.models.cards()
        if cards:
            cards += [self.models.adapter_card(a.name, a.path) for a in await self.frontend.loras.all()]
        return JSONResponse({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``/v1/load_lora_adapter``, but for the namespace: every replica serves the name."""
        return await _answered(self._lora(request, load=True))

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await _answered(self._lora(request, load=False))

    async def _lora(self, request: Request, load: bool) -> Response:
        body = await _read_json(request, self.max_request_bytes)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str):
            raise InvalidArgument("lora_name", "must be a string")
        if not load:
            await self.frontend.loras.unregister(name)
            return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
        if not isinstance(path, str):
            raise InvalidArgument("lora_path", "must be a string")
        await self.frontend.loras.register(name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def _adapter(self, name: str | None) -> Adapter | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 if neither."""
        if name is None or not self.frontend.loras.enabled or not self.models.known or self.models.accepts(name):
            return None
        return await self.frontend.loras.resolve(name, "model")

    async def model_card(self, request: Request) -> Response:
        name = request.path_params["model"]
        if not self.models.known or not self.models.accepts(name):
            return error_response(self._unknown_model(name))
        return JSONResponse(self.models.card(name))

    def _serving(self) -> bool:
        return not self.frontend.draining and self.frontend.watch.serving

    async def health(self, request: Request) -> Response:
        """200 while this replica can serve (not draining, an executor serving), else 503: what
        its gRPC health says (the cluster watch's last look, refreshed every second). ``/ping``
        (SageMaker's probe, as vLLM serves it) answers the same."""
        serving = self._serving()
        return JSONResponse({"status": "serving" if serving else "not serving"}, 200 if serving else 503)

    async def load(self, request: Request) -> Response:
        """vLLM's load report: the completions this replica's HTTP door is answering now."""
        return JSONResponse({"server_load": self.in_flight})

    async def server_version(self, request: Request) -> Response:
        return JSONResponse({"version": self.version})

    async def prometheus(self, request: Request) -> Response:
        """The same exposition as ``--metrics-port`` (the loop process's included), on the API port."""
        if self.metrics is None:
            return error_response(ApiError(404, "Not Found"))
        text = await asyncio.to_thread(generate_latest, self.metrics)  # the loops' part is fetched over loopback
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    def _unknown_model(self, name: str) -> ApiError:
        return refused(
            Kind.MODEL_NOT_FOUND, f"The model `{name}` does not exist (this server serves `{self.model}`).", "model"
        )

    def _check_model(self, name: str | None) -> None:
        if (
            name is not None
            and self.models.known
            and not self.models.accepts(name)
            and name not in self.frontend.loras.seen
        ):
            raise self._unknown_model(name)

    async def tokenize(self, request: Request) -> Response:
        return await _answered(self._tokenize(request))

    async def detokenize(self, request: Request) -> Response:
        return await _answered(self._detokenize(request))

    async def _tokenize(self, request: Request) -> Response:
        body = await _read_json(request, 4 * self.max_request_bytes)
        t = tokenize.parse_tokenize(body, self.frontend.caps.max_prompt_bytes)
        self._check_model(t.model)
        limits = self._open()
        return JSONResponse(tokenize.answer(self.frontend.tokenizer, t, limits.max_model_len))

    async def _detokenize(self, request: Request) -> Response:
        body = await _read_json(request, 4 * self.max_request_bytes)
        self._check_model(tokenize.model_of(body))
        limits = self._open()
        tokens = tokenize.parse_detokenize(body, limits.vocab_size)
        return JSONResponse({"prompt": self.frontend.tokenizer.decode(tokens)})

    def _open(self) -> Limits:
        """The limits, once an executor has told them (else 503, as for a completion)."""
        limits = self.frontend.watch.limits
        if limits is None or self.frontend.tokenizer is None:
            raise refused(Kind.UNAVAILABLE, "no executor has registered in this namespace yet")
        return limits

    async def completions(self, request: Request) -> Response:
        return await self._counted(self._generate(request, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(self._generate(request, chat=True))

    async def _counted(self, work: Awaitable[Response]) -> Response:
        """``work``'s answer, counted in ``in_flight`` until it is sent (a stream: until it ends)."""
        self.in_flight += 1
        try:
            response = await _answered(work)
        except BaseException:
            self.in_flight -= 1
            raise
        if isinstance(response, EventStream):
            response.on_close = self._release
        else:
            self._release()
        return response

    def _release(self) -> None:
        self.in_flight -= 1

    def _parsed(self, body: dict[str, Any], chat: bool, rid: str) -> tuple[str, list[Parsed]]:
        """The request id the answer carries, and the request of each prompt (one unless a batch)."""
        prompts = None if chat else batch.prompts(body.get("prompt"))
        if prompts is None:
            return rid, [proto.parse(body, chat, rid)]
        base = rid or uuid.uuid4().hex
        out = []
        for i, prompt in enumerate(prompts):
            try:
                out.append(proto.parse(body | {"prompt": prompt}, chat, batch.request_id(base, i)))
            except ApiError as exc:
                raise batch.renamed(exc, i) from exc
        return base, out

    def _prepare(self, parsed: Parsed, lora: Adapter | None = None) -> tuple[Req, list[str]]:
        """``Frontend.prepare`` of one request, as the gRPC servicer calls it."""
        if lora is None:
            self._check_model(parsed.model)
        if (size := parsed.request.ByteSize()) > self.max_request_bytes:
            raise refused(
                Kind.INVALID_ARGUMENT,
                f"request: {size} bytes as a pagedserve.v1 request, over the limit of "
                f"{self.max_request_bytes} (--max-request-bytes)",
            )
        try:
            req, stop = self.frontend.prepare(parsed.request, None, lora)
        except InvalidArgument as exc:  # a refused structured-output spec is named as the body named it
            if (renamed := proto.structured_error(exc, parsed)) is None:
                raise
            raise renamed from exc
        limits = self.frontend.watch.limits
        if parsed.chat and not parsed.request.sampling.HasField("max_tokens") and limits is not None:
            req.params = replace(req.params, max_tokens=proto.context_room(limits, len(req.prompt_ids)))
        return req, stop

    def _prepare_all(self, all_parsed: list[Parsed], lora: Adapter | None) -> tuple[list[Req], list[str]]:
        """Each prompt's request (a refusal names the prompt of a batch), and the stop strings."""
        if len(all_parsed) == 1:
            req, stop = self._prepare(all_parsed[0], lora)
            return [req], stop
        reqs = []
        for i, parsed in enumerate(all_parsed):
            try:
                req, stop = self._prepare(parsed, lora)
            except Exception as exc:
                if (err := proto.error_for(exc)) is None:
                    raise
                raise batch.renamed(err, i) from exc
            reqs.append(req)
        return reqs, stop

    async def _start(self, request: Request, body: dict[str, Any], chat: bool, echoing: echo.Echo | None) -> Started:
        """Submit the completion (or chat completion) ``body`` and await its first chunk."""
        rid, all_parsed = self._parsed(body, chat, request.headers.get("x-request-id", ""))
        lora = await self._adapter(all_parsed[0].model)
        reqs, stop = self._prepare_all(all_parsed, lora)
        parsed, tokenizer = all_parsed[0], self.frontend.tokenizer
        if echoing is not None:
            texts = [p.request.prompt or tokenizer.decode(r.prompt_ids) for p, r in zip(all_parsed, reqs)]
            echoing = replace(echoing, texts=tuple(texts))
        shape = answer.Shape(
            parsed,
            rid or reqs[0].request_id,
            int(time.time()),
            lora.name if lora is not None else self.model,  # as vLLM: answers name the adapter
            [list(r.prompt_ids) for r in reqs],
            decode=lambda t: tokenizer.decode([t]),
            echo=echoing,
            tools=tools.plan(parsed.request, self.frontend.tool_call_parser) if chat else None,
        )
        if len(reqs) == 1:
            chunks = self.frontend.generate(reqs[0], stop)
        else:
            order = {r.request_id: i for i, r in enumerate(reqs)}
            chunks = batch.numbered(self.frontend.generate(reqs, stop), order, shape.n)
        try:
            first = await _unless_gone(request, anext(chunks))
        except BaseException:
            await chunks.aclose()  # type: ignore[attr-defined]
            raise
        return Started(shape, first, chunks, shape.n * len(reqs))

    async def _generate(self, request: Request, chat: bool) -> Response:
        body, echoing = echo.read(await _read_json(request, 4 * self.max_request_bytes), chat)
        s = await self._start(request, body, chat, echoing)
        if s.shape.parsed.stream:  # the stream closes the generator from now on
            return EventStream(self._events(s.shape, s.first, s.chunks), s.headers)
        return JSONResponse(s.shape.body(await s.collect(request)), headers=s.headers)

    async def _events(self, shape: answer.Shape, first: Chunk, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        """The stream: chunks, the usage chunk, ``[DONE]``; or, if the stream cannot go on,
        an error event and no ``[DONE]``."""
        try:
            async for event in _chat_events(shape, first, chunks):
                yield sse(event)
        except Exception as exc:  # StreamDetached: the replica drains, the request goes on
            yield sse(_stream_error(exc, shape.request_id).body())
            return
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        yield DONE

    async def responses(self, request: Request) -> Response:
        return await self._counted(self._respond(request))

    async def _respond(self, request: Request) -> Response:
        """``/v1/responses``: the request as a chat completion (``responses``) on the chat path."""
        call = responses.parse(await _read_json(request, 4 * self.max_request_bytes))
        history = await self.conversations.history(call.previous_response_id)
        try:
            s = await self._start(request, responses.chat_body(call, history), True, None)
        except Exception as exc:
            if (err := proto.error_for(exc)) is None:
                raise
            raise responses.renamed(err) from exc
        rid = responses.new_id("resp")
        if call.stream:
            events = Events(call, rid, s.shape.created, self.model)
            return EventStream(self._response_events(call, history, events, s), s.headers)
        got = responses.answer(call, s.shape.body(await s.collect(request)), rid)
        await self.conversations.keep(call, history, got)
        return JSONResponse(got, headers=s.headers)

    async def _response_events(
        self, call: Call, history: list[dict[str, Any]], events: Events, s: Started
    ) -> AsyncIterator[bytes]:
        try:
            for event in events.opening():
                yield stream_event(event)
            async for chunk in _chat_events(s.shape, s.first, s.chunks):
                for event in events.feed(chunk):
                    yield stream_event(event)
            last = events.closing()
            await self.conversations.keep(call, history, events.response())
        except Exception as exc:
            yield stream_event(events.error(responses.renamed(_stream_error(exc, s.shape.request_id))))
            return
        finally:
            await s.chunks.aclose()  # type: ignore[attr-defined]
        for event in last:
            yield stream_event(event)

    async def get_response(self, request: Request) -> Response:
        """A stored Response, while its ``--result-ttl`` lasts."""
        return await _answered(self._stored(request.path_params["response_id"]))

    async def _stored(self, response_id: str) -> Response:
        return JSONResponse(await self.conversations.response(response_id))


@dataclass(slots=True)
class Started:
    """A completion submitted, its first chunk in: what both answers (whole, streamed) start from."""

    shape: answer.Shape
    first: Chunk
    chunks: AsyncIterator[Chunk]
    total: int  # completions: n per prompt

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.shape.request_id}

    async def collect(self, request: Request) -> list[answer.Collected]:
        """Every completion, whole (the generator is closed whatever happens)."""
        try:
            return await _unless_gone(request, _collect(self.first, self.chunks, self.total))
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]


async def _chat_events(
    shape: answer.Shape, first: Chunk, chunks: AsyncIterator[Chunk]
) -> AsyncIterator[dict[str, Any]]:
    """A chat (or completions) stream's chunks as objects, the usage chunk included."""
    for event in shape.opening():
        yield event
    for event in shape.events(first):
        yield event
    async for chunk in chunks:
        for event in shape.events(chunk):
            yield event
    for event in shape.closing():
        yield event


def _stream_error(exc: Exception, request_id: str) -> ApiError:
    """The error event of a stream that cannot go on (a bug: logged, an internal error)."""
    if (err := proto.error_for(exc)) is None:
        log.exception("stream of %s failed", request_id, extra={"request_id": request_id})
        err = refused(Kind.INTERNAL, "internal error")
    return err


async def _collect(first: Chunk, chunks: AsyncIterator[Chunk], n: int) -> list[answer.Collected]:
    """Every completion gathered, by index."""
    done = [answer.Collected() for _ in range(n)]
    done[first.index].add(first)
    async for chunk in chunks:
        done[chunk.index].add(chunk)
    return done


async def _answered(work: Awaitable[Response]) -> Response:
    """``work``'s response, or the error answer to what the frontend raised (never a 500 for
    bad input); anything else propagates to the 500 handler, which logs it."""
    try:
        return await work
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; its request was aborted
    except Exception as exc:
        if (err := proto.error_for(exc)) is None:
            raise
        return error_response(err)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response(refused(Kind.INTERNAL, "internal error"))


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path, wrong method) as OpenAI error objects."""
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.status_code, exc.detail, headers=dict(exc.headers or {})))


def build_app(door: Door, api_keys: SecretFile | None = None) -> Starlette:
    routes = [
        Route("/v1/completions", door.completions, methods=["POST"]),
        Route("/v1/chat/completions", door.chat_completions, methods=["POST"]),
        Route("/v1/responses", door.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", door.get_response, methods=["GET"]),
        Route("/v1/models", door.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", door.model_card, methods=["GET"]),
        Route("/health", door.health, methods=["GET"]),
        Route("/ping", door.health, methods=["GET", "POST"]),
        Route("/tokenize", door.tokenize, methods=["POST"]),
        Route("/detokenize", door.detokenize, methods=["POST"]),
        Route("/version", door.server_version, methods=["GET"]),
        Route("/load", door.load, methods=["GET"]),
        Route("/metrics", door.prometheus, methods=["GET"]),
    ]
    if door.frontend.loras.enabled:
        routes += [
            Route("/v1/load_lora_adapter", door.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", door.unload_lora_adapter, methods=["POST"]),
        ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: _http_error,
        500: _internal_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers)
    if api_keys is not None:
        app.add_middleware(BearerAuth, keys=api_keys)
    return app


class _Server(uvicorn.Server):
    """Signals belong to the scheduler (``rpc.stop_on_signals``), which stops this server on drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is one clear error at start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise OSError(f"--http-port {port}: cannot listen on {host}: {exc}") from exc


@dataclass(slots=True)
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    tls: bool

    async def stop(self) -> None:
        """Stop taking connections and wait (``SHUTDOWN_GRACE_S`` at most) for open ones: their
        streams end as the frontend drains."""
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, SHUTDOWN_GRACE_S + 5)


async def serve(
    door: Door,
    host: str,
    port: int,
    *,
    api_keys: SecretFile | None = None,
    tls: ReloadingSSLContext | None = None,
) -> HttpServer:
    """Serve the door on ``host:port`` as a task of the running loop; returns once it listens."""
    sock = bind(host, port)
    app = build_app(door, api_keys)
    config = uvicorn.Config(
        app,
        http="h11",
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        ssl_context_factory=(lambda _config, _default: tls.context) if tls else None,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # its error
        raise RuntimeError("the HTTP server stopped at start")
    return HttpServer(server, task, sock.getsockname()[1], tls is not None)
