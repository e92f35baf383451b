"""`strata serve`'s /tokenize and /detokenize (llama-server's shapes) through a real server."""

from __future__ import annotations

import httpx
import pytest

from strata.gguf import open_model
from strata.server.testing import ServerProcess
from strata.tokenizer import Tokenizer

KEY = "sk-strata-test"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(synth):
    return synth("qwen3moe", "Q4_K_M")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--api-key", KEY, "--report-dir", str(tmp_path_factory.mktemp("reports"))]
    with ServerProcess(model, args, log_path=log) as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        yield s


@pytest.fixture(scope="module")
def tok(model):
    mf = open_model(model)
    return Tokenizer.from_metadata(mf.metadata, source=str(mf.path))


def _post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


TEXT = "Hello world, <|im_start|>user\nnaïve 東京 🙂"


def test_tokenize_matches_the_tokenizer(server, tok):
    r = _post(server, "/tokenize", {"content": TEXT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == tok.encode(TEXT, add_bos=False, parse_special=True)
    assert tok.token_id("<|im_start|>") in ids  # special-token text parsed, as llama-server does
    special = _post(server, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"]
    assert special == tok.encode(TEXT, add_bos=True, parse_special=True)


def test_tokenize_with_pieces(server, tok):
    r = _post(server, "/tokenize", {"content": TEXT, "with_pieces": True})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert [t["id"] for t in tokens] == tok.encode(TEXT, add_bos=False)
    joined = b""
    for t in tokens:
        piece = t["piece"]
        assert isinstance(piece, str) or all(isinstance(b, int) and 0 <= b < 256 for b in piece)
        joined += piece.encode() if isinstance(piece, str) else bytes(piece)
    assert joined.decode() == TEXT


def test_detokenize_round_trip(server, tok):
    ids = _post(server, "/tokenize", {"content": TEXT}).json()["tokens"]
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"content": tok.decode(ids)}
    assert r.json()["content"] == TEXT
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"content": ""}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "with_pieces": 1}, "with_pieces"),
    ("/tokenize", ["content"], None),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.0]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
])
def test_validation_errors_are_openai_400s(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_json_and_key(server):
    r = httpx.post(server.url + "/tokenize", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert _post(server, "/tokenize", {"content": "x"}, key=None).status_code == 401
    assert _post(server, "/detokenize", {"tokens": [1]}, key="wrong").status_code == 401
    assert httpx.get(server.url + "/tokenize", timeout=60).status_code == 405
