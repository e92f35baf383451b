"""Per-layer counters of the offload runtime, and the routing frequency they imply."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class GpuTimer:
    """Spans of the GPU timeline from CUDA events recorded around each forward pass or decode
    step, and around each layer's experts in plain forward passes (not inside CUDA graphs): the
    GPU's time including any wait for the host. Read (one sync) when printed."""

    def __init__(self, n_layers: int) -> None:
        self.steps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.layers: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [
            [] for _ in range(n_layers)]

    @staticmethod
    def start() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start: torch.cuda.Event, layer: int | None = None) -> None:
        (self.steps if layer is None else self.layers[layer]).append((start, self.start()))

    @staticmethod
    def seconds(spans: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
        if spans:
            spans[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in spans) / 1e3


@dataclass
class OffloadStats:
    n_layers: int
    n_experts: int
    hits: np.ndarray = field(init=False)  # [L] (token, expert) pairs served from cache slots
    cpu: np.ndarray = field(init=False)  # [L] pairs computed by the CPU pool
    streamed: np.ndarray = field(init=False)  # [L] pairs computed from copied experts
    bytes_h2d: int = 0  # expert bytes copied to the device (misses + cache admissions)
    admissions: int = 0
    cpu_s: float = 0.0  # host time in the CPU pool
    steps: int = 0
    timer: GpuTimer | None = None  # set by --stats on CUDA
    # called before the counters are read: work counted on the device, not yet added here
    settlers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        L, E = self.n_layers, self.n_experts
        self.hits, self.cpu, self.streamed = (np.zeros(L, np.int64) for _ in range(3))
        # --prefetch: experts copied ahead of a decode layer's routing that it then used / not
        self.ahead_used, self.ahead_unused = np.zeros(L, np.int64), np.zeros(L, np.int64)
        self._routed = np.zeros((L, E), np.int64)
        self._routed_dev: torch.Tensor | None = None  # counted without a host sync

    def reset(self) -> None:
        """Every counter back to zero (after a warm-up pass, say); the timer stays. The device
        counters are zeroed where they are: captured CUDA graphs (decode steps, prompt chunks)
        count into them."""
        self.settle()
        routed_dev = self._routed_dev
        self.__post_init__()
        if routed_dev is not None:
            with torch.inference_mode():  # (made in it)
                routed_dev.zero_()
            self._routed_dev = routed_dev
        self.bytes_h2d = self.admissions = self.steps = 0
        self.cpu_s = 0.0

    def count(self, layer: int, experts: list[int], counts: list[int]) -> None:
        self._routed[layer, experts] += counts

    def routed_on_device(self, device: torch.device) -> torch.Tensor:
        """[L, E] int32 counters on the device (pairs counted there, not yet on the host;
        decode_ops.route_topk adds to a row)."""
        if self._routed_dev is None:
            self._routed_dev = torch.zeros(self._routed.shape, dtype=torch.int32, device=device)
        return self._routed_dev

    def count_on_device(self, layer: int, ids: torch.Tensor,
                        live: torch.Tensor | None = None) -> None:
        """Count the pairs of ids [T, K] on the device; live: int32 [T] 1 for the rows to count,
        0 for the others (a padded chunk's, strata.engine.chunk_graph)."""
        self.routed_on_device(ids.device)
        flat = ids.flatten().long()  # scatter_add_, not bincount: bincount syncs to size its output
        ones = (torch.ones_like(flat, dtype=torch.int32) if live is None
                else live.to(torch.int32)[:, None].expand(ids.shape).reshape(-1))
        self._routed_dev[layer].scatter_add_(0, flat, ones)

    def settle(self) -> None:
        for fn in self.settlers:
            fn()

    @property
    def routed(self) -> np.ndarray:
        """[L, E] pairs routed to each expert (syncs with the device when it counted there)."""
        self.settle()
        if self._routed_dev is not None:
            return self._routed + self._routed_dev.cpu().numpy()
        return self._routed

    @property
    def hit_rate(self) -> float:
        self.settle()
        total = self.hits.sum() + self.cpu.sum() + self.streamed.sum()
        return float(self.hits.sum() / total) if total else 0.0

    def summary(self) -> dict[str, float]:
        self.settle()
        return {"hit_rate": round(self.hit_rate, 4), "pairs_hit": int(self.hits.sum()),
                "pairs_cpu": int(self.cpu.sum()), "pairs_streamed": int(self.streamed.sum()),
                "bytes_h2d": self.bytes_h2d, "admissions": self.admissions,
                "cpu_pool_s": round(self.cpu_s, 4), "ahead_used": int(self.ahead_used.sum()),
                "ahead_unused": int(self.ahead_unused.sum())}

    def lines(self) -> list[str]:
        s = self.summary()
        out = [f"experts: hit rate {100 * s['hit_rate']:.1f}%; pairs: {s['pairs_hit']} hit, "
               f"{s['pairs_cpu']} on the CPU, {s['pairs_streamed']} streamed; "
               f"{self.bytes_h2d / 2**20:.1f} MiB copied to the device ({self.admissions} cache "
               f"admissions); CPU pool {self.cpu_s:.3f} s"
               + (f"; GPU timeline {GpuTimer.seconds(self.timer.steps):.3f} s over "
                  f"{len(self.timer.steps)} passes (CUDA events at each pass's start and end, "
                  "host waits included)" if self.timer else "")]
        if s["ahead_used"] + s["ahead_unused"]:
            out.append(f"prefetch: {s['ahead_used']} of {s['ahead_used'] + s['ahead_unused']} "
                       "experts copied ahead of their layer's routing were routed to (the "
                       "others' bytes are in the MiB copied)")
        for i in range(self.n_layers):
            tot = self.hits[i] + self.cpu[i] + self.streamed[i]
            r = self.routed[i]
            bal = f"{r.max() / r.mean():.2f}" if r.sum() else "-"
            gpu = ""
            if self.timer is not None and self.timer.layers[i]:
                gpu = (f"  experts {1e3 * GpuTimer.seconds(self.timer.layers[i]):.1f} ms on the "
                       "GPU timeline")
            ahead = self.ahead_used[i] + self.ahead_unused[i]
            pre = f"  ahead {self.ahead_used[i]}/{ahead} used" if ahead else ""
            out.append(f"  layer {i:>3}: hit {100 * self.hits[i] / max(tot, 1):5.1f}%  cpu "
                       f"{self.cpu[i]:>6}  streamed {self.streamed[i]:>6}{pre}  busiest "
                       f"expert / mean {bal}{gpu}")
        return out
