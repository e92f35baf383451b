"""A serving benchmark in the manner of vLLM's: many clients stream completions from an
OpenAI-compatible server at once; time to first token, inter-token latency and aggregate tok/s.

    pool = prompt_pool(server, seed)          token ids the server's own /tokenize gives for
                                              seeded random words (any vocabulary)
    level = run_level(server, c, n, ...)      n requests, c at a time (closed loop: each client
                                              sends its next request when its last one ends), or
                                              arriving at a Poisson rate with at most c in flight

Each request is a streamed POST /v1/completions with a prompt of token ids, max_tokens output
tokens and ignore_eos (so every request decodes the same length), and stream_options'
include_usage for the server's own token counts. Only the standard library: it runs against
strata serve or llama-server from any machine, without torch.

A token chunk is a stream chunk with a choice that carries text or no finish_reason: strata
serve streams one for each token, text or not, as vLLM does (a control token, an unfinished
character and most of a synthetic vocabulary's ids, its unused [PAD] tokens, have none), so a
random model's text-less tokens are timed too. Output tokens are the server's usage count (the
token chunks where it gives none).

Legend: TTFT time to first token (request sent -> first token chunk), ITL inter-token latency
(the gaps between token chunks), TPOT time per output token after the first ((end - TTFT) /
(tokens - 1)), E2E the whole request.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from strata.errors import StrataError


@dataclass(frozen=True)
class Server:
    url: str  # http://host:port
    api_key: str | None = None
    model: str | None = None
    timeout: float = 600.0

    def _conn(self) -> http.client.HTTPConnection:
        u = urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise StrataError(f"--url {self.url!r}: give the server as http://HOST:PORT")
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        return cls(u.hostname, u.port, timeout=self.timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def post_json(self, path: str, body: dict) -> dict:
        conn = self._conn()
        try:
            conn.request("POST", path, json.dumps(body), self._headers())
            r = conn.getresponse()
            data = r.read()
        except OSError as e:
            raise StrataError(f"{self.url}{path}: {e} (is the server running?)") from None
        finally:
            conn.close()
        if r.status != 200:
            raise StrataError(f"{self.url}{path} answered {r.status}: {data[:200]!r}")
        return json.loads(data)


@dataclass
class Result:
    """One request: times in seconds from when it was sent."""

    ok: bool
    prompt_tokens: int = 0
    tokens: int = 0  # output tokens (the server's usage count, else token chunks)
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between token chunks
    error: str = ""


def prompt_pool(server: Server, seed: int, words: int = 2000) -> list[int]:
    """Distinct token ids of seeded random lowercase words, as the server tokenizes them."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    text = " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
                    for _ in range(words))
    ids = server.post_json("/tokenize", {"content": text, "add_special": False})["tokens"]
    pool = sorted({t if isinstance(t, int) else t["id"] for t in ids})
    if len(pool) < 16:
        raise StrataError(f"{server.url}/tokenize gave {len(pool)} distinct tokens for random "
                          "words: too few to make prompts from")
    return pool


def one_request(server: Server, prompt: list[int], max_tokens: int, temperature: float = 1.0,
                seed: int = 0) -> Result:
    """A streamed completion; the clock starts as the request is sent. Sampled by default, with
    its own seed."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": temperature,
            "seed": seed}
    if server.model:
        body["model"] = server.model
    conn = server._conn()
    t0 = time.perf_counter()
    res = Result(ok=False, prompt_tokens=len(prompt))
    last = None
    chunks = 0  # token chunks
    usage = None
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), server._headers())
        r = conn.getresponse()
        if r.status != 200:
            res.error = f"HTTP {r.status}: {r.read()[:200]!r}"
            return res
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter() - t0
            if chunk.get("error"):  # a failure after the headers: an event in the stream
                err = chunk["error"]
                message = err.get("message", err) if isinstance(err, dict) else err
                res.error = f"error mid-stream: {message}"[:240]
                return res
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") or c.get("finish_reason") is None
                   for c in chunk.get("choices", [])):
                if last is None:
                    res.ttft = now
                else:
                    res.gaps.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - t0
        res.tokens = chunks
        if usage:
            res.tokens = usage.get("completion_tokens", chunks)
            res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
        res.ok = last is not None
        if not res.ok:
            res.error = (f"the stream ended without a token chunk ({res.tokens} tokens by the "
                         "server's usage count)")
    except (OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


@dataclass
class Level:
    concurrency: int
    rate: float | None  # requests/s (Poisson arrivals), None: closed loop
    wall: float
    results: list[Result]

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        gaps = [g for r in ok for g in r.gaps]
        tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
        tokens = sum(r.tokens for r in ok)
        out = {"concurrency": self.concurrency, "rate": self.rate,
               "requests": len(self.results), "failed": len(self.results) - len(ok),
               "wall_s": self.wall, "output_tokens": tokens,
               "prompt_tokens": sum(r.prompt_tokens for r in ok),
               "output_tok_s": tokens / self.wall if self.wall else 0.0,
               "requests_s": len(ok) / self.wall if self.wall else 0.0}
        for name, xs in (("ttft", [r.ttft for r in ok]), ("itl", gaps), ("tpot", tpot),
                         ("e2e", [r.e2e for r in ok])):
            out[f"{name}_p50_ms"] = 1e3 * percentile(xs, 50)
            out[f"{name}_p99_ms"] = 1e3 * percentile(xs, 99)
        out["errors"] = sorted({r.error for r in self.results if not r.ok})[:3]
        return out


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0..100), linear between order statistics; 0.0 for no values."""
    if not xs:
        return 0.0
    v = sorted(xs)
    at = (len(v) - 1) * p / 100
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


def run_level(server: Server, concurrency: int, n_requests: int, prompt_len: int,
              output_len: int, pool: list[int], seed: int, rate: float | None = None,
              temperature: float = 1.0) -> Level:
    """n_requests requests, at most `concurrency` in flight; with `rate`, sent at Poisson
    arrival times (requests/s), else each client sends its next when its last ends. Request i
    samples with seed `seed` * 1000 + i (temperature 0: greedy)."""
    rng = random.Random(seed)
    prompts = [[rng.choice(pool) for _ in range(prompt_len)] for _ in range(n_requests)]
    starts = [0.0] * n_requests
    if rate:
        t = 0.0
        for i in range(n_requests):
            starts[i] = t
            t += rng.expovariate(rate)
    results: list[Result | None] = [None] * n_requests
    next_i = iter(range(n_requests))
    lock = threading.Lock()
    t0 = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            wait = starts[i] - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            results[i] = one_request(server, prompts[i], output_len, temperature,
                                     seed * 1000 + i)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return Level(concurrency, rate, time.perf_counter() - t0, [r for r in results if r])
