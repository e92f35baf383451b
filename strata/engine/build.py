"""Build the model for an EngineConfig: the reference layout (every weight on the device) or the
offload runtime (memory plan, arena, expert cache, CPU pool, miss planner)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import torch

from strata.config import EngineConfig, ModelConfig
from strata.engine.chunk_graph import PROMPT_GRAPH_MODES, ChunkGraphs, blocked
from strata.engine.decode_step import DECODE_STEP_MODES, DecodeStep
from strata.engine.memory_plan import draft_in_blocks
from strata.errors import StrataError
from strata.experts.arena import Arena
from strata.experts.cache import ExpertCache
from strata.experts.cpu_pool import CpuPool, default_threads
from strata.experts.layout import ExpertLayout, expert_layouts, first_routed
from strata.experts.links import measure_links
from strata.experts.offload import OffloadExperts, OffloadOptions
from strata.experts.planner import LinkCosts, MissPlanner, check_miss_mode
from strata.experts.policy import make_policy
from strata.experts.profile import load_profile
from strata.experts.ring import Ring
from strata.gguf import ModelFile
from strata.kernels import tuning
from strata.model.transformer import MoETransformer
from strata.model.weights import ModelWeights
from strata.runtime.kv_cache import kv_dtype
from strata.units import fmt_bytes

log = logging.getLogger("strata")

FUSED_MAX_T = tuning.FUSED_MAX_T


def auto_stream_min(costs: LinkCosts, nbytes: int, cfg: ModelConfig) -> int:
    """The chunk size from which copying an expert beats computing it on the CPU, for the tokens an
    expert gets on average (T * K / E)."""
    dma, cpu1 = costs.dma(nbytes), costs.cpu(nbytes, 1)
    if dma <= cpu1:
        return 2
    if costs.cpu_s_per_token <= 0:
        return 1 << 20
    n = 1 + (dma - cpu1) / costs.cpu_s_per_token
    return max(2, int(math.ceil(n * cfg.n_experts / cfg.n_experts_used)))


def lends_workspace(dev: torch.device, layouts: list[ExpertLayout]) -> bool:
    """Lent slots need every layer on the fused kernels: a decode token on them takes nothing
    from the workspace (the dequantizing path would)."""
    from strata.experts.gpu_hits import fused_kernels_available

    if not fused_kernels_available(dev):
        return False
    from strata.kernels.gpu import has_fused

    return all(has_fused(q) for lay in layouts for q in lay.qtypes)


def _index(dev: torch.device) -> int:
    """The CUDA device's ordinal (torch's per-process memory fraction wants one: a plain "cuda"
    is the current device)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


def build_model(mf: ModelFile, cfg: ModelConfig, ec: EngineConfig,
                dev: torch.device) -> MoETransformer:
    if ec.kernels not in FUSED_MAX_T:
        raise StrataError(f"--kernels {ec.kernels}: choose from {', '.join(FUSED_MAX_T)}")
    if ec.decode_step not in DECODE_STEP_MODES:  # before the arena is filled
        raise StrataError(f"--decode-step {ec.decode_step}: choose from "
                          f"{', '.join(DECODE_STEP_MODES)}")
    if ec.prompt_graphs not in PROMPT_GRAPH_MODES:
        raise StrataError(f"--prompt-graphs {ec.prompt_graphs}: choose from "
                          f"{', '.join(PROMPT_GRAPH_MODES)}")
    fused_max_t = FUSED_MAX_T[ec.kernels]
    kv_elem = kv_dtype(ec.kv_type)  # (refused before anything loads)
    if cfg.kv_lora and ec.kv_type == "q8_0":
        raise StrataError(f"--kv-type q8_0: {cfg.arch}'s latent cache keeps rows of f32, f16 or "
                          "bf16; pick one of those")
    if ec.threads and dev.type == "cpu" and not ec.use_offload:  # (the offload runtime's
        torch.set_num_threads(ec.threads)  # CPU pool sets them: cpu_pool.CpuPool)
    if not ec.use_offload:
        if dev.type == "cuda" and not ec.beside_target:  # (no plan, so no cap; a --draft
            # model loads this way inside its target's plan and keeps the target's cap)
            torch.cuda.set_per_process_memory_fraction(1.0, _index(dev))
        quant = ec.beside_target and draft_in_blocks(dev.type, ec.kernels)  # (a --draft)
        model = MoETransformer(cfg, ModelWeights.load(mf, cfg, dev, quant_dense=quant), dev)
        model.kv_dtype = kv_elem
        if dev.type == "cuda":  # (the CPU's reference layout has no other way to run them)
            log.info(f"prompt graphs: off, {blocked(cfg, ec)}; prompt chunks run eagerly")
        return model
    from strata.engine.memory_plan import make_plan

    check_miss_mode(ec.miss)  # before the arena is filled
    if not 0 <= ec.cpu_share < cfg.n_experts_used:
        raise StrataError(f"--cpu-share {ec.cpu_share}: give 0 (off) to "
                          f"{cfg.n_experts_used - 1} of the {cfg.n_experts_used} experts a "
                          "token is routed to")
    auto_prefetch = ec.prefetch is None
    # verify windows (--spec) on CUDA copy the next layer's guessed experts ahead: --prefetch N
    # of them, auto a token's K (OffloadExperts.copy_ahead)
    window_prefetch = ((cfg.n_experts_used if auto_prefetch else ec.prefetch)
                       if dev.type == "cuda" and ec.spec else 0)
    if not auto_prefetch and not 0 <= ec.prefetch <= cfg.n_experts_used:
        raise StrataError(f"--prefetch {ec.prefetch}: give auto, or 0 (off) to "
                          f"{cfg.n_experts_used} (the experts a token is routed to)")
    layouts = expert_layouts(mf, cfg)
    plan = make_plan(mf, cfg, ec, layouts)
    for line in plan.lines():
        log.info(line)
    if dev.type == "cuda":  # a named budget is a cap, not a target (another engine loaded
        # before in this process, e.g. strata bench --sweep-vram, may have set one; one still
        # loaded, e.g. strata check's other side, keeps what it holds beside this one's budget)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(dev)
        cap = held + plan.budget - plan.context if plan.context else total
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), _index(dev))
        if plan.context:
            log.info(f"VRAM cap: torch's allocator holds at most {fmt_bytes(cap)} (the budget "
                     "less the CUDA context" + (f", beside the {fmt_bytes(held)} this process "
                     "held already" if held else "") + "); it gives its cached free blocks back "
                     "before passing it")
    if auto_prefetch and plan.prefetch < ec.prefetch_count(cfg.n_experts_used):
        n = [s for s, lay in zip(plan.slots_per_layer, layouts, strict=True)
             if s < cfg.n_experts and not lay.empty]
        log.info("--prefetch auto: off, " + (
            f"the cache holds {sum(n) / len(n):.1f} slots a layer, a token routes to "
            f"{cfg.n_experts_used} (it pays where most routed experts miss: docs/offload.md)"
            if n else "every expert has a cache slot"))
    if auto_prefetch:
        ec = replace(ec, prefetch=plan.prefetch)
    profile = load_profile(ec.expert_profile, cfg) if ec.expert_profile else None
    policies = [make_policy(ec.cache_policy, cfg.n_experts,
                            None if profile is None else profile[i]) for i in range(cfg.n_layers)]
    weights = ModelWeights.load(mf, cfg, dev, quant_dense=plan.quant_dense, experts=False,
                                fused_max_t=fused_max_t, x8=ec.kernels == "fused",
                                cpu_ggml=plan.quant_dense and dev.type == "cpu")
    arena = Arena(layouts, cfg.n_experts, pin=dev.type == "cuda")
    report = arena.fill(mf, progress=log.isEnabledFor(logging.INFO) and os.isatty(2))
    log.info(f"expert arena: {fmt_bytes(report.nbytes)} filled at {report.gib_s:.2f} GiB/s; "
             f"{arena.pin_note}; {report.note}")
    lent = plan.lent_per_layer if lends_workspace(dev, layouts) else ()
    cache = ExpertCache(layouts, plan.slots_per_layer, cfg.n_experts, policies, dev, lent)
    cache.warm(arena.layers)
    log.info(f"expert cache: {cache.capacity} slots, {fmt_bytes(cache.nbytes)}"
             + (f" (+ {sum(lent)} in the {fmt_bytes(plan.lent)} of the workspace"
                + (" and the ring" if plan.lent_ring else "") + " while decoding)"
                if lent else "")
             + f"; policy {ec.cache_policy}"
             + (", seeded from the profile" if profile is not None else ""))
    threads = ec.threads or default_threads(dev.type == "cuda")
    pool = CpuPool(ec.cpu_kernels, threads, plan.workspace)
    max_stride = max(lay.stride for lay in layouts)
    staging = torch.empty(plan.staging_slots, max_stride, dtype=torch.uint8, device=dev)
    costs = measure_links(arena, pool, staging)
    # on the CPU device a "copy" only moves host memory for torch to dequantize: --miss auto
    # computes every miss in the CPU pool there (an explicit --miss dma still copies)
    miss = "cpu" if dev.type != "cuda" and ec.miss == "auto" else ec.miss
    log.info(f"miss links: CPU pool {costs.cpu_gbs:.1f} GB/s ({pool.kind}, {threads} "
             f"threads), copies {costs.pcie_gbs:.1f} GB/s; misses: {ec.miss}"
             + (" (all to the CPU pool on the CPU device)" if miss != ec.miss else ""))
    stream_min = ec.stream_min or auto_stream_min(costs, first_routed(layouts).nbytes, cfg)
    if plan.ring:  # (none on the CPU device unless asked for: memory_plan)
        log.info(f"prompt chunks of {stream_min}+ tokens stream their missed experts through a "
                 f"{fmt_bytes(plan.ring)} ring")
    else:
        log.info("passes of several tokens compute their missed experts in the CPU pool, from "
                 "the arena (--stream-min N: through a ring instead)")
    for flag, n in (("--cpu-share", ec.cpu_share),
                    ("--prefetch", 0 if auto_prefetch else ec.prefetch)):
        if n and (dev.type != "cuda" or ec.decode_step == "off"):
            log.warning(f"{flag} {n}: off (it serves CUDA decode steps; this engine runs "
                        f"{'on the CPU' if dev.type != 'cuda' else 'without them'})")
    options = OffloadOptions(
        workspace_bytes=plan.workspace, stream_min=stream_min, fused_max_t=fused_max_t,
        x8=ec.kernels == "fused",  # (exact: float32 x everywhere)
        prompt_scratch=plan.prompt_weights, ring_borrow=plan.ring_borrow,
        lend_ring=plan.lent_ring and cache.lends, cpu_share=ec.cpu_share,
        # the share's own pool: --threads as given, else at most SHARE_THREADS (cpu_share.py)
        cpu_share_threads=ec.threads,
        prefetch=ec.prefetch if dev.type == "cuda" else 0,
        prefetch_auto=auto_prefetch,  # (then it is off without a word where it cannot run)
        window_prefetch=window_prefetch,
        pass_rows=plan.chunk,  # (a layer-major prompt's layer: in windows of a chunk)
        debug=ec.debug)
    # (the ring's grouped banks: experts with biases too, from the hit path's device copies of
    # them: OffloadExperts hands them over, Ring.use_biases)
    ring = Ring(plan.ring, dev, grouped=ec.kernels == "fused") if plan.ring else None
    executor = OffloadExperts(arena, cache, MissPlanner(miss, costs), pool, [staging],
                              ring, options)
    model = MoETransformer(cfg, weights, dev, executor)
    model.max_chunk = plan.chunk
    model.layer_tokens = plan.layer_tokens
    model.fused_attention = dev.type == "cuda" and ec.kernels == "fused"
    model.kv_dtype = kv_elem
    model.plan_ctx = plan.ctx  # (the context the plan holds: --ctx, or the model's capped)
    model.prefill_rows = plan.prefill_rows  # (--batch: the served prompts' plain scratch)
    if dev.type == "cuda" and (ec.ctx is not None or ec.vram_budget_gib is not None):
        model.kv_limit = plan.ctx  # (the plan's KV rows: a cache past them would pass the budget)
    if ec.decode_step != "off":
        model.step = DecodeStep(model, ec.decode_step, plan.ctx if dev.type == "cuda" else 0)
    # prompt chunks from CUDA graphs where they apply (its log line says which, or why not)
    # (and verify windows, one graph per size, where --spec asks and the plan took them)
    model.chunks = ChunkGraphs(model, plan.prompt_buckets, plan.prompt_graphs_note or None,
                               windows=plan.window_graphs)
    return model
