"""llama.cpp's logits (llama-cpp-python) computed in a process of its own, started once per test
session and fed one request at a time.

In the tests' process llama.cpp's results depend on what loaded first: ggml-python (Strata's
CPU expert kernels) loads its own, older libggml with RTLD_GLOBAL, and a llama_cpp imported after
it binds ggml's symbols to that library. Then llama.cpp's logits go wrong (the older-layout
deepseek2 file of tests/test_arch_deepseek2.py: KL 4-8 after position 0, when llama_cpp was first
imported after an offload run on ggml's kernels); imported first, they are right. A spawned
worker has loaded nothing of the kind, whatever order the tests run in.

    llama_scores(path, [tokens, ...], n_ctx=64, ...) -> [logits [len(tokens), V] float32, ...]
        each token list evaluated from an empty context (reset between them), Llama(**kwargs)
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np

_CTX = mp.get_context("spawn")  # (a fresh interpreter: nothing of this process's libraries)
_worker: tuple[Any, Any] | None = None  # (process, connection)


def _serve(conn: Any) -> None:
    import llama_cpp

    while True:
        msg = conn.recv()
        if msg is None:
            return
        path, chunks, kwargs = msg
        try:
            model = llama_cpp.Llama(path, logits_all=True, verbose=False, **kwargs)
            out = []
            for tokens in chunks:
                model.reset()
                model.eval(tokens)
                out.append(np.array(model.scores[: len(tokens)], dtype=np.float32))
            model.close()
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 (said back to the test, which fails with it)
            conn.send(("error", f"{type(e).__name__}: {e}"))


def llama_scores(path: str | Path, chunks: list[list[int]], **kwargs: Any) -> list[np.ndarray]:
    global _worker
    if _worker is None or not _worker[0].is_alive():
        here, there = _CTX.Pipe()
        proc = _CTX.Process(target=_serve, args=(there,), daemon=True)
        proc.start()
        _worker = (proc, here)
    kwargs = {"n_ctx": 64, "n_threads": 2} | kwargs
    _worker[1].send((str(path), chunks, kwargs))
    status, out = _worker[1].recv()
    if status != "ok":
        raise RuntimeError(f"llama.cpp on {path}: {out}")
    return out
