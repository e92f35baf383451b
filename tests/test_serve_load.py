"""bench-serve times tokens, not text: a tiny model with a Qwen-sized synthetic vocabulary (151,936
ids, all but about 1,150 of them unused [PAD] tokens that decode to nothing) still gives every
request a chunk per token, and the stream parser reads what other servers send the same way."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from strata.bench.serve_load import Server, one_request, prompt_pool, run_level
from strata.server.testing import ServerProcess

QWEN_VOCAB = 151936


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model

    out = tmp_path_factory.mktemp("models") / "tiny-qwen-vocab.gguf"
    write_model(out, dataclasses.replace(get_preset("tiny", "qwen3moe"), n_vocab=QWEN_VOCAB),
                Recipe("Q4_K_M"), 0)
    return out


@pytest.mark.slow
def test_text_less_tokens_are_timed(big_vocab, tmp_path) -> None:
    with ServerProcess(big_vocab, ["--batch", "4", "--watchdog", "60"],
                       log_path=tmp_path / "server.log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        server = Server(s.url)
        pool = prompt_pool(server, 0)
        level = run_level(server, 4, 8, prompt_len=12, output_len=10, pool=pool, seed=0)
        # a random model samples [PAD] tokens nearly always: most of these requests give no
        # text, yet each token still arrives in a chunk of its own
        for r in level.results:
            assert r.ok, r.error
            assert r.tokens == 10 and len(r.gaps) == 9, (r.tokens, r.gaps)
            assert 0 < r.ttft <= r.e2e
        s = level.summary()
        assert s["failed"] == 0 and s["output_tokens"] == 80 and s["itl_p50_ms"] > 0


class _Fake(BaseHTTPRequestHandler):
    events: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for ev in self.events:
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


def _fake_stream(events: list[dict]):
    _Fake.events = events
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        return one_request(Server(f"http://127.0.0.1:{httpd.server_port}"), [1, 2, 3], 3)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _choice(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_stream_parser_counts_token_chunks() -> None:
    # no usage: the token chunks are the count; a last chunk of no text with its finish_reason
    # carries no token (strata's, llama-server's), one with text does (vLLM's)
    r = _fake_stream([_choice(""), _choice("a"), _choice(""), _choice("", "length")])
    assert r.ok and r.tokens == 3 and len(r.gaps) == 2
    r = _fake_stream([_choice(""), _choice("b", "length")])
    assert r.ok and r.tokens == 2 and len(r.gaps) == 1
    # the server's usage count wins over the chunks
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    r = _fake_stream([_choice("x"), _choice("", "length"), usage])
    assert r.ok and (r.tokens, r.prompt_tokens) == (5, 3)
    # an error event after text fails the request
    r = _fake_stream([_choice("a"), {"error": {"message": "engine lost"}}])
    assert not r.ok and "engine lost" in r.error
    # only a finishing chunk: nothing to time
    r = _fake_stream([_choice("", "length"), usage])
    assert not r.ok and "5 tokens by the server's usage count" in r.error
