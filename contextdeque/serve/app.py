"""The HTTP layer: an OpenAI-compatible API over an `Engine`.

``POST /v1/chat/completions`` (streaming SSE and not), ``GET /v1/models``, ``GET /healthz``,
``GET /metrics``. Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status for anything the client can fix (401 wrong key, 400 malformed body or a
conversation beyond the served context, 404 unknown model, 429 queue full).
A session is chosen by the ``X-Session-Id`` request header, else by content (the session
whose history the messages extend); the response's ``X-Session-Id`` header names it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.errors import AgentInputError, BudgetError, MediaError, MessageFormatError, MessageTypeError, WindowError
from .compat import refusal, unserved_endpoint
from .engine import Engine, GenerationRequest, GenerationResult, QueueFull
from .metrics import CONTENT_TYPE

log = logging.getLogger("contextdeque.serve")
SESSION_HEADER = "X-Session-Id"


class APIError(Exception):
    """An error the API answers in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.code, self.param))


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_WHERE = re.compile(r"^(messages\[\d+\](?:\.[A-Za-z_]+(?:\[\d+\])?)*)")


def input_error(e: AgentInputError | WindowError) -> APIError:
    """The 400 of a request whose messages the window refused: an OpenAI ``code`` by kind
    (``invalid_type``, ``invalid_value``, ``invalid_image``, ``invalid_request``) and the
    message's place (``messages[1].role``) as ``param`` where the error names one."""
    if isinstance(e, BudgetError):
        return APIError(400, str(e), code="context_length_exceeded", param="messages")
    code = ("invalid_type" if isinstance(e, MessageTypeError) else "invalid_value" if isinstance(e, MessageFormatError)
            else "invalid_image" if isinstance(e, MediaError) else "invalid_request")
    m = _WHERE.match(str(e))
    return APIError(400, str(e), code=code, param=m.group(1) if m else "messages")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None


def _usage(res: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.token_ids),
        "total_tokens": res.prompt_tokens + len(res.token_ids),
        "contextdeque": res.usage_extra(),
    }


def create_app(engine: Engine, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` (``api_key``: required bearer token)."""
    app = FastAPI(title="contextdeque serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    expected = None if not api_key else api_key.encode()
    created = int(time.time())

    def endpoint_of(path: str) -> str:
        return path if path in ("/v1/chat/completions", "/v1/models", "/healthz", "/metrics") else "other"

    @app.middleware("http")
    async def count_and_guard(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if expected is not None and path != "/healthz":
            auth = request.headers.get("authorization", "")
            token = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not hmac.compare_digest(token, expected):
                resp: Response = APIError(
                    401, "Incorrect API key provided (send it as 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                ).response()
                engine.metrics.requests.labels(endpoint_of(path), "401").inc()
                return resp
        resp = await call_next(request)
        engine.metrics.requests.labels(endpoint_of(path), str(resp.status_code)).inc()
        return resp

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            msg, param = "the request body is not valid JSON", None
        text = f"invalid request: {msg}" + (f" (at {param})" if param else "")
        return JSONResponse(status_code=400, content=error_body(text, "invalid_request_error", "invalid_request", param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # say what is served instead of a bare "Not Found"
            message = unserved_endpoint(request.method, request.url.path)
        return JSONResponse(status_code=exc.status_code, content=error_body(message, "invalid_request_error", code))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(status_code=500, content=error_body(f"internal error: {type(exc).__name__}", "server_error"))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        tiers = []
        degraded = False
        for t in engine.store.tiers:
            info: dict[str, Any] = {"name": t.name, "kind": t.kind}
            if getattr(t, "remote", False):
                info.update(available=t.available, away_reason=t.away_reason, trust=t.trust, endpoint=t.endpoint.address)
                degraded |= not t.available
            tiers.append(info)
        return {
            "status": "degraded" if degraded else "ok", "model": engine.model_name,
            "fingerprint": engine.backend.fingerprint, "store": tiers, "sessions": len(engine.sessions),
            "queue_depth": engine.queue_depth(),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": created, "owned_by": "contextdeque"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        if body.model != engine.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{engine.model_name}'",
                           code="model_not_found", param="model")
        refused = refusal(body.model_dump(exclude_unset=True), model_name=engine.model_name,
                          tools_supported=engine.tools_supported)
        if refused is not None:
            raise APIError(400, refused.message, code=refused.code, param=refused.param)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        wanted = body.max_completion_tokens or body.max_tokens or engine.max_tokens
        if wanted > engine.max_tokens:  # never a silent clamp
            param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise APIError(400, f"{param} is {wanted}, over this server's limit of {engine.max_tokens} new tokens "
                                f"per request (contextdeque serve --max-tokens)", code="invalid_value", param=param)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop sequences", param="stop")
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Any] = asyncio.Queue()
        session_chosen: asyncio.Future[str] = loop.create_future()

        def chose(sid: str) -> None:
            loop.call_soon_threadsafe(lambda: session_chosen.done() or session_chosen.set_result(sid))

        req = GenerationRequest(
            messages=messages, max_new_tokens=wanted, session_id=request.headers.get(SESSION_HEADER),
            temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=stop,
            on_text=(lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d)) if body.stream else None,
            on_session=chose if body.stream else None,
        )
        try:
            fut = engine.submit(req)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry shortly", "rate_limit_error", "rate_limit_exceeded") from None
        except (AgentInputError, WindowError) as e:
            raise input_error(e) from None
        cid = "chatcmpl-" + uuid.uuid4().hex
        now = int(time.time())
        if not body.stream:
            try:
                res: GenerationResult = await asyncio.wrap_future(fut)
            except (AgentInputError, WindowError) as e:
                raise input_error(e) from None
            payload = {
                "id": cid, "object": "chat.completion", "created": now, "model": engine.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                             "finish_reason": res.finish_reason, "logprobs": None}],
                "usage": _usage(res),
            }
            return JSONResponse(payload, headers={SESSION_HEADER: res.session_id})

        # the response's X-Session-Id names the session, so the headers wait until the worker has
        # chosen it (the request waits for the worker anyway); a request that fails before that
        # is answered with its error status, not a stream
        outcome = asyncio.wrap_future(fut)
        outcome.add_done_callback(lambda f: f.cancelled() or f.exception())  # read in events(): never "unretrieved"
        await asyncio.wait([session_chosen, outcome], return_when=asyncio.FIRST_COMPLETED)
        if not session_chosen.done():
            try:
                outcome.result()
            except (AgentInputError, WindowError) as e:
                raise input_error(e) from None
        session_id = session_chosen.result() if session_chosen.done() else req.session_id
        done = object()
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(deltas.put_nowait, done))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            c = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": engine.model_name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            return f"data: {json.dumps(c)}\n\n"

        async def events() -> Any:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                item = await deltas.get()
                if item is done:
                    break
                yield chunk({"content": item})
            try:
                res = fut.result()
            except (AgentInputError, WindowError) as e:
                err = input_error(e)
                yield f"data: {json.dumps(error_body(err.message, err.type, err.code, err.param))}\n\n"
                yield "data: [DONE]\n\n"
                return
            except Exception as e:  # noqa: BLE001 - reported in the stream; headers are already sent
                log.exception("streamed request failed")
                yield f"data: {json.dumps(error_body(f'internal error: {type(e).__name__}', 'server_error'))}\n\n"
                yield "data: [DONE]\n\n"
                return
            yield chunk({}, res.finish_reason)
            if include_usage:
                u = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": engine.model_name,
                     "choices": [], "usage": _usage(res)}
                yield f"data: {json.dumps(u)}\n\n"
            yield "data: [DONE]\n\n"

        headers = {SESSION_HEADER: session_id} if session_id else {}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app
