"""Both links in one decode step: of each gathered layer's K routed pairs, the last `pairs` that
miss the cache are computed by the CPU pool from the arena while the GPU gathers the other
misses over PCIe (`--cpu-share N`, CUDA, one sequence decoding).

The step stays one CUDA graph. For each such layer the graph posts the token's routing, the slots
its experts have and its expert input to a mailbox in page-locked host memory
(strata.kernels.gpu.mailbox), gathers and computes the pairs it keeps (moe_forward's host_from),
then waits for the host's sum and adds it. A worker thread here takes the layers in order: it
polls the mailbox for the step's post, computes its pairs with the CPU pool and answers. Every
wait is bounded: the worker's by a deadline (StallError naming the layer), the graph's by a
number of polls, after which it writes the layer into the mailbox's error word, adds nothing, and
the step reports it (`check`).

Counting: the step's route_topk counts every pair; the worker records which experts it computed,
and OffloadExperts.after_gathered takes them off the pairs and bytes that crossed PCIe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import torch

from strata import env
from strata.experts.compute import Group
from strata.experts.cpu_pool import CpuPool
from strata.kernels.tuning import SHARE_THREADS
from strata.runtime.waits import DEFAULT_TIMEOUT_S, PROGRESS, StallError, wait_event

# which pool computes the strided layers: "graph" (a ggml graph a call) or "token" (ggml's dot
# kernels on strata.kernels.cpu.token_pool's spinning threads). Timed on the H200's host
# (bench/2026-11-30-h200-lend.md, run 46): the token pool 5-26% faster alone, 1.4-1.9x slower
# inside decode, where the share did not pay: the graph stays the default
POOL_ENV = env.CPU_SHARE_POOL_ENV

log = logging.getLogger("strata")


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, register: bool) -> torch.Tensor:
    """Zeros in host memory, page-locked and mapped for the device when `register`."""
    t = torch.zeros(shape, dtype=dtype)
    if register:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the decode mailbox failed (error {int(err)})")
    return t


class CpuShare:
    def __init__(self, ex, layers: list[int], pairs: int, topk: int, d_model: int,  # noqa: ANN001
                 device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
        """ex: the OffloadExperts; layers: the gathered layers that share their misses; pairs:
        how many of a token's K pairs (the last ones) the CPU takes when they miss."""
        if not 0 < pairs < topk:
            raise ValueError(f"--cpu-share {pairs}: give 1 .. {topk - 1} of the {topk} pairs")
        self.pool_kind = env.cpu_share_pool()
        self.ex, self.layers, self.pairs, self.topk = ex, list(layers), pairs, topk
        self.host_from = topk - pairs
        self.timeout_s = timeout_s
        n_layers = len(ex.arena.layouts)
        reg = device.type == "cuda"
        i32, f32 = torch.int32, torch.float32
        self.box = {"req": mapped_zeros((n_layers,), i32, reg),
                    "done": mapped_zeros((n_layers,), i32, reg),
                    "ids": mapped_zeros((n_layers, topk), i32, reg),
                    "slots": mapped_zeros((n_layers, topk), i32, reg),
                    "wts": mapped_zeros((n_layers, topk), f32, reg),
                    "h": mapped_zeros((n_layers, d_model), f32, reg),
                    "rows": mapped_zeros((n_layers, d_model), f32, reg),
                    "err": mapped_zeros((1,), i32, reg)}
        self._np = {k: v.numpy() for k, v in self.box.items()}
        self._registered = reg
        self.seq = torch.zeros(1, dtype=i32, device=device)  # the step number, on the device
        self.step = 0  # the same on the host: steps run (eager or replayed), not captures
        self.taken: dict[int, dict[int, list[int]]] = {}  # step -> layer -> experts computed
        # the worker's time, summed over layers: waiting for the GPU's post, from the post to the
        # answer, and of that in the CPU pool (strata bench prints them per layer)
        self.timing = {"layers": 0, "idle_s": 0.0, "answer_s": 0.0, "pool_s": 0.0}
        self._strided: dict[int, tuple] = {}  # set by the worker with its pool
        self._token = None  # and the token pool, where asked for (POOL_ENV)
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="strata-cpu-share", daemon=True)
        self._thread.start()

    # ---- the step's side (device work: capturable) ---------------------------------------------

    def tick(self) -> None:
        """At the start of the step's first piece: the step number on the device moves on."""
        self.seq.add_(1)

    def post(self, layer: int, ids: torch.Tensor, wts: torch.Tensor, h: torch.Tensor) -> None:
        from strata.kernels.gpu.mailbox import post

        post(self.box, self.seq, layer, ids, wts, h, self.ex.cache.layers[layer].table)

    def take(self, layer: int, out: torch.Tensor) -> None:
        """out [D] (a contiguous row of the layer's output on the device) += the CPU's sum."""
        from strata.kernels.gpu.mailbox import take

        take(self.box, self.seq, layer, out)

    # ---- the host's side ---------------------------------------------------------------------

    def begin(self) -> int:
        """Before the step runs (eagerly or replayed): the worker waits for its posts."""
        self.check()
        self.step += 1
        self._todo.put(self.step)
        return self.step

    def end(self, finished: torch.cuda.Event | None) -> None:
        """After the step is queued: wait (releasing the GIL) for the worker to answer every
        layer of it, then for the step's last kernel (`finished`), both bounded, and report a
        wait in the graph that ran out: the logits are then not returned."""
        try:
            got = self._done.get(timeout=self.timeout_s + 1)
        except queue.Empty:
            raise StallError(f"the CPU share of decode step {self.step} did not finish within "
                             f"{self.timeout_s:.0f} s ({PROGRESS.describe()})") from None
        if isinstance(got, BaseException):
            raise got
        if finished is not None:
            wait_event(finished, "the decode step with a CPU share", self.timeout_s)
        self.check()
        self.taken.pop(self.step - 2, None)  # kept for the step after's settle

    def check(self) -> None:
        """A wait in the graph that ran out (the mailbox's error word) becomes a StallError."""
        err = int(self._np["err"][0])
        if err:
            self._np["err"][0] = 0
            raise StallError(f"decode step: the GPU stopped waiting for the CPU's experts of "
                             f"layer {err - 1} ({PROGRESS.describe()})")

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)
        if self._registered:
            cudart = torch.cuda.cudart()
            for t in self.box.values():
                cudart.cudaHostUnregister(t.data_ptr())
            self._registered = False

    # ---- the worker --------------------------------------------------------------------------

    def _work(self) -> None:
        # its own pool (kernel library instance and threads): ggml's is one per calling thread
        broken: BaseException | None = None
        try:
            threads = (self.ex.options.cpu_share_threads
                       or min(self.ex.pool.threads, SHARE_THREADS))
            self.pool = CpuPool(self.ex.pool.kind, threads, self.ex.pool.workspace_bytes)
            self._strided = self._strided_layers()
            self._token = self._token_pool(threads)
        except Exception as e:  # noqa: BLE001 (every step then reports it)
            broken = RuntimeError(f"the CPU share's pool failed to start: {e}")
        while True:
            step = self._todo.get()
            if step is None:
                kernels = getattr(getattr(self, "pool", None), "kernels", None)
                if hasattr(kernels, "close"):
                    kernels.close()
                if self._token is not None:
                    self._token.close()
                return
            if broken is not None:
                self._done.put(broken)
                continue
            try:
                self.taken[step] = {}
                for layer in self.layers:
                    self._layer(step, layer)
                self._done.put(step)
            except BaseException as e:  # noqa: BLE001 (handed to the step's thread)
                self._done.put(e)

    def _strided_layers(self) -> dict[int, tuple]:
        """The layers whose experts ggml computes straight from the arena's records (each part
        one strided tensor over the layer's records): layer -> run_strided's fixed arguments."""
        kernels = self.pool.kernels
        if not hasattr(kernels, "run_strided"):
            return {}
        from strata.kernels.cpu.ggml_lib import supported

        out = {}
        arena = self.ex.arena
        for layer in self.layers:
            lay, recs = arena.layouts[layer], arena.layers[layer]  # uint8 [E, stride]
            # (run_strided computes plain SwiGLU: experts with biases go through the pool)
            if (not all(supported(q) for q in lay.qtypes) or not recs.is_contiguous()
                    or lay.bias is not None):
                continue
            parts = lay.views(recs[0])
            bases = tuple(p.data_ptr() for p in parts)
            out[layer] = (tuple(lay.qtypes), parts[0].shape[0], bases, recs.stride(0),
                          recs.shape[0])
        return out

    def _token_pool(self, threads: int):  # noqa: ANN202 - a TokenPool or None
        """The token pool where STRATA_CPU_SHARE_POOL=token asks for it and it runs here."""
        if self.pool_kind == "graph" or not self._strided:
            return None
        from strata.kernels.cpu.token_pool import TokenPool

        why = TokenPool.available()
        if why is None and not all(TokenPool.supports(v[0]) for v in self._strided.values()):
            why = "a layer's types have no single-row dot kernel in ggml"
        if why is not None:
            log.warning("%s=token: not used (%s); the CPU share runs ggml graphs", POOL_ENV, why)
            return None
        pool = TokenPool(threads)
        log.info("cpu share: token pool, %d threads (ggml's dot kernels)", pool.threads)
        return pool

    def _compute(self, layer: int, ids: np.ndarray, wts: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Σ_k wts[k] * expert(ids[k])(h) over the CPU's pairs: [D] f32."""
        fixed = self._strided.get(layer)
        if fixed is not None:
            qtypes, f, bases, stride, n = fixed
            kernels = self._token if self._token is not None else self.pool.kernels
            return kernels.run_strided(h, qtypes, f, bases, stride, n, ids, wts)
        groups = [Group(int(e), torch.zeros(1, dtype=torch.int64),
                        torch.tensor([w], dtype=torch.float32))
                  for e, w in zip(ids, wts, strict=True)]
        out = torch.zeros(1, h.shape[0])
        self.pool.run(layer, self.ex.arena, groups, torch.from_numpy(h)[None], out)
        return out[0].numpy()

    def _layer(self, step: int, layer: int) -> None:
        """Wait for the step's post of `layer`, compute the CPU's pairs, answer."""
        box = self._np
        stamp = np.int32(step)  # (int32 on the device: the same wrap)
        t_enter = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        polls = 0
        while box["req"][layer] != stamp:
            polls += 1
            if polls % 256 == 0:
                if time.monotonic() > deadline:
                    raise StallError(f"the CPU share waited {self.timeout_s:.0f} s for layer "
                                     f"{layer} of decode step {step} to be posted "
                                     f"({PROGRESS.describe()})")
                time.sleep(0)
        t_seen = time.perf_counter()
        ids, slots = box["ids"][layer].copy(), box["slots"][layer].copy()
        wts, h = box["wts"][layer].copy(), box["h"][layer].copy()
        mine = [k for k in range(self.host_from, self.topk) if slots[k] < 0]
        rows = box["rows"][layer]
        spent = 0.0
        if mine:
            t0 = time.perf_counter()
            rows[:] = self._compute(layer, ids[mine], wts[mine], h)
            spent = time.perf_counter() - t0
            self.ex.stats.cpu_s += spent
            nbytes = self.ex.arena.layouts[layer].nbytes
            self.ex.planner.observe_cpu(nbytes, len(mine), len(mine), spent)
            self.taken[step][layer] = [int(ids[k]) for k in mine]
        else:
            rows[:] = 0.0
        box["done"][layer] = stamp  # after the rows (x86 keeps stores in order)
        tm = self.timing
        tm["layers"] += 1
        tm["idle_s"] += t_seen - t_enter
        tm["answer_s"] += time.perf_counter() - t_seen
        tm["pool_s"] += spent
