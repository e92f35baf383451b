"""strata bench: prompt and decode speed of one engine configuration, with the hit rate, the bytes
moved, memory peaks, and the fraction of DESIGN.md's bandwidth bound reached. One run_bench call is
one test of llama-bench's matrix on a fresh KV cache: first depth random tokens (untimed: the
depth D that llama-bench's -d fills the cache with), then the timed part, prompt_len more random
tokens (ppN @ dD) or gen_len decode steps (tgN @ dD).
Decode feeds random tokens by default (llama-bench's tg: each step's input is the next token of a
seeded uniform draw over the vocabulary, not the one the model picked): a random model's greedy
output loops over a few tokens, which keeps the same experts hot and flatters the cache.

    decode time per token >= Σ_layers max((dense_l + hit expert bytes_l) / HBM,
                                          CPU-computed bytes_l / host RAM bandwidth,
                                          streamed bytes_l / PCIe bandwidth) + head / HBM
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from strata.engine.generator import Engine


@dataclass
class BenchResult:
    config: dict
    prompt_len: int  # the timed prompt's tokens: ppN's N (the older pp128 + tg64's 128)
    gen_len: int
    runs: int
    prompt_tok_s: float | None  # None without a prompt (tgN at depth 0)
    decode_tok_s: float
    decode_tok_s_all: list[float]
    hit_rate: float | None
    h2d_bytes_per_token: float | None
    cpu_pairs_per_token: float | None
    vram_peak_gib: float | None  # the larger of the two below (bytes in live tensors)
    host_peak_gib: float
    vram_peak_prompt_gib: float | None = None  # allocated by torch during the prompts
    vram_peak_decode_gib: float | None = None  # during the decode steps
    # what torch held from the driver at most (live tensors and its cache of freed blocks: what
    # nvidia-smi shows, less the CUDA context), and the device's used memory at the phases' ends
    # (every process on it, the context included)
    vram_reserved_peak_gib: float | None = None
    device_used_gib: float | None = None
    prompt_chunks: int = 1
    prompt_streamed_gib: float | None = None  # expert bytes streamed through the ring per prompt
    prompt_streamed_gib_all: list[float] | None = None  # each measured run's (the line above:
    # the faster run's)
    prompt_stream_gbs: float | None = None  # those bytes over the prompt's time
    bound_tok_s: float | None = None
    bound_fraction: float | None = None
    share_us: dict | None = None  # --cpu-share: the worker's µs per layer (decode steps measured)
    prefetch: int = 0  # experts a decode layer copies ahead (--prefetch as it ran; auto resolved)
    ahead_used: float = 0.0  # --prefetch: experts copied ahead that their layer used, per token
    ahead_copied: float = 0.0  # and all it copied ahead, per token (summed over layers)
    admissions_per_token: float | None = None  # experts the cache took in, per decode token
    decode_captures: int = 0  # CUDA graph captures during the measured runs' decode steps
    warmups: int = 1  # runs not counted: one, more while one changed a layer's prompt path
    ceilings: dict = field(default_factory=dict)
    test: str = ""  # llama-bench's name: pp512, tg64 @ d4096 (pp128 + tg64 @ d128: both timed)
    depth: int = 0  # KV cache tokens before the timed part: n_depth (before the first decode step
    # of a timed prompt then decode steps, the older pp128 + tg64 @ d128: n_depth + prompt_len)
    decode_input: str = "random"  # random tokens (llama-bench's tg) or greedy (the argmax fed back)
    kv_length_before_decode: int = 0  # the cache's length the timed steps started from (= depth)
    prompt_tok_s_all: list[float] = field(default_factory=list)  # each measured run's
    prompt_tok_s_std: float = 0.0  # sample standard deviation of those (llama-bench's ±)
    decode_tok_s_std: float = 0.0
    n_depth: int = 0  # untimed random tokens run into the cache first (llama-bench's -d)

    def lines(self) -> list[str]:
        parts = []
        if self.prompt_len and self.prompt_tok_s is not None:
            parts.append(f"prompt {self.prompt_len} tokens"
                         + (f" at depth {self.n_depth}" if self.n_depth else "")
                         + f": {self.prompt_tok_s:.1f} ± {self.prompt_tok_s_std:.1f} tok/s")
        if self.gen_len:
            parts.append(f"decode {self.gen_len} {self.decode_input} tokens at depth "
                         f"{self.depth}: {self.decode_tok_s:.2f} ± {self.decode_tok_s_std:.2f} "
                         "tok/s")
        out = [f"{self.test}: " + "; ".join(parts) + f" (median of {self.runs}"
               + (f", after {self.warmups} warm-up runs)" if self.warmups > 1 else ")")]
        if self.prompt_streamed_gib:
            out.append(f"prompt: {self.prompt_chunks} chunks streamed "
                       f"{self.prompt_streamed_gib:.2f} GiB of experts, "
                       f"{self.prompt_streamed_gib / self.prompt_chunks:.2f} GiB per chunk, at "
                       f"{self.prompt_stream_gbs:.1f} GB/s over the prompt's time")
        if self.hit_rate is not None:
            out.append(f"expert hit rate {100 * self.hit_rate:.1f}%; "
                       f"{self.h2d_bytes_per_token / 2**20:.1f} MiB copied to the device and "
                       f"{self.cpu_pairs_per_token:.1f} experts computed on the CPU per token"
                       + (f"; {self.admissions_per_token:.1f} admitted into the cache"
                          if self.admissions_per_token is not None else ""))
        if self.ahead_copied:
            out.append(f"prefetch: {self.ahead_used:.1f} of {self.ahead_copied:.1f} experts "
                       "copied ahead per token were routed to")
        if self.share_us:
            u = self.share_us
            out.append(f"cpu share, per layer: {u['idle']:.0f} us waiting for the GPU's post, "
                       f"{u['answer']:.0f} us from the post to the answer ({u['pool']:.0f} us "
                       f"in the CPU pool)")
        if self.decode_captures:
            out.append(f"decode step: CUDA graphs captured {self.decode_captures} time(s) in "
                       "the measured runs")
        if self.bound_tok_s:
            out.append(f"bandwidth bound {self.bound_tok_s:.1f} tok/s: reached "
                       f"{100 * self.bound_fraction:.1f}%")
        mem = f"host RAM peak {self.host_peak_gib:.2f} GiB"
        if self.vram_peak_gib is not None:
            mem = (f"VRAM peak {self.vram_peak_gib:.2f} GiB in tensors (prompt "
                   f"{self.vram_peak_prompt_gib:.2f}, decode {self.vram_peak_decode_gib:.2f}), "
                   f"{self.vram_reserved_peak_gib:.2f} GiB held by torch's allocator; device "
                   f"memory used {self.device_used_gib:.2f} GiB; " + mem)
        out.append(mem)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


MAX_WARMUPS = 3  # warm-up runs at most, while a warm-up changes a layer's prompt path


def _prompt_paths(experts) -> tuple[bool, ...] | None:  # noqa: ANN001 - any kind of experts
    """Per layer, whether a large prompt chunk may stream every uncached expert
    (OffloadExperts' routed_fraction against ROUTED_MIN; a layer not yet seen may), or None
    for experts without that choice."""
    fractions = getattr(experts, "routed_fraction", None)
    if fractions is None:
        return None
    from strata.experts.offload import ROUTED_MIN

    return tuple(fractions.get(layer, 1.0) >= ROUTED_MIN
                 for layer in range(len(experts.arena.layouts)))


DECODE_INPUTS = ("random", "greedy")


def cell_name(prompt_len: int, gen_len: int, timed_prompt: bool) -> str:
    """llama-bench's test names: pp512, tg64, tg64 @ d4096; a timed prompt then decode steps on
    it (the older --prompt-len P --gen-len N): pp128 + tg64 @ d128."""
    tg = f"tg{gen_len}" + (f" @ d{prompt_len}" if prompt_len else "")
    if not gen_len:
        return f"pp{prompt_len}"
    return f"pp{prompt_len} + {tg}" if timed_prompt and prompt_len else tg


def llama_name(n_prompt: int, n_gen: int, n_depth: int) -> str:
    """llama-bench's name of a test from its JSON fields: pp512, tg64, pp512+tg64, then
    " @ d16384" for a test at depth."""
    name = "+".join(([f"pp{n_prompt}"] if n_prompt else []) + ([f"tg{n_gen}"] if n_gen else []))
    return name + (f" @ d{n_depth}" if n_depth else "")


def spread(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def run_bench(engine: Engine, prompt_len: int, gen_len: int, runs: int, seed: int = 0,
              ceilings: dict | None = None, decode_input: str = "random",
              test: str | None = None, depth: int = 0) -> BenchResult:
    """On a fresh KV cache each run: depth random tokens (seeded, the same each run; untimed, as
    llama-bench's -d), then prompt_len random tokens (seeded, the same each run; timed), then
    gen_len decode steps (timed) whose inputs are random tokens (a new seeded draw each run)
    or, with decode_input="greedy", each step's argmax; runs measured runs after the warm-up."""
    if decode_input not in DECODE_INPUTS:
        raise ValueError(f"decode_input {decode_input!r}: one of {DECODE_INPUTS}")
    model, cfg = engine.model, engine.config
    rng = np.random.default_rng(seed)
    prompt = torch.from_numpy(rng.integers(0, cfg.n_vocab, prompt_len)).long()
    # the depth's tokens, a draw apart from the prompt's (pp16 draws the same at any depth)
    prefix = np.random.default_rng([seed, 2]).integers(0, cfg.n_vocab, depth).tolist()
    inputs = np.random.default_rng([seed, 1])  # decode inputs, apart from the prompt's draw
    kv_before = 0
    experts = getattr(model.experts, "stats", None)
    dev = model.device
    peaks = [0, 0]  # bytes allocated at most during the prompts, during the decode steps
    held = [0, 0]  # the allocator's reserved bytes at most; the device's used bytes at most

    def peak(phase: int) -> None:
        if dev.type == "cuda":
            peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated(dev))
            free, total = torch.cuda.mem_get_info(dev)
            held[:] = max(held[0], torch.cuda.max_memory_reserved(dev)), max(held[1], total - free)
            torch.cuda.reset_peak_memory_stats(dev)

    if dev.type == "cuda":  # (what loading left allocated is in both phases' peaks)
        torch.cuda.reset_peak_memory_stats(dev)
    p_times, d_rates, p_streamed = [], [], []
    decode = ExpertCounters(cfg.n_layers)  # expert counters over the measured decode steps only
    step = getattr(model, "step", None)
    share = getattr(step, "share", None)
    captures = 0
    share_sum = dict.fromkeys(("layers", "idle_s", "answer_s", "pool_s"), 0.0)
    warmups, r = 0, 0
    while r < runs + 1:  # run 0 warms up and is not counted
        kv = model.new_cache(max(depth + prompt_len + gen_len, 1))
        paths = _prompt_paths(model.experts)
        logits = engine.run_prompt(prefix, kv) if depth else None  # untimed
        if depth and experts is not None:
            experts.settle()  # (the depth's device-routed counts, before the timed part)
        ring = getattr(model.experts, "ring", None)
        streamed0 = ring.streamed_bytes if ring is not None else 0
        draw = inputs.integers(0, cfg.n_vocab, max(gen_len, 1)).tolist()  # [gen_len]
        _sync(engine)
        t0 = time.perf_counter()
        if prompt_len:
            logits = engine.run_prompt(prompt.tolist(), kv)
        _sync(engine)
        t1 = time.perf_counter()
        kv_before = kv.length
        peak(0)
        streamed = (ring.streamed_bytes if ring is not None else 0) - streamed0
        # read after every prompt, the warm-up's too: reading settles the device-routed
        # counts, which pick each layer's prompt path for the next pass (routed_fraction); a
        # warm-up that changed a path is run again (the new path compiles on its first use),
        # so the measured passes run as every later pass will
        before = ExpertCounters.of(experts) if experts is not None else None
        again = r == 0 and warmups + 1 < MAX_WARMUPS and _prompt_paths(model.experts) != paths
        share_before = dict(share.timing) if share is not None else None
        captured0 = step.steps["captured"] if step is not None else 0
        if decode_input == "random":
            for token in draw[:gen_len]:
                model.decode(token, kv)
                _sync(engine)  # as llama-bench synchronizes after each step
        else:
            token = int(logits[0].argmax()) if logits is not None else draw[0]
            for _ in range(gen_len):
                logits = model.decode(token, kv)
                token = int(logits[0].argmax())  # the host needs the token: a real sync per step
        t2 = time.perf_counter()
        peak(1)
        if r and before is not None:
            decode.add(ExpertCounters.of(experts), before)
        if r and step is not None:
            captures += step.steps["captured"] - captured0
        if r and share_before is not None:
            for k in share_sum:
                share_sum[k] += share.timing[k] - share_before[k]
        del kv  # its storage goes back to the pool: the next run's cache reuses it
        if r:
            p_times.append(t1 - t0)
            p_streamed.append(streamed)
            d_rates.append(gen_len / (t2 - t1))
        else:
            warmups += 1
        r += 0 if again else 1
    p_rates = [prompt_len / t for t in p_times] if prompt_len else []
    res = BenchResult(
        config={}, prompt_len=prompt_len, gen_len=gen_len, runs=runs,
        prompt_tok_s=statistics.median(p_rates) if p_rates else None,
        decode_tok_s=statistics.median(d_rates), decode_tok_s_all=[round(x, 3) for x in d_rates],
        hit_rate=None, h2d_bytes_per_token=None, cpu_pairs_per_token=None,
        vram_peak_gib=max(peaks) / 2**30 if dev.type == "cuda" else None,
        host_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        ceilings=ceilings or {},
        test=test or (llama_name(prompt_len, gen_len, depth) if depth
                      else cell_name(prompt_len, gen_len, timed_prompt=True)),
        depth=depth + (prompt_len if gen_len else 0), n_depth=depth, decode_input=decode_input,
        kv_length_before_decode=kv_before, prompt_tok_s_all=[round(x, 3) for x in p_rates],
        prompt_tok_s_std=spread(p_rates), decode_tok_s_std=spread(d_rates))
    if dev.type == "cuda":
        res.vram_peak_prompt_gib, res.vram_peak_decode_gib = (x / 2**30 for x in peaks)
        res.vram_reserved_peak_gib, res.device_used_gib = (x / 2**30 for x in held)
    pf = getattr(getattr(model, "step", None), "prefetch", None)
    res.prefetch = pf.n if pf is not None else 0
    res.warmups = warmups
    res.decode_captures = captures
    if share_sum["layers"]:
        n = share_sum["layers"] / 1e6
        res.share_us = {k[:-2]: share_sum[k] / n for k in ("idle_s", "answer_s", "pool_s")}
    res.prompt_chunks = -(-prompt_len // engine.prefill_chunk(max(prompt_len, 1)))
    if p_streamed and p_streamed[0]:
        i = p_times.index(statistics.median_low(p_times))
        res.prompt_streamed_gib = p_streamed[i] / 2**30
        res.prompt_streamed_gib_all = [round(b / 2**30, 4) for b in p_streamed]
        res.prompt_stream_gbs = p_streamed[i] / p_times[i] / 1e9
    if experts is not None and gen_len:
        tokens = runs * gen_len
        pairs = decode.hits.sum() + decode.cpu.sum() + decode.streamed.sum()
        res.hit_rate = float(decode.hits.sum() / pairs) if pairs else 0.0
        res.h2d_bytes_per_token = decode.bytes_h2d / tokens
        res.cpu_pairs_per_token = float(decode.cpu.sum()) / tokens
        res.admissions_per_token = decode.admissions / tokens
        res.ahead_used = float(decode.ahead_used.sum()) / tokens
        res.ahead_copied = float(decode.ahead_used.sum() + decode.ahead_unused.sum()) / tokens
        if ceilings and dev.type == "cuda":
            res.bound_tok_s = _decode_bound(engine, decode, ceilings, tokens)
            res.bound_fraction = res.decode_tok_s / res.bound_tok_s
    return res


class ExpertCounters:
    def __init__(self, n_layers: int):
        self.hits, self.cpu, self.streamed, self.ahead_used, self.ahead_unused = (
            np.zeros(n_layers, np.int64) for _ in range(5))
        self.bytes_h2d = self.admissions = 0
        self.cpu_s = 0.0

    @classmethod
    def of(cls, st) -> ExpertCounters:  # noqa: ANN001 - OffloadStats
        st.settle()  # counts kept on the device (device-routed prompt chunks) land here first
        c = cls(len(st.hits))
        c.hits, c.cpu, c.streamed, c.bytes_h2d = (st.hits.copy(), st.cpu.copy(),
                                                  st.streamed.copy(), st.bytes_h2d)
        c.ahead_used, c.ahead_unused = st.ahead_used.copy(), st.ahead_unused.copy()
        c.admissions, c.cpu_s = st.admissions, st.cpu_s
        return c

    def add(self, after: ExpertCounters, before: ExpertCounters) -> None:
        self.hits += after.hits - before.hits
        self.cpu += after.cpu - before.cpu
        self.streamed += after.streamed - before.streamed
        self.ahead_used += after.ahead_used - before.ahead_used
        self.ahead_unused += after.ahead_unused - before.ahead_unused
        self.bytes_h2d += after.bytes_h2d - before.bytes_h2d
        self.admissions += after.admissions - before.admissions
        self.cpu_s += after.cpu_s - before.cpu_s

    def per_token(self, tokens: int) -> dict:
        """The experts' work per token: (token, expert) pairs, the share served from cache
        slots, MB copied to the device, pairs computed by the CPU pool and its milliseconds."""
        pairs = int(self.hits.sum() + self.cpu.sum() + self.streamed.sum())
        return {"pairs": pairs / tokens,
                "hit_rate": float(self.hits.sum() / pairs) if pairs else 0.0,
                "h2d_mb": self.bytes_h2d / tokens / 1e6,
                "cpu_pairs": float(self.cpu.sum()) / tokens,
                "cpu_ms": 1e3 * self.cpu_s / tokens}


def _decode_bound(engine: Engine, st: ExpertCounters, ceilings: dict, tokens: int) -> float:
    """Tokens per second at DESIGN.md's bound, from the measured per-layer mix of hits, CPU
    misses and streamed misses (averaged over the measured tokens)."""
    ex = engine.model.experts
    hbm = ceilings["hbm_copy_GBs"] * 1e9 / 2  # a read is half of a copy's traffic
    host, pcie = ceilings["host_read_GBs"] * 1e9, ceilings["pcie_h2d_pinned_GBs"] * 1e9
    w = engine.model.w
    t = w.output.nbytes / hbm
    for i, lay in enumerate(ex.arena.layouts):
        lw = w.layers[i]
        mats = (lw.wq, lw.wk, lw.wv, lw.wo) if lw.delta is None else (  # (a Gated DeltaNet's)
            lw.delta.qkv, lw.delta.z, lw.delta.ba, lw.delta.out)
        dense = sum(x.nbytes for x in mats)
        eb = lay.nbytes
        t += max((dense + st.hits[i] / tokens * eb) / hbm, st.cpu[i] / tokens * eb / host,
                 (st.streamed[i] + st.ahead_unused[i]) / tokens * eb / pcie)
    return 1.0 / t
