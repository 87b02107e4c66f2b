"""`s2s serve`: the HTTP API over real loopback sockets, its batching, its refusals, its shutdown."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from s2s.errors import S2SError  # noqa: E402
from s2s.output import confidence  # noqa: E402
from s2s.serve import ServeLimits, build_app, decode_overrides, listen_socket, uvicorn_server  # noqa: E402
from s2s.translate import Translator  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory) -> Path:
    from s2s.config import load_config
    from s2s.trainer import train

    cfg = load_config(prepared, ["train.max_steps=4", "train.validate_every=2"])
    return train(cfg, tmp_path_factory.mktemp("serve") / "run", show_progress=False)


@pytest.fixture(scope="module")
def dev_lines(corpus) -> list[str]:
    return (corpus / "dev.en").read_text(encoding="utf-8").splitlines()


@contextlib.contextmanager
def running(translator: Translator, limits: ServeLimits, engine=None):
    """The app on a free loopback port, served by uvicorn in a thread; yields (base URL, queue)."""
    app = build_app(translator, limits, {"model": "test"}, engine)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    try:
        yield url, app.state.queue
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def server(model_dir):
    """A server with a 50 ms batching window (so that requests sent together surely meet)
    and small limits; its own Translator (the worker changes its decode settings)."""
    limits = ServeLimits(max_texts=40, max_chars=3000, max_beam=4, max_queued_texts=400, window_ms=50)
    with running(Translator.from_dir(model_dir), limits) as (url, queue):
        yield url, queue


def http(url: str, body=None, method=None) -> tuple[int, str]:
    """(status, body text) of one request; ``body``: bytes as they are, anything else as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def translate(url: str, **request) -> list[dict]:
    status, text = http(url + "/translate", request)
    assert status == 200, text
    return json.loads(text)["translations"]


# --------------------------------------------------------------------------- #
def test_outputs_equal_the_translators(server, model_dir, dev_lines):
    url, _ = server
    lines = dev_lines[:12] + ["", "Clipboard management"]
    expected = Translator.from_dir(model_dir).translate(lines)
    assert [t["text"] for t in translate(url, texts=lines)] == expected
    assert set(translate(url, texts=lines[:1])[0]) == {"text"}  # scores, alignments, nbest on request only


def test_nbest_scores_and_alignments_equal_the_translators(server, model_dir, dev_lines):
    url, _ = server
    lines = dev_lines[:5] + [""]
    reference = Translator.from_dir(model_dir, beam=3, nbest=2)
    reference.alignments = True
    want = reference.translate_chunk(lines)
    got = translate(url, texts=lines, beam=3, nbest=2, scores=True, alignments=True)
    assert len(got) == len(lines)
    for t, g in zip(want[:5], got[:5]):
        hyps = [{"text": text, "score": round(confidence(h), 4), "alignment": [list(a) for a in h.alignment]}
                for text, h in zip(t.texts, t.hypotheses)]
        assert g == {**hyps[0], "nbest": hyps}
    assert got[5] == {"text": "", "score": 0.0, "alignment": [], "nbest": [{"text": "", "score": 0.0, "alignment": []}]}


def test_concurrent_requests_are_answered_correctly_and_batched(server, model_dir, dev_lines):
    url, queue = server
    greedy = Translator.from_dir(model_dir, beam=1)
    default = Translator.from_dir(model_dir)
    jobs = [([dev_lines[i]], 1 if i % 2 else None) for i in range(8)]  # two decode settings, interleaved
    jobs.append((dev_lines[8:11], None))
    want = [(greedy if beam else default).translate(lines) for lines, beam in jobs]
    before = queue.stats()
    got: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def client(k: int) -> None:
        lines, beam = jobs[k]
        start.wait()
        got[k] = [t["text"] for t in translate(url, texts=lines, **({"beam": beam} if beam else {}))]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    after = queue.stats()
    assert after.requests - before.requests == len(jobs)
    assert after.texts - before.texts == sum(len(lines) for lines, _ in jobs)
    assert 2 <= after.batches - before.batches < len(jobs)  # two settings never share a batch
    status, text = http(url + "/health")
    assert status == 200 and json.loads(text)["batches"] == after.batches


def test_a_request_glossary_puts_its_terms_in_the_outputs(server, model_dir):
    from s2s.glossary import Glossary

    url, _ = server
    lines = ["A simple file manager.", "Hello world", "The program shows the time.", ""]
    terms = {"file": "Datei", "Hello": "Hallo Welt"}
    got = translate(url, texts=lines, glossary=terms)
    want = Translator.from_dir(model_dir).translate_chunk(lines, glossary=Glossary(terms))
    assert [t["text"] for t in got] == [t.text for t in want]
    assert "Datei" in got[0]["text"] and "Hallo Welt" in got[1]["text"]
    assert [t["text"] for t in got[2:]] == Translator.from_dir(model_dir).translate(lines[2:])


def test_plain_requests_are_searched_without_torch_where_the_cpu_takes_it(model_dir, dev_lines):
    """s2s serve --precision auto: a request without alignments or a glossary is searched by the
    torch-free engine (as `s2s translate --precision auto` would search its lines: texts, n-best
    rows and scores alike), one with alignments by torch's Translator; the engine's settings are
    the server's again after each batch; its threads search as one thread would."""
    from s2s import native_search
    from s2s.output import OutputFormat
    from s2s.workers import TranslatorSpec

    def engine(**decode):
        return native_search.engine_for(TranslatorSpec((str(model_dir),), overrides=decode, device="cpu",
                                                       precision="auto", scores=True))

    served = engine()
    if served is None:
        pytest.skip("no torch-free search on this CPU")
    served.fmt = OutputFormat()  # no scores asked for by translate's options: the queue asks for log p itself
    served.pool = ThreadPoolExecutor(2)  # as s2s serve gives it: a batch's sorted batches searched at once
    calls = []
    search = served.translate_chunk
    served.translate_chunk = lambda *args, **kw: calls.append(len(args[0])) or search(*args, **kw)
    lines = dev_lines[:6] + [""]
    limits = ServeLimits(max_texts=40, max_chars=3000, max_beam=4, window_ms=5)
    with running(Translator.from_dirs([model_dir], precision="auto"), limits, served) as (url, queue):
        got = translate(url, texts=lines, beam=3, nbest=2, scores=True)
        want = engine(beam=3, nbest=2).translate_chunk(lines)
        assert len(got) == len(want) == len(lines)
        for t, g in zip(want, got):
            hyps = [{"text": text, "score": round(confidence(h), 4)} for text, h in zip(t.texts, t.hypotheses)]
            hyps = hyps or [{"text": "", "score": 0.0}]
            assert g == {**hyps[0], "nbest": hyps}
        greedy = translate(url, texts=lines, beam=1, scores=True)
        assert greedy == [{"text": t.text, "score": round(confidence(t.hypotheses[0]), 4) if t.hypotheses else 0.0}
                          for t in engine(beam=1).translate_chunk(lines)]
        assert calls == [len(lines), len(lines)]
        aligned = translate(url, texts=lines[:2], alignments=True)
        assert calls == [len(lines), len(lines)] and all("alignment" in g for g in aligned)
        assert served.decode == engine().decode and queue.translator.alignments is False
        arithmetic = json.loads(http(url + "/info")[1])["arithmetic"]  # (auto: the same products on both routes)
        assert arithmetic in ({"torch": "fp32 with int8 matrices", "without_torch": "int8"},
                              {"torch": "bf16", "without_torch": "bf16"})
        assert arithmetic["without_torch"] == ("int8" if served.model.int8 else "bf16")
    served.pool.shutdown()
    other = engine(alpha=0.37)
    with pytest.raises(ValueError, match="the torch-free engine's decode settings are not the translator's"):
        build_app(Translator.from_dirs([model_dir], precision="auto"), limits, engine=other)


def test_info_describes_the_model(server):
    url, _ = server
    status, text = http(url + "/info")
    info = json.loads(text)
    assert status == 200 and info["model"] == "test"
    assert info["decode"]["beam"] == 2 and info["limits"]["max_texts"] == 40
    assert info["arithmetic"] == {"torch": "fp32", "without_torch": None}
    assert set(info["stats"]) == {"requests", "texts", "batches", "queued_texts", "in_flight"}


BAD = [
    (b'{"texts": ["a"', 400, "request body: not valid JSON"),
    (b'{"texts": ["\xff"]}', 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    ([1, 2], 422, "expected a JSON object with a key texts, got a list"),
    ({}, 422, "texts: missing"),
    ({"texts": "hello"}, 422, "texts: expected a list of strings, got a string"),
    ({"texts": ["a", 3]}, 422, "texts[1]: expected a string, got an integer"),
    ({"texts": []}, 422, "texts: empty list"),
    ({"texts": ["a"], "colour": "red"}, 422, "colour: unknown key (valid keys: texts, beam"),
    ({"texts": ["a"], "tgt_lang": "de"}, 422, "tgt_lang: 'de': this model has no language tokens"),
    ({"texts": ["a"], "glossary": [["a", "b"]]}, 422, "glossary: expected an object {source term: target term}, "
                                                      "got a list"),
    ({"texts": ["a"], "glossary": {"a": 3}}, 422, "glossary['a']: expected a string, got an integer"),
    ({"texts": ["a"], "glossary": {" ": "b"}}, 422, "glossary[' ']: empty source term"),
    ({"texts": ["a"], "glossary": {"a": ""}}, 422, "glossary['a']: empty target term for 'a'"),
    ({"texts": ["x" * 2995], "glossary": {"word": "Wort1"}}, 413,
     "texts and glossary: 3004 characters, over this server's limit of 3000"),
    ({"texts": ["a"], "beam": "5"}, 422, "beam: expected an integer, got a string"),
    ({"texts": ["a"], "beam": True}, 422, "beam: expected an integer, got a boolean"),
    ({"texts": ["a"], "beam": 0}, 422, "beam: must be >= 1"),
    ({"texts": ["a"], "beam": 5}, 422, "beam: 5 is over this server's limit of 4"),
    ({"texts": ["a"], "beam": 2, "nbest": 3}, 422, "nbest: must be in [1, beam]"),
    ({"texts": ["a"], "scores": "yes"}, 422, "scores: expected true or false, got a string"),
    ({"texts": ["a"] * 41}, 413, "texts: 41 texts, over this server's limit of 40"),
    ({"texts": ["x" * 2000, "y" * 1001]}, 413, "texts: 3001 characters, over this server's limit of 3000"),
    (b" " * 200_000 + b'{"texts": ["a"]}', 413, "request body: 200016 bytes, over this server's limit"),
    ({"texts": ["ok", "a\ud800"]}, 422, "texts[1]: not valid Unicode (a lone surrogate, U+D800, at character 2)"),
    ({"texts": ["a"], "glossary": {"a": "\udc00"}}, 422, "glossary['a']: not valid Unicode (a lone surrogate"),
    (b"{\"texts\": " + b"[" * 40_000 + b"]" * 40_000 + b"}", 400, "request body: JSON nested too deeply"),
]


@pytest.mark.parametrize("body,status,needle", BAD, ids=[b[2].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_get_a_one_line_json_error(server, body, status, needle):
    url, queue = server
    before = queue.stats().requests
    got, text = http(url + "/translate", body)
    assert got == status, text
    assert "\n" not in text.strip() and "Traceback" not in text
    error = json.loads(text)
    assert list(error) == ["error"] and needle in error["error"], error
    assert queue.stats().requests == before  # refused, never queued


def test_a_beam_wider_than_the_target_vocabulary_is_refused(model_dir):
    """Under a --max-beam above V, as on either route's search: 422, not a failed batch."""
    from s2s.serve import RequestError, parse_request

    translator = Translator.from_dir(model_dir)
    V = translator.target_vocab_size
    limits = ServeLimits(max_beam=V + 10)
    assert parse_request(json.dumps({"texts": ["a"], "beam": V}).encode(), translator.decode, limits,
                         target_vocab=V).search.beam == V
    with pytest.raises(RequestError, match=f"beam: {V + 1} is more than the {V} tokens of the target vocabulary"):
        parse_request(json.dumps({"texts": ["a"], "beam": V + 1}).encode(), translator.decode, limits,
                      target_vocab=V)
    with running(translator, limits) as (url, _):  # the app passes V
        status, text = http(url + "/translate", {"texts": ["a"], "beam": V + 1})
        assert status == 422 and "is more than the" in json.loads(text)["error"], text


@pytest.mark.parametrize("path,method,status", [("/nope", "GET", 404), ("/translate", "GET", 405),
                                                ("/health", "POST", 405)])
def test_wrong_paths_and_methods_get_a_json_error(server, path, method, status):
    url, _ = server
    got, text = http(url + path, b"{}" if method == "POST" else None, method)
    assert got == status and json.loads(text) == {"error": json.loads(text)["error"]}
    assert path in json.loads(text)["error"]


def test_set_takes_decode_keys_only(model_dir):
    assert decode_overrides(["decode.beam=3", "decode.alpha=1.0"]) == {"beam": 3, "alpha": 1.0}
    with pytest.raises(S2SError, match=r"--set model.d_model=8: s2s serve takes decode\.\* keys only"):
        decode_overrides(["model.d_model=8"])
    with pytest.raises(S2SError, match="decode.beem"):
        Translator.from_dir(model_dir, **decode_overrides(["decode.beem=3"]))


class GatedTranslator(Translator):
    """Translates only once ``gate`` is set: holds the worker busy for as long as a test needs."""

    gate = threading.Event()

    def translate_chunk(self, *args, **kwargs):
        assert self.gate.wait(60)
        return super().translate_chunk(*args, **kwargs)


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_full_queue_answers_503_and_the_queued_requests_still_complete(model_dir, dev_lines):
    GatedTranslator.gate.clear()
    limits = ServeLimits(max_texts=2, max_queued_texts=3, window_ms=0)
    with running(GatedTranslator.from_dir(model_dir), limits) as (url, queue):
        answers: dict = {}

        def send(name: str, texts: list[str]) -> threading.Thread:
            t = threading.Thread(target=lambda: answers.__setitem__(name, http(url + "/translate", {"texts": texts})))
            t.start()
            return t

        first = send("first", dev_lines[:2])  # taken by the worker, which waits at the gate
        wait_for(lambda: queue.stats().batches == 1, "the worker to take the first request")
        second = send("second", dev_lines[2:4])  # queued: 2 of 3 texts
        wait_for(lambda: queue.stats().queued_texts == 2, "the second request to queue")
        status, text = http(url + "/translate", {"texts": dev_lines[4:6]})
        assert status == 503 and "queue full (2 texts waiting, limit 3)" in json.loads(text)["error"]
        GatedTranslator.gate.set()
        first.join(60)
        second.join(60)
        assert answers["first"][0] == answers["second"][0] == 200
        assert [t["text"] for t in json.loads(answers["second"][1])["translations"]] == \
            Translator.from_dir(model_dir).translate(dev_lines[2:4])


@pytest.mark.parametrize("precision,signum", [("fp32", signal.SIGTERM), ("auto", signal.SIGTERM),
                                              ("fp32", signal.SIGHUP)], ids=["fp32", "auto", "sighup"])
def test_sigterm_finishes_the_request_in_flight_then_exits(model_dir, dev_lines, precision, signum):
    """The real command in a subprocess: SIGTERM (or SIGHUP, which uvicorn leaves to s2s) while a
    long request is being translated (with --precision auto by the torch-free search where this
    CPU takes it, and said so before the address, by two threads)."""
    from s2s import native_search
    from s2s.workers import TranslatorSpec

    engine = native_search.engine_for(TranslatorSpec((str(model_dir),), overrides={"beam": 4}, device="cpu",
                                                     precision=precision))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "s2s", "serve", "-m", str(model_dir), "--port", "0",
                             "--threads", "2" if engine else "1", "--set", "decode.beam=4", "--precision", precision],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        said, match = [proc.stderr.readline()], None  # ... "s2s: serving DIR on http://127.0.0.1:PORT ..."
        while said[-1] and not (match := re.search(r"http://127\.0\.0\.1:(\d+)", said[-1])):
            said.append(proc.stderr.readline())
        assert match, said
        assert any("searched without torch (" in line and ", 2 threads)" in line for line in said) == bool(engine)
        url = f"http://127.0.0.1:{match.group(1)}"
        n = 800 if engine else 32  # in flight long enough to be seen (the torch-free search is ~20x faster)
        lines = (dev_lines * (n // len(dev_lines) + 1))[:n]
        answer: dict = {}

        def long_request() -> None:
            answer["response"] = http(url + "/translate", {"texts": lines})  # beam 4: the --set default
            answer["at"] = time.time()

        client = threading.Thread(target=long_request)
        client.start()
        wait_for(lambda: json.loads(http(url + "/health")[1])["in_flight"] == 1, "the request to arrive")
        proc.send_signal(signum)
        signalled = time.time()
        client.join(120)
        code = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status, text = answer["response"]
    assert status == 200, text
    assert answer["at"] > signalled  # the request was in flight when SIGTERM came, and was finished
    want = [t.text for t in engine.translate_chunk(lines)] if engine else \
        Translator.from_dirs([model_dir], decode={"beam": 4}, precision=precision).translate(lines)
    assert [t["text"] for t in json.loads(text)["translations"]] == want
    assert code == 128 + signum, err
    assert "Traceback" not in err and f"stopped after 1 requests ({n} texts in 1 batches)" in err, err
    assert err.strip().splitlines()[-1] == {signal.SIGTERM: "s2s: terminated by SIGTERM",
                                            signal.SIGHUP: "s2s: stopped by SIGHUP"}[signum], err
    with pytest.raises(urllib.error.URLError):  # no longer listening
        urllib.request.urlopen(url + "/health", timeout=5)


def test_a_client_that_stops_sending_its_body_is_answered_408(server, monkeypatch):
    """...rather than holding its connection, and a shutdown, forever."""
    import s2s.serve

    monkeypatch.setattr(s2s.serve, "BODY_STALL_S", 0.5)
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"texts":')
        answer = s.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408") and "nothing received for 0 s" in answer, answer


def test_a_failure_while_batching_fails_the_queued_requests_and_the_worker_goes_on(model_dir, monkeypatch):
    from s2s.serve import BatchingQueue, SearchRequest

    translator = Translator.from_dir(model_dir)
    queue = BatchingQueue(translator, window_s=0.001)
    real = translator.tok.encode_src
    monkeypatch.setattr(translator.tok, "encode_src",
                        lambda texts: (_ for _ in ()).throw(RuntimeError("bug")) if "boom" in texts else real(texts))
    queue.start()
    try:
        search = SearchRequest(1, 1, False, (), "")
        with pytest.raises(RuntimeError, match="bug"):
            queue.submit(["boom"], search).result(60)
        assert len(queue.submit(["hello"], search).result(60)) == 1
        assert queue.stats().in_flight == 0 and queue.stats().queued_texts == 0
    finally:
        queue.close()


def test_a_request_without_nbest_gets_the_servers_within_its_beam():
    from s2s.config import DecodeConfig
    from s2s.serve import parse_request

    searching, sampling = DecodeConfig(beam=4, nbest=3), DecodeConfig(beam=1, nbest=4, sampling=True)
    assert parse_request(b'{"texts": ["a"], "beam": 2}', searching, ServeLimits()).search.nbest == 2
    assert parse_request(b'{"texts": ["a"]}', searching, ServeLimits()).search.nbest == 3
    assert parse_request(b'{"texts": ["a"]}', sampling, ServeLimits()).search.nbest == 4  # samples


def test_port_and_default_beam_are_checked_at_start(model_dir):
    from s2s.serve import serve

    with pytest.raises(S2SError, match=r"--port: 70000 is not a port number"):
        listen_socket("127.0.0.1", 70000)
    with pytest.raises(S2SError, match=r"decode.beam: 8 \(every request's default\) is over --max-beam 4"):
        serve(model_dir, port=0, limits=ServeLimits(max_beam=4), decode={"beam": 8})


def test_a_port_in_use_is_one_error_naming_it():
    taken = listen_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(S2SError, match=rf"127\.0\.0\.1:{port}: cannot listen \(Address already in use\)"):
            listen_socket("127.0.0.1", port)
    finally:
        taken.close()
