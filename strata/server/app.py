"""The HTTP API (Starlette): OpenAI-compatible generation, models, health and metrics.

A generation request: check the key, read and check the body (validation.py), ask the supervisor
whether the engine is up, queue a Job (scheduler.py, 429 when full), wait for the engine to accept
it (400 for a prompt that does not fit), then answer in one piece or stream it as SSE chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import importlib.resources
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from strata.errors import StrataError
from strata.server.config import ServeConfig
from strata.server.errors import EXCEPTION_HANDLERS, GONE, APIError, as_error, bad_request
from strata.server.faults import FaultPlan
from strata.server.json_checks import MAX_DEPTH, check_json
from strata.server.metrics import Metrics
from strata.server.protocol import Accepted, Delta, Failed, Finished, Submit
from strata.server.responses import Builder, sse
from strata.server.scheduler import Job, new_request_id
from strata.server.supervisor import Supervisor
from strata.server.tool_calls import (
    call_grammar,
    forced_prefix,
    format_of,
    parse,
    parser_for,
)
from strata.server.tool_prompt import needs_rewrite, rewrite
from strata.server.validation import ParsedRequest, parse_chat, parse_completion

log = logging.getLogger("strata.serve")
_BODY_TIMEOUT_S = 30.0
# a body over --max-body but at most this many times it is read and dropped before the 413
_DRAIN_MAX = 16


_DISCONNECT_CHECK_S = 0.5
_RENDERS = 2  # chat templates rendered at once (each in a thread, GIL-bound)
_EVENT_GRACE_S = 60.0  # beyond the watchdog: the stall path answers first, this is the backstop
# the chat page may talk to this server only: inline script and style, nothing from elsewhere
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


async def _drain(request: Request) -> None:
    async for _ in request.stream():
        pass


class API:
    def __init__(self, cfg: ServeConfig, fault: FaultPlan | None):
        self.cfg = cfg
        self.metrics = Metrics()
        self.sup = Supervisor(cfg, fault, self.metrics)
        self.created = int(time.time())
        self._renders = asyncio.Semaphore(_RENDERS)

    # --- endpoints -------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        """GET /: the chat page (static/chat.html). It needs no key: it holds none, and the key
        a user types into it goes with each API call it makes."""
        return HTMLResponse(_chat_page(), headers=_PAGE_HEADERS)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model_id"], "model")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        h = self.sup.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    async def metrics_text(self, request: Request) -> Response:
        sched = self.sup.scheduler
        text = self.metrics.render(running=len(sched.running), queued=len(sched.waiting),
                                   loaded=self.sup.state == "ready", restarts=self.sup.restarts)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: Request) -> Response:
        """llama-server's POST /tokenize: {"content", "add_special", "with_pieces"} ->
        {"tokens": [id, ...]} or, with pieces, [{"id", "piece"}, ...] (a piece that is not whole
        UTF-8 is its list of bytes). Special-token text in the content becomes control tokens."""
        self._authorize(request)
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        content = body.get("content")
        if not isinstance(content, str):
            raise bad_request("content: give a string", "content")
        flags = {}
        for name in ("add_special", "with_pieces"):
            flags[name] = body.get(name, False)
            if not isinstance(flags[name], bool):
                raise bad_request(f"{name}: give true or false", name)
        tok = await self._tokenizer()

        def answer() -> JSONResponse:  # (a worker thread's: a long text never holds the loop)
            ids = tok.encode(content, flags["add_special"], True)
            if flags["with_pieces"]:
                ids = [{"id": i, "piece": _piece(tok, i)} for i in ids]
            return JSONResponse({"tokens": ids})

        async with self._renders:
            return await asyncio.to_thread(answer)

    async def detokenize(self, request: Request) -> Response:
        """llama-server's POST /detokenize: {"tokens": [id, ...]} -> {"content": text}."""
        self._authorize(request)
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        ids = body.get("tokens")
        tok = await self._tokenizer()
        if not isinstance(ids, list) or not all(
                type(i) is int and 0 <= i < tok.vocab_size for i in ids):
            raise bad_request(f"tokens: give a list of token ids from 0 to {tok.vocab_size - 1}",
                              "tokens")
        async with self._renders:
            text = await asyncio.to_thread(tok.decode, ids)
        return JSONResponse({"content": text})

    async def _tokenizer(self) -> Any:
        """The model's tokenizer, loaded in this process with the chat template (a request that
        comes while it loads, just after the engine did, waits for it)."""
        self.sup.check_ready()
        chat = await self.sup.loaded_chat()
        if chat is None:
            raise APIError(503, "the tokenizer did not load in the server process (see its log)",
                           code="engine_unavailable")
        return chat.tokenizer

    # --- generation ------------------------------------------------------------------------
    async def _generate(self, request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            self._authorize(request)
            body = await self._read_json(request)
            req = (parse_chat if kind == "chat" else parse_completion)(body, self.cfg.max_tokens)
            if req.model is not None:
                self._check_model(req.model, "model")
            self.sup.check_ready()
            if kind == "chat":  # the template names the call format: wait for one that loads
                await self.sup.loaded_chat()
            fmt, prefix = self._call_format(req, kind)
            if kind == "chat" and self.sup.chat is not None:
                await self._render(req, prefix)
                prefix_left = ""
            else:
                prefix_left = prefix  # the engine renders: it writes the prefix too
                if isinstance(req.prompt, str) and self.sup.chat is not None:
                    await self._encode(req)
            job = Job(self._submit(req, kind, fmt is not None, prefix_left))
            self.sup.scheduler.submit(job)
            first = await self._next(job, request)
            if first is None:
                raise GONE
            if isinstance(first, Failed):
                raise APIError(first.status, first.message, first.param, first.code)
            if isinstance(first, APIError):
                raise first
            assert isinstance(first, Accepted)
            b = Builder(kind, job.rid, self.cfg.served_name, req.include_usage)
            if req.stream:  # 200 from here on; a later failure is an event in the stream
                response: Response = StreamingResponse(
                    self._stream(job, b, fmt, req.tools, prefix), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})
            else:
                response = await self._collect(job, b, request, fmt, req.tools, prefix)
        except APIError as e:
            self.metrics.request(endpoint, e.status)
            raise
        self.metrics.request(endpoint, response.status_code)
        return response

    def _submit(self, req: ParsedRequest, kind: str, keep_special: bool = False,
                prefix: str = "") -> Submit:
        rid = new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        where = "messages" if kind == "chat" else "prompt"
        return Submit(rid, req.messages, req.prompt, req.sampling, req.max_tokens,
                      self.cfg.max_tokens, req.stop, req.ignore_eos, req.template_kwargs, where,
                      keep_special, prefix, req.grammar)

    def _call_format(self, req: ParsedRequest, kind: str) -> tuple[str | None, str]:
        """The call format to parse the answer with (None: plain text), and the start of a call
        written after the prompt when tool_choice requires one (tool_calls.py)."""
        if kind != "chat":
            return None, ""
        fmt = format_of(getattr(self.sup.chat, "template", None))
        if not (req.tools and req.tool_choice != "none") and fmt != "harmony":
            return None, ""
        if req.tool_choice != "required":
            return fmt, ""
        from strata.engine import constrain

        if req.grammar is None and constrain.available():
            try:  # the call follows its function's parameters schema
                lark = call_grammar(fmt, req.tools or [], req.tool_name)
                req.grammar = None if lark is None else constrain.lark_grammar(lark)
            except StrataError as e:
                raise bad_request(f"tools: a function's parameters: {e}", "tools") from None
        return fmt, forced_prefix(fmt, req.tool_name)

    async def _render(self, req: ParsedRequest, prefix: str = "") -> None:
        """Chat messages -> prompt token ids here, in a worker thread with the template's
        deadline and size cap (strata.tokenizer.chat), so that a runaway template fails its own
        request with a 400 and never holds up the engine; a few renders run at a time."""
        chat = self.sup.chat
        if needs_rewrite(getattr(chat, "template", None), req.messages, req.tools):
            # a template that takes no tools: tools and calls as hermes text (tool_prompt.py)
            req.messages = rewrite(req.messages, req.tools if req.tool_choice != "none" else None)
        async with self._renders:
            try:
                ids = await asyncio.to_thread(chat.encode, req.messages, True,
                                              **req.template_kwargs)
                if prefix:
                    ids += chat.tokenizer.encode(prefix, False, True)
            except StrataError as e:
                raise bad_request(str(e), "messages", "invalid_template") from None
            except RecursionError:
                raise bad_request("messages: nested too deeply for the chat template",
                                  "messages") from None
        req.messages, req.prompt = None, ids

    async def _encode(self, req: ParsedRequest) -> None:
        """A completion's text prompt -> token ids here, in a worker thread, as the engine would
        (a long prompt holds neither the loop nor the engine's steps for the others)."""
        async with self._renders:
            req.prompt = await asyncio.to_thread(self.sup.chat.tokenizer.encode, req.prompt)

    async def _collect(self, job: Job, b: Builder, request: Request, fmt: str | None = None,
                       tools: list | None = None, prefix: str = "") -> Response:
        parts: list[str] = [prefix]
        while True:
            ev = await self._next(job, request)
            if ev is None:
                raise GONE
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Finished):
                parts.append(ev.text)
                log.info("%s: %s, %d + %d tokens", job.rid, ev.finish_reason, ev.prompt_tokens,
                         ev.completion_tokens)
                text, reasoning, calls = "".join(parts), "", ()
                if fmt is not None:
                    got = parse(fmt, text, tools)
                    text, reasoning, calls = got.content, got.reasoning, got.calls
                finish = "tool_calls" if calls and ev.finish_reason == "stop" else ev.finish_reason
                return JSONResponse(b.full(text, finish, ev.prompt_tokens, ev.completion_tokens,
                                           reasoning, calls, ev.cached_tokens),
                                    headers={"X-Request-Id": job.rid})
            else:
                raise as_error(ev)

    async def _stream(self, job: Job, b: Builder, fmt: str | None = None,
                      tools: list | None = None, prefix: str = "") -> AsyncIterator[bytes]:
        done = False
        parser = parser_for(fmt, tools) if fmt is not None else None
        calls = 0
        if parser is not None:
            parser.push(prefix)  # an open call: nothing comes out of it yet

        def chunks(text: str, last: bool = False) -> list[bytes]:
            nonlocal calls
            if parser is None:  # a Delta is a token: its chunk even without text (as vLLM's)
                return [b.chunk(text)] if text or not last else []
            out = []
            for kind, value in parser.push(text) + (parser.flush() if last else []):
                out += _event_chunks(b, kind, value, calls)
                calls += kind == "call"
            return out

        try:
            if b.kind == "chat":
                yield b.chunk(None, first=True)
            while True:
                ev = await self._next(job)
                if isinstance(ev, Delta):
                    for c in chunks(ev.text):
                        yield c
                    continue
                if isinstance(ev, Finished):
                    for c in chunks(ev.text, last=True):
                        yield c
                    finish = ev.finish_reason
                    yield b.chunk(None, finish="tool_calls" if calls and finish == "stop"
                                  else finish)
                    if b.include_usage:
                        yield b.usage_chunk(ev.prompt_tokens, ev.completion_tokens,
                                            ev.cached_tokens)
                    log.info("%s: %s, %d + %d tokens (streamed)", job.rid, ev.finish_reason,
                             ev.prompt_tokens, ev.completion_tokens)
                else:  # the headers are gone: the error travels as an event, then [DONE]
                    err = as_error(ev)
                    log.warning("%s: ended with an error mid-stream: %s", job.rid, err.message)
                    yield sse(err.body())
                done = True
                yield sse("[DONE]")
                return
        finally:
            if not done:  # the client went away (or the server is stopping)
                self._cancel(job)

    async def _next(self, job: Job, request: Request | None = None) -> object | None:
        """The job's next event within its deadline (--queue-timeout while it waits, watchdog +
        a grace while it runs); None when the client disconnected (checked twice a second)."""
        queued = job.state == "queued"
        limit = self.cfg.queue_timeout if queued else self.cfg.watchdog + _EVENT_GRACE_S
        deadline = time.monotonic() + limit
        while True:
            if request is not None and time.monotonic() - job.checked >= _DISCONNECT_CHECK_S:
                job.checked = time.monotonic()  # also while events flow: a long answer is
                if await request.is_disconnected():  # cancelled soon after its client leaves
                    self._cancel(job)
                    return None
            left = deadline - time.monotonic()
            ev = await job.next(min(_DISCONNECT_CHECK_S, left) if request is not None else left)
            if ev is not None:
                return ev
            if time.monotonic() >= deadline:
                self._cancel(job)
                where = "waiting in the queue" if queued else "waiting for the engine"
                return APIError(503, f"gave up after {limit:g} s {where}", code="timeout",
                                retry_after=5)

    def _cancel(self, job: Job) -> None:
        if self.sup.scheduler.cancel(job):  # a running job is counted when the engine drops it
            self.metrics.cancelled += 1

    # --- checks ----------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.cfg.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if not got:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    def _check_model(self, name: str, param: str) -> None:
        if name != self.cfg.served_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                           f"{self.cfg.served_name!r}", param, "model_not_found")

    async def _read_json(self, request: Request) -> Any:
        limit = self.cfg.max_body
        size = request.headers.get("content-length", "")
        too_big = APIError(413, f"the request body is larger than --max-body ({limit} bytes)",
                           code="request_too_large")
        if size.isdigit() and int(size) > limit:
            # read (and drop) a body of moderate size first, so that a client still sending it
            # gets the 413 instead of a broken pipe; a far larger one is refused at once
            if int(size) <= _DRAIN_MAX * limit:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_drain(request), _BODY_TIMEOUT_S)
            raise too_big
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise too_big

        try:
            await asyncio.wait_for(read(), _BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {_BODY_TIMEOUT_S:g} s",
                           code="request_timeout") from None
        except ClientDisconnect:  # (gone before its body was whole: no one to answer)
            raise GONE from None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            if "integer string conversion" in str(e):  # (Python's cap on an int's digits)
                raise bad_request(f"the request body holds an integer of more than "
                                  f"{sys.get_int_max_str_digits()} digits") from None
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad_request(f"the request body nests objects and arrays more than "
                              f"{MAX_DEPTH} deep") from None
        check_json(data)
        return data

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.served_name, "object": "model", "created": self.created,
                "owned_by": "strata"}


@functools.cache
def _chat_page() -> str:
    return (importlib.resources.files("strata.server") / "static" / "chat.html").read_text("utf-8")


def _event_chunks(b: Builder, kind: str, value: Any, index: int) -> list[bytes]:
    """A parser's event as stream chunks; a call as OpenAI sends one: its id and name with empty
    arguments, then the arguments."""
    if kind == "content":
        return [b.chunk(value)]
    if kind == "reasoning":
        return [b.delta({"reasoning_content": value})]
    head = {"index": index, "id": value.id, "type": "function",
            "function": {"name": value.name, "arguments": ""}}
    return [b.delta({"tool_calls": [head]}),
            b.delta({"tool_calls": [{"index": index, "function": {"arguments": value.arguments}}]})]


def _piece(tok: Any, token: int) -> str | list[int]:
    """A token's text as the model writes it alone, or its bytes where they are not UTF-8."""
    data, _ = tok.token_bytes(token, False, False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def create_app(cfg: ServeConfig, fault: FaultPlan | None = None) -> Starlette:
    api = API(cfg, fault)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await api.sup.start()
        try:
            yield
        finally:
            await api.sup.close()

    routes = [
        Route("/", api.page, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.api = api
    return app
