"""Serving translations over HTTP: ``s2s serve -m MODEL``.

The model is loaded once and owned by one worker thread; the HTTP handlers
only read, check and queue.  The worker takes the oldest queued request,
waits out a short batching window from its arrival for company, then gathers
every queued request with the same decode settings, up to
``decode.batch_tokens`` source tokens, runs one ``Translator.translate_chunk``
over all their texts and hands each request its share.  With ``--precision auto`` (or
``bf16``, ``--quantize int8``) on a CPU the torch-free search takes, a request without
alignments or a glossary is searched there instead (s2s.native_search), as ``s2s translate``
searches plain lines.  Requests that arrive
together are thus translated together, sorted by length into token-bounded
batches as ``s2s translate`` does with a file; a request that waited while the
worker was busy waits no longer.

    POST /translate  {"texts": ["Hello", ...], "beam": 5, "nbest": 2, "alignments": true, "scores": true,
                      "glossary": {"source term": "target term", ...}}
                     -> {"translations": [{"text": ..., "score": ..., "alignment": [[j, t], ...],
                                           "nbest": [{"text": ..., "score": ..., "alignment": ...}, ...]}]}
    GET  /health     {"status": "ok", "requests": ..., "texts": ..., "batches": ...,
                      "queued_texts": ..., "in_flight": ...}
    GET  /info       the model's description (``s2s info``), its model.json, decode defaults, limits, counters

Every failure is a one-line JSON body ``{"error": "..."}``: 400 a body that is
not JSON, 413 a request over a size limit (refused, never queued), 422 a key
that is unknown or of the wrong type or value, or an empty list, 503 a full
queue or a server shutting down, 404/405 a wrong path or method.
``build_app`` turns a Translator into a FastAPI app (for embedding);
``serve`` loads a model directory and runs it under uvicorn until SIGTERM or
Ctrl-C, which stop accepting connections, finish the requests in flight, and
exit (143 after SIGTERM, 130 after Ctrl-C).
"""

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from dataclasses import replace as replace_field
from pathlib import Path
from typing import Any, Optional, Sequence

from s2s import __version__
from s2s.config import DecodeConfig, replace
from s2s.config import decode_overrides as parse_decode_overrides
from s2s.errors import ConfigError, S2SError
from s2s.glossary import Glossary, check_entry
from s2s.langs import Languages, language_ids
from s2s.output import translation_json as output_json
from s2s.translate import Translation, Translator, check_beam_width
from s2s.workerserver import usable_cores

log = logging.getLogger("s2s")

REQUEST_KEYS = ("texts", "beam", "nbest", "alignments", "scores", "glossary", "tgt_lang")


class RequestError(S2SError):
    """A request refused with HTTP ``status`` and a one-line message naming the key at fault."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask and how much may wait; over a limit is refused, never queued."""

    max_texts: int = 1024  # texts in one request (413 beyond)
    max_chars: int = 200_000  # characters in one request, all texts together (413 beyond)
    max_beam: int = 16  # the largest beam a request may ask for (422 beyond)
    max_queued_texts: int = 16_384  # texts waiting for the worker (503 beyond)
    window_ms: float = 5.0  # the worker waits this long after a request's arrival for others to join it

    def __post_init__(self) -> None:
        for name, flag in (("max_texts", "--max-texts"), ("max_chars", "--max-chars"),
                           ("max_beam", "--max-beam"), ("max_queued_texts", "--max-queue")):
            if getattr(self, name) < 1:
                raise S2SError(f"{flag} ({name}): must be >= 1, got {getattr(self, name)}")
        if self.max_queued_texts < self.max_texts:
            raise S2SError(f"--max-queue ({self.max_queued_texts}) is smaller than --max-texts "
                           f"({self.max_texts}): a full-size request could never be queued")
        if not 0 <= self.window_ms <= 1000:
            raise S2SError(f"--window-ms (window_ms): must be in [0, 1000], got {self.window_ms}")

    @property
    def max_body_bytes(self) -> int:
        """A body that can hold max_chars characters: 12 bytes each at worst (a JSON
        escaped surrogate pair, \\ud83d\\ude42), plus 64 KiB for the rest."""
        return 12 * self.max_chars + 65_536


# --------------------------------------------------------------------------- #
# requests and responses
@dataclass(frozen=True)
class SearchRequest:
    """The per-request settings that change the search: requests batch together only when equal."""

    beam: int
    nbest: int
    alignments: bool
    glossary: tuple[tuple[str, str], ...] = ()  # (source term, target term): added to decode.glossary's
    tgt_lang: str = ""  # decode.tgt_lang (s2s.langs)


@dataclass(frozen=True)
class TranslateRequest:
    texts: list[str]
    search: SearchRequest
    scores: bool  # only shapes the response


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def parse_request(body: bytes, decode: DecodeConfig, limits: ServeLimits,
                  can_align: bool = True, languages: Optional[Languages] = None,
                  target_vocab: Optional[int] = None) -> TranslateRequest:
    """Check a POST /translate body; ``decode`` gives the defaults of beam, nbest and tgt_lang;
    ``languages``: the model's (s2s.langs), which tgt_lang is checked against; ``target_vocab``:
    its V, the widest beam it can search."""
    try:
        data = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError too
        raise RequestError(400, f"request body: not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError(400, "request body: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(422, f"request body: expected a JSON object with a key texts, got {_type_name(data)}")
    for key in data:
        if key not in REQUEST_KEYS:
            raise RequestError(422, f"{key}: unknown key (valid keys: {', '.join(REQUEST_KEYS)})")
    if "texts" not in data:
        raise RequestError(422, "texts: missing (a list of strings to translate)")
    texts = data["texts"]
    if not isinstance(texts, list):
        raise RequestError(422, f"texts: expected a list of strings, got {_type_name(texts)}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestError(422, f"texts[{i}]: expected a string, got {_type_name(text)}")
        check_unicode(text, f"texts[{i}]")
    if not texts:
        raise RequestError(422, "texts: empty list, nothing to translate")
    if len(texts) > limits.max_texts:
        raise RequestError(413, f"texts: {len(texts)} texts, over this server's limit of "
                                f"{limits.max_texts} per request")
    glossary = parse_glossary(data.get("glossary", {}), decode)
    chars = sum(len(t) for t in texts) + sum(len(a) + len(b) for a, b in glossary)
    if chars > limits.max_chars:
        raise RequestError(413, f"{'texts and glossary' if glossary else 'texts'}: {chars} characters, "
                                f"over this server's limit of "
                                f"{limits.max_chars} per request")
    for key in ("beam", "nbest"):
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise RequestError(422, f"{key}: expected an integer, got {_type_name(value)}")
    for key in ("alignments", "scores"):
        if not isinstance(data.get(key, False), bool):
            raise RequestError(422, f"{key}: expected true or false, got {_type_name(data[key])}")
    beam = decode.beam if data.get("beam") is None else data["beam"]
    # the server's n-best, within a narrower beam the request asks for (a sampling server's: samples)
    nbest = data["nbest"] if data.get("nbest") is not None else \
        decode.nbest if decode.sampling or beam < 1 else min(decode.nbest, beam)
    if beam > limits.max_beam:
        raise RequestError(422, f"beam: {beam} is over this server's limit of {limits.max_beam}")
    try:
        replace(decode, "", beam=beam, nbest=nbest)
        if target_vocab is not None:
            check_beam_width(beam, target_vocab)
    except ConfigError as e:
        raise RequestError(422, str(e).removeprefix("decode.")) from None
    alignments = data.get("alignments", False)
    if alignments and not can_align:
        raise RequestError(422, "alignments: this model has no cross-attention to align with")
    search = SearchRequest(beam, nbest, alignments, glossary, request_language(data, texts, decode,
                                                                             languages or Languages()))
    return TranslateRequest(texts, search, data.get("scores", False))


def check_unicode(text: str, key: str) -> None:
    """JSON's \\ud800 escapes give strings no UTF-8 can hold (lone surrogates): a 422 naming ``key``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(422, f"{key}: not valid Unicode (a lone surrogate, U+{ord(text[e.start]):04X}, "
                                f"at character {e.start + 1})") from None


def parse_glossary(value: Any, decode: DecodeConfig) -> tuple[tuple[str, str], ...]:
    """A request's ``glossary``: an object {source term: target term} (s2s.glossary's entries,
    whole-word source terms) -> its (source, target) pairs, stripped."""
    if not isinstance(value, dict):
        raise RequestError(422, f"glossary: expected an object {{source term: target term}}, got {_type_name(value)}")
    if value and decode.sampling:
        raise RequestError(422, "glossary: this server samples (decode.sampling); sampling cannot keep terms")
    pairs = []
    for source, target in value.items():
        if not isinstance(target, str):
            raise RequestError(422, f"glossary[{source!r}]: expected a string, got {_type_name(target)}")
        check_unicode(source, "glossary: a source term")
        check_unicode(target, f"glossary[{source!r}]")
        try:
            pairs.append(check_entry(source, target, f"glossary[{source!r}]"))
        except S2SError as e:
            raise RequestError(422, str(e)) from None
    return tuple(pairs)


def request_language(data: dict, texts: list[str], decode: DecodeConfig, languages: Languages) -> str:
    """The request's tgt_lang (default decode.tgt_lang), checked against the model's languages."""
    tgt_lang = data.get("tgt_lang")
    if tgt_lang is not None and not isinstance(tgt_lang, str):
        raise RequestError(422, f"tgt_lang: expected a string, got {_type_name(tgt_lang)}")
    tgt_lang = tgt_lang or decode.tgt_lang
    try:
        ids = language_ids(languages, lambda _token: 0, tgt_lang, "tgt_lang")
        for i, text in enumerate(texts):
            if text.strip():
                ids.check_line(text.strip(), f"texts[{i}]", "tgt_lang")
    except S2SError as e:
        raise RequestError(422, str(e)) from None
    return tgt_lang


def translation_json(t: Translation, request: TranslateRequest) -> dict:
    """A text's answer: `translate --format jsonl`'s object (s2s.output.translation_json), the score
    on request; "nbest", all hypotheses best first, when nbest > 1."""
    return output_json(t, request.search.nbest > 1, request.scores, request.search.alignments)


# --------------------------------------------------------------------------- #
# the batching queue
@dataclass
class _Job:
    texts: list[str]
    search: SearchRequest
    future: Future
    arrived: float  # time.monotonic() at submit
    n_tokens: Optional[int] = None  # source tokens, counted by the worker


@dataclass
class QueueStats:
    requests: int = 0  # answered (or failed)
    texts: int = 0
    batches: int = 0  # translate calls, each over one group of requests
    queued_texts: int = 0
    in_flight: int = 0  # submitted, not yet answered

    def as_dict(self) -> dict:
        return asdict(self)


class BatchingQueue:
    """Requests in, one model-owning worker thread, a Future per request.

    ``submit`` queues a request's texts and returns a Future of its
    Translations (in order); the worker groups queued requests with equal
    ``SearchRequest`` into one ``translate_chunk`` call of at most
    ``batch_tokens`` source tokens (a single larger request goes alone), after
    waiting up to ``window_s`` from the oldest one's arrival for others to join.
    ``close`` refuses new requests, finishes the queued ones and stops the worker.
    """

    def __init__(self, translator: Translator, window_s: float = 0.005, max_queued_texts: int = 16_384,
                 batch_tokens: Optional[int] = None, engine: Any = None):
        self.translator = translator
        self.engine = engine  # s2s.native_search.NativeSearch of the same model, or None
        if engine is not None:
            if engine.decode != translator.decode:  # (what it can take was judged by these settings)
                raise ValueError("BatchingQueue: the torch-free engine's decode settings are not the translator's")
            engine.fmt = replace_field(engine.fmt, scores=True)  # each hypothesis's log p: scores on request
        self.base_decode, self.base_alignments = translator.decode, translator.alignments
        self.window_s = window_s
        self.max_queued_texts = max_queued_texts
        self.batch_tokens = batch_tokens or translator.decode.batch_tokens
        self._pending: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._stats = QueueStats()
        self._thread = threading.Thread(target=self._run, name="s2s-translate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stats(self) -> QueueStats:
        with self._cond:
            return QueueStats(**asdict(self._stats))

    def submit(self, texts: Sequence[str], search: SearchRequest) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise RequestError(503, "the server is shutting down")
            if self._stats.queued_texts + len(texts) > self.max_queued_texts:
                raise RequestError(503, f"queue full ({self._stats.queued_texts} texts waiting, "
                                        f"limit {self.max_queued_texts}); retry later")
            self._pending.append(_Job(list(texts), search, future, time.monotonic()))
            self._stats.queued_texts += len(texts)
            self._stats.in_flight += 1
            self._cond.notify()
        return future

    def close(self) -> None:
        """Refuse new requests, translate the queued ones, stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    # -- the worker ------------------------------------------------------- #
    def _run(self) -> None:
        while True:
            try:
                group = self._next_group()
            except Exception as e:  # a bug, not a bad request: the queued requests hear of it, and the worker goes on
                log.exception("batching the queued requests failed")
                self._fail_pending(e)
                continue
            if group is None:
                return
            self._translate(group)

    def _fail_pending(self, e: Exception) -> None:
        with self._cond:
            failed, self._pending = list(self._pending), deque()
            self._stats.queued_texts -= sum(len(j.texts) for j in failed)
            self._stats.in_flight -= len(failed)
        for job in failed:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(e)

    def _tokens(self, job: _Job) -> int:
        if job.n_tokens is None:
            cap = self.translator.max_input
            job.n_tokens = sum(min(len(ids), cap) for ids in self.translator.tok.encode_src(job.texts))
        return job.n_tokens

    def _next_group(self) -> Optional[list[_Job]]:
        """Block until a request is queued; return it with its batch (None once closed and empty)."""
        with self._cond:
            while not self._pending:
                if self._closing:
                    return None
                self._cond.wait()
            head = self._pending[0]
            # 1. the batching window: wait for company until head.arrived + window, or a full batch
            while not self._closing:
                left = head.arrived + self.window_s - time.monotonic()
                if left <= 0 or sum(self._tokens(j) for j in self._pending
                                    if j.search == head.search) >= self.batch_tokens:
                    break
                self._cond.wait(left)
            # 2. the head and every queued request with its settings, up to batch_tokens
            group, tokens, kept = [], 0, deque()
            for job in self._pending:
                if job.search == head.search and (not group or tokens + self._tokens(job) <= self.batch_tokens):
                    group.append(job)
                    tokens += self._tokens(job)
                else:
                    kept.append(job)
            self._pending = kept
            self._stats.queued_texts -= sum(len(j.texts) for j in group)
            self._stats.batches += 1
        return group

    def _glossary(self, search: SearchRequest) -> Optional[Glossary]:
        """The request's glossary entries added to the server's decode.glossary (None: the server's alone)."""
        if not search.glossary:
            return None
        base = self.translator.glossary()
        return base.merged(dict(search.glossary), "request") if base else Glossary(dict(search.glossary), "request")

    def _search_without_torch(self, decode: DecodeConfig, texts: list[str]) -> list[Translation]:
        """``texts`` searched by the torch-free engine with a request's ``decode`` settings."""
        engine = self.engine
        base = engine.decode, engine.lang
        engine.decode, engine.lang = decode, language_ids(engine.tok.languages, engine.tok.token_id, decode.tgt_lang)
        try:
            return engine.translate_chunk(texts)
        finally:
            engine.decode, engine.lang = base

    def _search_with_torch(self, decode: DecodeConfig, search: SearchRequest, texts: list[str]) -> list[Translation]:
        """``texts`` searched by torch's Translator with a request's ``decode`` settings, alignments
        and glossary; its settings are the server's again before anyone hears of the result."""
        self.translator.decode, self.translator.alignments = decode, search.alignments
        try:
            return self.translator.translate_chunk(texts, glossary=self._glossary(search))
        finally:
            self.translator.decode, self.translator.alignments = self.base_decode, self.base_alignments

    def _translate(self, group: list[_Job]) -> None:
        live = [job for job in group if job.future.set_running_or_notify_cancel()]  # not abandoned
        try:
            if live:
                search = group[0].search
                decode = replace(self.base_decode, "decode.", beam=search.beam, nbest=search.nbest,
                                 tgt_lang=search.tgt_lang)
                texts = [t for job in live for t in job.texts]
                if self.engine is not None and not search.alignments and not search.glossary:
                    found = self._search_without_torch(decode, texts)
                else:
                    found = self._search_with_torch(decode, search, texts)
                start = 0
                for job in live:
                    job.future.set_result(found[start:start + len(job.texts)])
                    start += len(job.texts)
        except Exception as e:  # a bug, not a bad request: every request of the group hears of it
            log.exception("translating a batch of %d requests failed", len(live))
            for job in live:
                if not job.future.done():
                    job.future.set_exception(e)
        finally:
            with self._cond:
                self._stats.requests += len(group)
                self._stats.texts += sum(len(j.texts) for j in group)
                self._stats.in_flight -= len(group)


# --------------------------------------------------------------------------- #
# the HTTP app
def _require_server_libraries() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise S2SError(f"s2s serve needs FastAPI and uvicorn ({e.name} is not installed): "
                       "pip install 's2s[serve]'") from None


def model_info(directory: str | Path) -> dict:
    """A model directory's description: ``s2s info``'s rows, its model.json, its languages."""
    from s2s.modeldir import describe, language_record, load_spec, read_meta

    d = Path(directory)
    cfg, _ = load_spec(d)
    return {"model": str(d), "src_lang": cfg.data.src_lang, "tgt_lang": cfg.data.tgt_lang,
            "languages": language_record(cfg),
            "description": dict(describe(d)), "model_json": read_meta(d)}


BODY_STALL_S = 30.0  # a client that sends nothing of its body for this long is answered 408


async def _read_body(request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``limit`` bytes, and (408)
    when the client stops sending it: such a request would also hold a shutdown forever."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body: {int(declared)} bytes, over this server's limit of {limit}")
    chunks, size, stream = [], 0, request.stream()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), BODY_STALL_S)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise RequestError(408, f"request body: nothing received for {BODY_STALL_S:.0f} s") from None
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body: over this server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(translator: Translator, limits: ServeLimits = ServeLimits(), info: Optional[dict] = None,
              engine: Any = None):
    """A FastAPI app serving ``translator`` through a BatchingQueue, started and drained by
    the app's lifespan; ``info`` (e.g. :func:`model_info`) is what GET /info describes;
    ``engine`` (s2s.native_search.engine_for of the same model and settings) searches the
    requests it can take without torch."""
    _require_server_libraries()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    queue = BatchingQueue(translator, limits.window_ms / 1000, limits.max_queued_texts, engine=engine)
    can_align = translator.model.cfg.arch == "encoder_decoder"

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        queue.start()
        yield
        await asyncio.to_thread(queue.close)  # the queued requests are translated first
        s = queue.stats()
        log.info("stopped after %d requests (%d texts in %d batches)", s.requests, s.texts, s.batches)

    app = FastAPI(title="s2s", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.queue = queue

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": " ".join(str(message).split())}, status_code=status)

    @app.exception_handler(RequestError)
    async def refused(_request, e: RequestError):
        return error(e.status, str(e))

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):  # 404, 405
        return error(e.status_code, f"{_request.method} {_request.url.path}: {e.detail}")

    @app.exception_handler(Exception)
    async def internal(_request, e: Exception):
        return error(500, f"internal error ({type(e).__name__}); the server's log has the details")

    @app.post("/translate")
    async def translate(request: Request):
        body = await _read_body(request, limits.max_body_bytes)
        req = parse_request(body, queue.base_decode, limits, can_align, translator.tok.languages,
                            translator.target_vocab_size)
        found = await asyncio.wrap_future(queue.submit(req.texts, req.search))
        return {"translations": [translation_json(t, req) for t in found]}

    @app.get("/health")
    async def health():
        return {"status": "ok", **queue.stats().as_dict()}

    arithmetic = {"torch": translator.precision + (" with int8 matrices" if translator.int8 else ""),
                  "without_torch": None if engine is None else engine.model.products}

    @app.get("/info")
    async def describe():
        return {**(info or {}), "s2s_version": __version__, "decode": asdict(queue.base_decode),
                "arithmetic": arithmetic, "limits": asdict(limits), "stats": queue.stats().as_dict()}

    return app


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (port 0: a free one, read it from getsockname)."""
    if not 0 <= port <= 65535:
        raise S2SError(f"--port: {port} is not a port number (0 to 65535; 0: a free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as e:
        raise S2SError(f"--host {host}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise S2SError(f"{host}:{port}: cannot listen ({e.strerror or e})") from None
    return sock


def uvicorn_server(app):
    """A uvicorn server for ``app``: no access log, and on shutdown it waits for every
    request in flight (no graceful-shutdown timeout)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=None))


def _exit_143(_sig, _frame) -> None:
    raise SystemExit(143)


def decode_overrides(items: Sequence[str]) -> dict:
    """``s2s serve --set decode.KEY=VALUE`` items -> {KEY: VALUE} (see :func:`s2s.config.decode_overrides`)."""
    return parse_decode_overrides(list(items), "serve")


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8080,
          limits: ServeLimits = ServeLimits(), threads: int = 0, decode: Optional[dict] = None,
          precision: str = "fp32", quantize: Optional[str] = None) -> None:
    """Load ``model_dir`` once and serve it until SIGTERM (drain, exit 143) or Ctrl-C (drain, 130).
    ``threads``: torch's intra-op threads for the worker (0: torch's default, one per core);
    ``decode``: settings replacing the model's decode section (every request's defaults);
    ``precision``, ``quantize``: as ``s2s translate``'s, the torch-free search taking the requests
    it can where they give it products on this CPU (s2s.native_search)."""
    _require_server_libraries()
    import torch

    from s2s.native_search import engine_for
    from s2s.workers import TranslatorSpec

    translator = Translator.from_dirs([model_dir], decode=decode, threads=threads, precision=precision,
                                      quantize=quantize)
    if translator.decode.beam > limits.max_beam:  # every request without a beam would be refused
        raise S2SError(f"decode.beam: {translator.decode.beam} (every request's default) is over --max-beam "
                       f"{limits.max_beam}")
    engine = engine_for(TranslatorSpec((str(model_dir),), overrides=decode or {}, device="cpu", precision=precision,
                                       quantize=quantize, scores=True))
    if engine is not None:  # its threads search a batch's sorted batches at once, one core each
        threads_searching = threads or usable_cores()
        if threads_searching > 1:
            engine.pool = ThreadPoolExecutor(threads_searching, thread_name_prefix="s2s-search")
        log.info("requests without alignments or a glossary are searched without torch (%s products, %d threads)",
                 engine.model.products, threads_searching)
    app = build_app(translator, limits, model_info(model_dir), engine)
    sock = listen_socket(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
    log.info("serving %s on http://%s:%d (POST /translate, GET /health, GET /info; %d torch threads)",
             model_dir, shown, bound[1], torch.get_num_threads())
    # uvicorn takes over SIGTERM and SIGINT, drains, restores the handlers it found and re-raises the
    # signal: the CLI's (s2s: terminated by SIGTERM, exit 143), or else this one (exit 143, cleanly)
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_143)
    server, hung_up = uvicorn_server(app), []

    def drain_on_hangup(signum, frame) -> None:  # SIGHUP, which uvicorn leaves alone: as SIGTERM, then 129
        hung_up.append(signum)
        server.handle_exit(signum, frame)

    previous_hup = signal.getsignal(signal.SIGHUP)
    if previous_hup != signal.SIG_IGN:  # ignored at start (nohup): stays ignored
        signal.signal(signal.SIGHUP, drain_on_hangup)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGHUP, previous_hup)
        sock.close()
        if engine is not None and engine.pool is not None:
            engine.pool.shutdown(wait=False, cancel_futures=True)  # (what has not started is dropped)
    if hung_up:
        log.info("stopped by SIGHUP")
        raise SystemExit(128 + signal.SIGHUP)
