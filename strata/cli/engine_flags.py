"""The engine flags shared by the model commands (generate, chat, serve, logits, bench, bench-spec,
profile, perplexity; check for --a / --b), and their EngineConfig."""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

from strata.config import AUTO_PREFETCH, EngineConfig, usable_cores
from strata.errors import StrataError
from strata.units import parse_size

log = logging.getLogger("strata")


def add_engine_arguments(p: argparse.ArgumentParser, ctx_help: str | None = None) -> None:
    """The engine flags into p; ctx_help: --ctx's help where the command reads it otherwise."""
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                   help="where the model runs: cuda is the current CUDA device, cuda:N the N-th "
                   "visible one (auto: cuda when torch sees a GPU, else cpu; the first log line "
                   "says which)")
    g.add_argument("--offload", default="auto", choices=["auto", "on", "off"],
                   help="experts in a host arena with a device cache (auto: on for cuda; on "
                   "the CPU, on where ggml-python is installed and the experts in float32 pass "
                   "the reference path's 1 GiB kept, else off)")
    g.add_argument("--vram-budget", type=gib, default=None, metavar="GIB",
                   help="cap on every byte the engine takes on the device, in GiB: 4, 4.5 or 4G "
                   "(default: free VRAM minus a margin)")
    g.add_argument("--expert-cache", default="auto", metavar="auto|N|0",
                   help="expert cache slots in all layers (auto: what the budget leaves, "
                   "plus, on CUDA where it adds at least half, slots in the prompt workspace "
                   "and, with one sequence, the ring's VRAM while decoding; N: exactly N)")
    g.add_argument("--cache-policy", default="lfu", choices=["lfu", "lru", "profile"],
                   help="which experts stay resident: the most often routed (lfu, counts halve "
                   "every 4096 passes), the most recently routed (lru), or lfu seeded "
                   "from --expert-profile (profile)")
    g.add_argument("--expert-profile", default=None, metavar="P",
                   help="routing profile from `strata profile`: seeds the cache")
    g.add_argument("--miss", default="auto", choices=["auto", "cpu", "dma"],
                   help="missed experts: computed by the CPU pool (cpu), copied to the GPU (dma; "
                   "in a CUDA decode step gathered from the pinned arena by the GPU inside the "
                   "step's graph), or split between the two by measured cost (auto)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads: the CPU pool's and torch's (OpenMP's) pool (default: the "
                   "cores this process may use less those other processes keep busy now, less "
                   "one on a GPU, and `serve` one less for its HTTP process and clients; "
                   "OMP_NUM_THREADS, where set, still sizes torch's)")
    g.add_argument("--ctx", type=int, default=None,
                   help=ctx_help or "KV cache tokens to plan for (the model's context, capped so "
                   "that its cache takes at most a quarter of the memory the plan leaves, and at "
                   "least 4096 where those fit)")
    g.add_argument("--kv-type", default="auto", choices=["auto", "f32", "f16", "bf16", "q8_0"],
                   help="KV cache elements: f16 or bf16 halve its memory and the bytes decode "
                   "attention reads, q8_0 (8-bit blocks of 32 with a scale, as llama.cpp's) "
                   "takes 34/128 of it; keys and values rounded once when stored; f16 holds "
                   "magnitudes up to 65504, bf16 float32's range with less precision (auto: f16 "
                   "on CUDA, f32, the reference's, on the CPU)")
    g.add_argument("--cpu-kernels", default="auto", choices=["auto", "ggml", "torch"],
                   help="CPU kernel library for missed experts (auto)")
    g.add_argument("--prefill", default="auto", metavar="auto|auto:N|N|off",
                   help="prompt chunk size (auto: from the workspace)")
    g.add_argument("--prefill-order", default="auto", choices=["auto", "layers", "chunks"],
                   help="a prompt of several chunks: layer by layer, every chunk through a "
                   "layer before the next, so each streamed expert is copied once a prompt "
                   "(layers), or chunk by chunk through every layer (chunks) (auto: layers "
                   "where the prompt's experts stream through the ring)")
    g.add_argument("--ring-bytes", default="auto", metavar="auto|BYTES",
                   help="byte budget of the ring that prompt chunks stream experts through "
                   "(auto: from the plan, and it borrows the VRAM the plan leaves unused while a "
                   "prompt streams)")
    g.add_argument("--kernels", default="fused", choices=["fused", "exact", "off"],
                   help="GPU kernels on GGUF blocks: fused everywhere (the default: prompt "
                   "chunks on tensor cores, bf16 or, for Q4_K gate/up with a Q4_K or Q6_K down, "
                   "8-bit activations; decode rounds activations to 8 bits for expert gate/up "
                   "and down and large output matrices in Q4_K, Q6_K (down, output), IQ2_XS, "
                   "IQ3_XXS or MXFP4, as llama.cpp does), exact (fused only where "
                   "float32-exact: up to 4 tokens), off (no fused kernels)")
    g.add_argument("--decode-step", default="graphs", choices=["graphs", "eager", "off"],
                   help="one sequence's decode token on the offload runtime: static buffers "
                   "captured as CUDA graphs (graphs; eager on the CPU), the same pieces run "
                   "eagerly, or off (the plain batched forward)")
    g.add_argument("--prompt-graphs", default="on", choices=["on", "off"],
                   help="prompt chunks of one sequence on CUDA, with every expert in VRAM and "
                   "an f16 or bf16 KV cache: each chunk padded up to a bucket of 16, 32, 64 .. "
                   "tokens (as many as the memory plan holds the graph pool of) and replayed "
                   "from a CUDA graph captured on the bucket's first chunk, so the host no "
                   "longer launches every kernel of every chunk (on: where that applies, the "
                   "load log says; off: every chunk eagerly)")
    g.add_argument("--stream-min", default="auto", metavar="auto|T",
                   help="chunk tokens from which missed experts are streamed (auto: measured)")
    g.add_argument("--cpu-share", type=int, default=0, metavar="N",
                   help="CUDA decode steps whose layers gather their misses over PCIe: a CPU "
                   "pool of its own (8 threads unless --threads) computes each token's last N "
                   "missed pairs meanwhile (0: off; what it gains: docs/offload.md)")
    g.add_argument("--prefetch", default="auto", metavar="auto|N",
                   help="CUDA decode steps whose layers gather their misses over PCIe: while a "
                   "layer computes, copy the N experts the next layer's router ranks best for "
                   "the current hidden state (less those in VRAM already), so its gather finds "
                   f"them in VRAM (auto: {AUTO_PREFETCH} where the cache holds fewer slots a layer "
                   "than a token's experts, else off; 0: off; measurements: docs/offload.md); "
                   "with --spec, verify windows copy up to N of the next layer's guessed "
                   "experts ahead (auto: a token's K; docs/spec.md)")
    g.add_argument("--spec", type=int, default=0, metavar="T",
                   help="speculative decoding: up to T drafted tokens checked in one verify "
                   "window (a forward of T+1 tokens); the window shrinks or turns off while "
                   "few are accepted (0: off)")
    g.add_argument("--draft", default="auto", metavar="auto|ngram|mtp|PATH.gguf",
                   help="what drafts a window's tokens: n-grams of the context (ngram), the "
                   "file's MTP head (mtp), a small model sharing the tokenizer (PATH.gguf) (auto: "
                   "mtp where the file has one that runs, else ngram)")


MAX_SPEC = 64  # drafted tokens a window may hold (a window is one forward pass)
MAX_CACHE_SLOTS = 10_000_000  # far above layers x experts of any model
MAX_CTX = 1 << 24
# the flags of the offload runtime: without it (--offload off, or auto on the CPU where the
# reference path keeps a small model's experts) they change nothing (warn_unused)
OFFLOAD_FLAGS = ("vram_budget", "expert_cache", "cache_policy", "expert_profile", "miss",
                 "cpu_share", "prefetch", "ring_bytes", "stream_min", "cpu_kernels", "decode_step")


def gib(text: str) -> float:
    """--vram-budget's GiB: a number, or one followed by G or GiB (any case)."""
    t = text.strip()
    for unit in ("gib", "g"):
        if t.lower().endswith(unit):
            t = t[:-len(unit)]
            break
    try:
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size in GiB, e.g. 4, 4.5 or "
                                         "4G") from None


def resolve_device(flag: str) -> tuple[str, str]:
    """(device, why) for --device: auto is cuda when torch sees a GPU, else cpu; cuda and cuda:N
    must name a device torch sees (refused here, before anything loads or a server starts)."""
    if flag == "cpu":
        return flag, "--device " + flag
    if flag == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise StrataError("--device cuda: torch sees no CUDA device; use --device cpu")
        return flag, "--device " + flag
    if flag.startswith("cuda:"):
        index = flag[5:]
        if not (index.isascii() and index.isdigit()):
            raise StrataError(f"--device {flag}: give cuda:N with N a device number (0, 1, ...)")
        import torch

        n = torch.cuda.device_count()
        if int(index) >= n:
            seen = (f"torch sees {n} CUDA device{'s' if n > 1 else ''} (cuda:0"
                    f"{f'..cuda:{n - 1}' if n > 1 else ''})" if n else
                    "torch sees no CUDA device; use --device cpu")
            raise StrataError(f"--device {flag}: no such device; {seen}")
        return f"cuda:{int(index)}", "--device " + flag
    if flag != "auto":
        raise StrataError(f"--device {flag}: choose auto, cpu, cuda or cuda:N")
    import torch

    if torch.cuda.is_available():
        return "cuda", "--device auto: torch sees a GPU"
    return "cpu", "--device auto: torch sees no GPU"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed engine flags; --device auto resolved (and logged)."""
    vram = args.vram_budget
    if vram is not None and not (math.isfinite(vram) and 0 < vram <= 1 << 20):
        raise StrataError(f"--vram-budget {vram}: give a size in GiB above 0 (a finite number)")
    threads = args.threads
    if threads is not None and threads < 1:
        raise StrataError(f"--threads {threads}: give at least 1")
    if threads is not None and threads > (usable := usable_cores()):
        log.warning("--threads %d: this process may use %d cores; using %d", threads, usable,
                    usable)
        threads = usable
    if args.ctx is not None and not 1 <= args.ctx <= MAX_CTX:
        raise StrataError(f"--ctx {args.ctx}: give at least 1, at most {MAX_CTX}")
    if args.cpu_share < 0:
        raise StrataError(f"--cpu-share {args.cpu_share}: give 0 (off) or more")
    if args.expert_cache != "auto":
        try:
            slots = int(args.expert_cache)
        except ValueError:
            slots = -1
        if not 0 <= slots <= MAX_CACHE_SLOTS:
            raise StrataError(f"--expert-cache {args.expert_cache}: give auto or a number of "
                              f"slots from 0 to {MAX_CACHE_SLOTS:,}")
    profile = args.expert_profile
    if profile is not None:
        readable_file("--expert-profile", profile, "the JSON file `strata profile` wrote")
    if args.cache_policy == "profile" and profile is None:
        raise StrataError("--cache-policy profile needs --expert-profile FILE (`strata profile` "
                          "records one)")
    if not _prefill_ok(args.prefill):
        raise StrataError(f"--prefill {args.prefill}: give auto, auto:N, a number of tokens "
                          ">= 1, or off")
    ring = None if args.ring_bytes == "auto" else _int_flag("--ring-bytes", args.ring_bytes)
    stream_min = None if args.stream_min == "auto" else _int_flag("--stream-min",
                                                                  args.stream_min)
    if args.prefetch == "auto":
        prefetch = None
    else:
        try:
            prefetch = int(args.prefetch)
        except ValueError:
            raise StrataError(f"--prefetch {args.prefetch}: give auto or a count of experts "
                              "(0: off)") from None
        if abs(prefetch) > 1 << 16:  # (the model's own range is checked where it is built)
            raise StrataError(f"--prefetch {args.prefetch}: give auto or a count of experts "
                              "(0: off)")
    spec = getattr(args, "spec", 0)
    if not 0 <= spec <= MAX_SPEC:
        raise StrataError(f"--spec {spec}: give 0 (off) to {MAX_SPEC} drafted tokens a window")
    _check_draft(getattr(args, "draft", "auto"), spec)
    device, why = resolve_device(args.device)
    log.info("device: %s (%s)", device, why)
    kv_type = args.kv_type
    if kv_type == "auto":  # (what llama.cpp keeps too; the CPU's paths stay the reference's;
        # the memory plan's KV line names the type)
        kv_type = "f16" if device.startswith("cuda") else "f32"
    return EngineConfig(
        device=device, offload=args.offload, vram_budget_gib=args.vram_budget,
        expert_cache=args.expert_cache, cache_policy=args.cache_policy,
        expert_profile=args.expert_profile, miss=args.miss, threads=threads, ctx=args.ctx,
        kv_type=kv_type, cpu_kernels=args.cpu_kernels, prefill=args.prefill,
        prefill_order=args.prefill_order, ring_bytes=ring,
        stream_min=stream_min, kernels=args.kernels, decode_step=args.decode_step,
        prompt_graphs=getattr(args, "prompt_graphs", "on"),
        cpu_share=args.cpu_share, prefetch=prefetch, debug=getattr(args, "debug", False),
        spec=spec, draft=getattr(args, "draft", "auto"))


def _int_flag(flag: str, text: str) -> int:
    """A positive count (--stream-min) or size (--ring-bytes: 123, 500M, 4G)."""
    try:
        n = parse_size(text) if flag == "--ring-bytes" else int(text)
    except (ValueError, OverflowError):  # (OverflowError: inf)
        n = 0
    if not 1 <= n <= 1 << 50:
        raise StrataError(f"{flag} {text}: give auto or a positive number")
    return n


def _prefill_ok(spec: str) -> bool:
    """--prefill's form, as Engine.prefill_chunk reads it (checked before the weights load)."""
    try:
        return spec in ("auto", "off") or int(spec.removeprefix("auto:")) >= 1
    except ValueError:
        return False


def _check_draft(draft: str, spec: int) -> None:
    """--draft's form (drafters.make_drafter reads it after the target loads): a draft without
    --spec would draft nothing."""
    if draft == "auto":
        return
    if not spec:
        raise StrataError(f"--draft {draft}: drafts fill the verify windows of --spec T; give "
                          "--spec T too, or drop --draft")
    if draft in ("ngram", "mtp"):
        return
    if Path(draft).suffix != ".gguf":
        raise StrataError(f"--draft {draft}: choose auto, ngram, mtp or a .gguf draft model")
    readable_file("--draft", draft, "a draft model's .gguf file")


def readable_file(flag: str, path: str, what: str) -> None:
    """A file a flag names, checked before anything loads: there, not a folder, readable."""
    if not Path(path).exists():
        raise StrataError(f"{flag} {path}: no such file (give {what})")
    if Path(path).is_dir():
        raise StrataError(f"{flag} {path}: is a folder; give {what}")
    if not os.access(path, os.R_OK):
        raise StrataError(f"{flag} {path}: cannot read it (permission denied)")


def warn_unused(args: argparse.Namespace, engine: object) -> None:
    """One warning naming the offload runtime's flags given to an engine that runs without it
    (they were accepted, and change nothing)."""
    if engine.engine_config.use_offload:  # type: ignore[attr-defined]
        return
    p = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(p)
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in OFFLOAD_FLAGS
             if getattr(args, name, None) != p.get_default(name)]
    if given:
        log.warning("%s: no effect: the offload runtime is off (--offload %s: every weight on "
                    "the device, the reference path); --offload on runs it", ", ".join(given),
                    args.offload)


def refuse_spec(args: argparse.Namespace, command: str) -> None:
    """--spec drafts tokens to decode; a command that decodes none refuses it in one line."""
    if getattr(args, "spec", 0):
        raise StrataError(f"--spec {args.spec}: speculative decoding serves generate, chat, "
                          f"serve and bench-spec; strata {command} decodes no drafted tokens, "
                          f"drop --spec")
