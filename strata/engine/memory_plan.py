"""The memory plan: every VRAM byte the engine takes, decided before anything is allocated.

    budget = dense weights + KV cache + workspace + staging + expert cache slots + margin
             (+ the CUDA context, where --vram-budget names the budget: nvidia-smi counts it)

Dense weights stay in their GGUF blocks on the GPU when every dense matrix has a fused kernel
(fewer bytes per decode GEMV, and faster), or when float32 copies would take more than a quarter
of the budget. Cache slots are shared equally by the layers (each slot sized from its own
layer's record); what a slot in every layer no longer fits, and the streaming ring will not
borrow during prompts, goes to one more slot in the layers with the smallest records. When the
budget cannot hold the dense weights and a minimal KV cache, or host RAM cannot hold the arena,
the plan refuses with the numbers and what to change.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.config import (
    EngineConfig,
    ModelConfig,
    expected_tensors,
    kv_elem_bytes,
    optional_tensors,
    prefetch_pays,
)
from strata.config_hybrid import state_bytes
from strata.engine.batch_step import BATCH_SIZES, rows_bytes, step_sizes
from strata.engine.chunk_graph import plan_buckets
from strata.errors import StrataError
from strata.experts.layout import ExpertLayout
from strata.experts.ring import ring_size
from strata.gguf import ModelFile, open_model
from strata.kernels.tuning import (
    BORROW_RECORDS,
    CUDA_CONTEXT,
    DEFAULT_CTX,
    KV_SHARE,
    MIN_KV_TOKENS,
    PREFILL_SCRATCH_ROWS,
)
from strata.kernels.tuning import PLAN_MARGIN as MARGIN
from strata.model.weights import embed_on_host
from strata.quant import DEQUANT_CHUNK_BYTES
from strata.runtime.kv_slots import POOL_BLOCK
from strata.units import fmt_bytes, proc_kib

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    budget: int
    quant_dense: bool
    dense: int
    kv: int
    ctx: int
    workspace: int
    staging: int
    staging_slots: int
    ring: int
    sequences: int
    slots_per_layer: list[int]
    cache: int
    arena: int
    host_available: int
    chunk: int = 4096  # prompt tokens per forward at most
    prompt_weights: int | None = None  # bf16 weight scratch of the grouped prompt path
    ring_borrow: int = 0  # bytes of `left` the ring may add to itself during streamed chunks
    kv_type: str = "f32"  # the KV cache's elements (--kv-type)
    strides: tuple[int, ...] = ()  # each layer's record bytes (a slot's size)
    prefetch: int = 0  # experts decode prefetch copies ahead (--prefetch, auto resolved)
    # per layer: slots the cache adds in the workspace's VRAM while passes need no workspace
    # (decode steps of up to DECODE_MAX_T tokens); a larger pass takes them back first
    lent_per_layer: tuple[int, ...] = ()
    lent_ring: bool = False  # the lent slots take the streaming ring's VRAM too
    ring_note: str = ""  # why there is no ring, where that is a choice
    ctx_note: str = ""  # where the planned context comes from (--ctx, the model's, ...)
    context: int = 0  # the CUDA context's own VRAM, in a --vram-budget (tuning.CUDA_CONTEXT)
    # the prompt graphs' pool and static buffers (strata.engine.chunk_graph.plan_buckets), the
    # buckets they hold, and why none where they do not apply
    prompt_graphs: int = 0
    prompt_buckets: tuple[int, ...] = ()
    prompt_graphs_note: str = ""
    window_graphs: int = 0  # the most tokens of a verify window they serve (--spec; 0: none)
    activations: int = 0  # a prompt chunk's live tensors outside the MoE scratch (activation_bytes)
    # and a layer-major span's hidden states (layer_span): tokens a layer-major pass holds (0:
    # chunk by chunk only)
    layer_tokens: int = 0
    draft: int = 0  # a --draft PATH.gguf model's weights on the device (its KV rows are in kv)
    draft_path: str = ""
    # a --batch pool's scratch rows for prompts on the prompt graphs (PREFILL_SCRATCH_ROWS; in kv)
    prefill_rows: int = 0
    # --batch's batched step on CUDA (step_bytes): every size's static buffers and graphs
    batch_step: int = 0
    batch_sizes: tuple[int, ...] = ()
    host_embed: bool = False  # the token embedding in host RAM, not in `dense` (embed_on_host)

    @property
    def left(self) -> int:
        return (self.budget - self.context - self.dense - self.kv - self.workspace
                - self.activations - self.staging - self.ring - self.cache - self.prompt_graphs
                - self.draft - self.batch_step)

    @property
    def lent(self) -> int:
        """Bytes of the workspace (and the ring) the lent slots take (between prompt chunks)."""
        return sum(n * s for n, s in zip(self.lent_per_layer, self.strides, strict=True))

    def lines(self) -> list[str]:
        n, f = sum(self.slots_per_layer), fmt_bytes
        return [
            f"memory plan on {self.device}, budget {f(self.budget)}:",
            *([f"  CUDA context   {f(self.context):>10} (the driver's and the libraries' own, "
               "outside torch's allocator)"] if self.context else []),
            f"  dense weights  {f(self.dense):>10} "
            f"({'in GGUF blocks' if self.quant_dense else 'float32'}"
            + ("; the token embedding in host RAM, a row read a token" if self.host_embed
               else "") + ")",
            *([f"  draft model    {f(self.draft):>10} ({self.draft_path}: every weight on the "
               "device; its KV rows in the KV line)"] if self.draft else []),
            f"  KV cache       {f(self.kv):>10} ({self.ctx} tokens x {self.sequences} sequences, "
            f"{self.kv_type}" + (f": {self.ctx_note}" if self.ctx_note else "")
            + (f"; + {self.prefill_rows} rows that prompts run in on the prompt graphs"
               if self.prefill_rows else "") + ")",
            f"  workspace      {f(self.workspace):>10} (prompt chunks of up to {self.chunk} "
            "tokens)",
            *([f"  activations    {f(self.activations):>10} (a chunk's hidden states, "
               "attention and router tensors" + (f"; a layer-major prompt's, {self.layer_tokens}"
                                                  " tokens at a time" if self.layer_tokens
                                                  else "") + ")"]
              if self.activations else []),
            f"  staging        {f(self.staging):>10} ({self.staging_slots} experts)",
            f"  streaming ring {f(self.ring):>10}"
            + (f" ({self.ring_note})" if self.ring_note else "")
            + (f" (+ up to {f(self.ring_borrow)} of what is left, during prompt chunks that "
               "stream)" if self.ring_borrow else ""),
            f"  cache slots    {f(self.cache):>10} ({n} slots, "
            f"{min(self.slots_per_layer, default=0)}-{max(self.slots_per_layer, default=0)} "
            "per layer" + (f"; + {sum(self.lent_per_layer)} in the workspace"
                           + (" and the ring" if self.lent_ring else "")
                           + f" while decoding, {fmt_bytes(self.lent)})"
                           if sum(self.lent_per_layer) else ")"),
            f"  prompt graphs  {f(self.prompt_graphs):>10} (" + (
                f"chunks padded to {', '.join(map(str, self.prompt_buckets))} tokens"
                + (f", verify windows of 1-{self.window_graphs} tokens with every row's logits"
                   if self.window_graphs else "")
                + ": one pool, the largest pass's" if self.prompt_buckets else
                f"verify windows of 1-{self.window_graphs} tokens with every row's logits; "
                f"no chunks: {self.prompt_graphs_note}" if self.window_graphs else
                f"none: {self.prompt_graphs_note}") + ")",
            *([f"  batched step   {f(self.batch_step):>10} (--batch {self.sequences}: steps of "
               f"{', '.join(map(str, self.batch_sizes))} rows, each size's buffers and graphs)"]
              if self.batch_step else []),
            f"  host arena     {f(self.arena):>10} of {f(self.host_available)} RAM available",
            f"  left           {f(self.left):>10}",
        ]


def auto_chunk(cfg: ModelConfig, workspace: int) -> int:
    """Prompt tokens per chunk whose float32 MoE intermediates (K experts x (D + F) floats per
    token; a dense model, its FFN's D + 2 F) fit the workspace: 16 .. 4096."""
    per_token = cfg.n_experts_used * (cfg.d_model + cfg.d_expert) * 4
    if not cfg.n_experts:  # (a dense --draft)
        per_token = (cfg.d_model + 2 * cfg.d_ff) * 4
    return max(16, min(4096, workspace // per_token))


def draft_bytes(ec: EngineConfig) -> tuple[int, int]:
    """A --spec draft model given as --draft PATH.gguf, loaded whole on the target's device
    (--offload off: dense matrices in float32, on CUDA in their GGUF blocks (draft_in_blocks),
    experts in their blocks, as ModelWeights.load keeps them) -> (weight bytes, KV bytes a
    token at --kv-type); (0, 0) for any other drafter."""
    if not ec.spec or not ec.draft.endswith(".gguf") or not Path(ec.draft).is_file():
        return 0, 0  # (make_drafter refuses a missing file in its own words)
    mf = open_model(ec.draft)
    cfg = ModelConfig.from_model(mf, dense=True)
    experts = sum(ref.info.nbytes for name, ref in mf.tensors.items() if "_exps." in name)
    kv = int(cfg.n_kv_layers * cfg.kv_row * kv_elem_bytes(ec.kv_type))
    host_embed = embed_on_host(cfg, "cuda" if ec.device.startswith("cuda") else "cpu")
    return dense_bytes(mf, cfg, draft_in_blocks(ec.device, ec.kernels), host_embed) + experts, kv


def draft_in_blocks(device: str, kernels: str) -> bool:
    """A --draft model on CUDA keeps its matrices in their GGUF blocks, read by the fused
    kernels (its decode tokens on the GEMVs): a quarter of float32's VRAM, and a draft's
    rounding moves no output (every token is the target's). --kernels off keeps float32."""
    return device.startswith("cuda") and kernels != "off"


def activation_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Device bytes a prompt chunk of `tokens` keeps live outside the MoE path's scratch, counted
    in float32 as if all were live at once: the residual stream and its norm, the attention's
    q / k / v (projected, then normed and rotated) and output, the router's logits, a shared
    expert's or dense FFN's intermediates. Qwen3-30B-A3B: 141 KiB a token; the H200 showed
    ~100 KiB a token more in torch's tensors' peak from pp128 to pp2048 at 10 GiB, and a
    4096-token chunk at 16K of depth failed for want of about that much when this was not
    counted (bench/2026-12-02-h200-prompt-graphs.md)."""
    attn = cfg.q_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    if cfg.ssm_heads:  # a Gated DeltaNet layer's q / k / v and gates
        attn = max(attn, 2 * cfg.ssm_groups * cfg.ssm_state + 2 * cfg.ssm_heads * cfg.ssm_state)
    ffn = max(cfg.d_shared, cfg.d_ff if cfg.n_dense_lead else 0)
    per_token = 6 * cfg.d_model + 3 * attn + 2 * cfg.q_dim + 2 * cfg.n_experts + 3 * ffn
    return tokens * per_token * 4


def step_bytes(cfg: ModelConfig, slots: int) -> tuple[int, int, tuple[int, ...]]:
    """Device bytes of the batched step of a --batch pool of `slots` sequences, at all its sizes
    (batch_step.step_sizes: each builds its buffers and captures its graphs at its first
    steps): (fixed, a context row's, the sizes). Each size's static buffers (batch_step.
    rows_bytes) and its graphs' intermediates, estimated as a prompt chunk's activations of as
    many rows (activation_bytes); a context row's: the block table's entry and the pool rows
    each step row reads (int64 [B, context]) at every size."""
    sizes = step_sizes(slots, bool(cfg.full_attn_interval))
    fixed = sum(rows_bytes(cfg, b, slots) + activation_bytes(cfg, b) for b in sizes)
    return fixed, -(-8 * sum(sizes) * (POOL_BLOCK + 1) // POOL_BLOCK), sizes


def layer_span(cfg: ModelConfig, ec: EngineConfig, share: int, ring: int) -> int:
    """Prompt tokens one layer-major pass may hold (strata.model.layer_major: every chunk of the
    span through a layer, then the next layer) in `share` bytes: it keeps the span's x, a
    layer's output, the experts' input and output (float32 [T, D] each) and the routing (ids
    int64, weights float32 [T, K]) between layers. 0 where it would not run: no ring (nothing
    streams) unless --prefill-order layers, or --prefill-order chunks. (The generator runs
    spans of whole chunks, and layer by layer only where a span holds two.)"""
    if ec.prefill_order == "chunks" or (not ring and ec.prefill_order != "layers"):
        return 0
    return share // layer_span_bytes(cfg, 1)


def layer_span_bytes(cfg: ModelConfig, span: int) -> int:
    return span * (4 * cfg.d_model * 4 + cfg.n_experts_used * 12)


def prompt_scratch(cfg: ModelConfig, layouts: list[ExpertLayout], budget: int,
                   chunk: int) -> tuple[int, int, int]:
    """The grouped prompt path's scratch on CUDA (strata.kernels.gpu.moe_grouped): (bytes, chunk,
    weight scratch). Its weights take at most an eighth of `budget` (the plan's room: the budget
    less the context, dense weights and margin); the chunk is halved (not below 256 tokens)
    until the whole scratch fits a quarter of it."""
    from strata.kernels.gpu.moe_grouped import GROUPED_SCRATCH_BYTES, grouped_scratch_bytes

    lay = max(layouts, key=lambda la: la.d_model * la.d_expert)
    one = 3 * lay.d_model * lay.d_expert * 2  # one expert in bf16
    weights = max(one, min(GROUPED_SCRATCH_BYTES, budget // 8))

    def need(t: int) -> int:
        return grouped_scratch_bytes(lay, cfg.n_experts, t, cfg.n_experts_used, weights)

    while chunk > 256 and need(chunk) > budget // 4:
        chunk //= 2
    return need(chunk), chunk, weights


def host_available() -> int:
    avail = proc_kib("/proc/meminfo", "MemAvailable")
    return avail if avail is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_AVPHYS_PAGES")


def dense_bytes(mf: ModelFile, cfg: ModelConfig, quant: bool, host_embed: bool = False) -> int:
    """The device bytes of the dense tensors (quant: matrices in their GGUF blocks; host_embed:
    the token embedding in host RAM, weights.embed_on_host)."""
    total = 0
    for name, shape in expected_tensors(cfg).items():
        if "_exps." in name or _mtp_block(cfg, name) or host_embed and name == "token_embd.weight":
            continue
        ref = mf.tensors[name]
        numel = 1
        for s in shape:
            numel *= s
        keep_raw = quant and len(shape) == 2 or name == "token_embd.weight"
        total += ref.info.nbytes if keep_raw else numel * 4
    return total


def _mtp_block(cfg: ModelConfig, name: str) -> bool:
    """A tensor of an MTP block (blk.N. past the trunk): kept on the host, unused by the forward."""
    return cfg.n_nextn > 0 and name.startswith("blk.") and int(name.split(".")[1]) >= cfg.n_layers


def mtp_head_bytes(mf: ModelFile, cfg: ModelConfig, ec: EngineConfig) -> int:
    """--spec with --draft mtp / auto: the device bytes of the MTP head's dense tensors (float32
    at most; its routed experts stay on the host, strata.model.mtp)."""
    if not ec.spec or ec.draft not in ("mtp", "auto"):
        return 0
    loaded = expected_tensors(cfg) | optional_tensors(cfg)  # (ModelWeights.load reads these)
    return sum(4 * math.prod(mf.tensors[name].shape) for name in loaded
               if name in mf.tensors and _mtp_block(cfg, name) and "_exps." not in name)


def cpu_ggml_dense(ec: EngineConfig, dev: torch.device) -> bool:
    """The offload runtime on the CPU under --kernels fused keeps its dense matrices in their GGUF
    blocks, multiplied on ggml's kernels (strata.kernels.cpu.ggml_dense), where ggml-python is
    installed and --cpu-kernels allows it; --kernels exact keeps float32."""
    if dev.type != "cpu" or ec.kernels != "fused" or ec.cpu_kernels == "torch":
        return False
    from strata.kernels.cpu import ggml_available

    return ggml_available()


def fused_dense(mf: ModelFile, cfg: ModelConfig, ec: EngineConfig) -> bool:
    """Every dense matrix has a fused kernel (and --kernels allows them): kept in its GGUF
    blocks, a decode GEMV reads 3-7x fewer bytes than the float32 copy and ran faster on the
    H200 (q/k/v/o of Qwen3-30B-A3B Q4_K_M: 22.5 us a layer against 32.1 us for float32 cuBLAS,
    scripts/bench_moe_decode.py), and prompt chunks multiply them on bf16 tensor cores."""
    if ec.kernels == "off":
        return False
    from strata.kernels.gpu.formats import FLOAT_TYPES
    from strata.model.weights import fused_matmul_available

    # (a float matrix needs no kernel of its own: torch.matmul reads its rows as they are, so
    # qwen35moe's F32 ssm_alpha / ssm_beta no longer turn every other matrix into float32)
    return all(fused_matmul_available(mf.tensors[name].qtype)
               or mf.tensors[name].qtype in FLOAT_TYPES
               for name, shape in expected_tensors(cfg).items()
               if len(shape) == 2 and "_exps." not in name and "ffn_gate_inp" not in name
               and (name != "token_embd.weight" or cfg.tied_output) and name in mf.tensors)


def make_plan(mf: ModelFile, cfg: ModelConfig, ec: EngineConfig,
              layouts: list[ExpertLayout]) -> MemoryPlan:
    dev = torch.device(ec.device)
    if ec.vram_budget_gib is not None:
        budget = int(ec.vram_budget_gib * GIB)
    elif dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        budget = free - 2 * MARGIN
    else:
        budget = host_available() // 2
    # (a named budget holds the process's CUDA context too; free VRAM is measured after it)
    context = CUDA_CONTEXT if dev.type == "cuda" and ec.vram_budget_gib is not None else 0
    # --ctx, or by default the model's context, planned below (capped by what the plan holds)
    ctx = min(ec.ctx or cfg.context_length, cfg.context_length)
    # the cached elements of every full-attention layer (keys and values, or MLA's latent rows;
    # 4 bytes each, 2 with --kv-type f16 or bf16, 34/32 with q8_0), for each sequence decoded
    # together
    kv_size = kv_elem_bytes(ec.kv_type)
    kv_per_token = int(cfg.n_kv_layers * cfg.kv_row * kv_size * max(1, ec.sequences))
    # a --draft PATH.gguf model beside it on the device: its weights, and its KV rows for the
    # same context, a cache for each sequence decoded together (ModelDrafter keeps one per
    # sequence; on the CPU the budget is host RAM: not counted)
    draft, draft_kv = draft_bytes(ec) if dev.type == "cuda" else (0, 0)
    draft_kv *= max(1, ec.sequences)
    kv_per_token += draft_kv
    quant_dense = dev.type == "cuda" and (dense_bytes(mf, cfg, False) > (budget - context) // 4
                                          or fused_dense(mf, cfg, ec)) or cpu_ggml_dense(ec, dev)
    host_embed = embed_on_host(cfg, dev.type)
    dense = dense_bytes(mf, cfg, quant_dense, host_embed) + mtp_head_bytes(mf, cfg, ec)
    if dev.type == "cuda":  # (gpt-oss: the experts' biases, copied once for the fused kernels)
        dense += sum(lay.bias.gate.nbytes + lay.bias.up.nbytes + lay.bias.down.nbytes
                     for lay in layouts if lay.bias is not None)
    # what the prompt path's scratch and the ring take their shares of: the budget less what
    # no plan can shrink (at 2 GiB for Qwen3-30B-A3B the context, dense weights and margin
    # leave 0.24 GiB: shares of the whole budget would not fit beside them)
    room = max(0, budget - context - dense - MARGIN)
    # (the float32 dequantizing paths: at least one float32 expert and a piece being dequantized,
    # compute.run_records; a piece of a dense matrix, weights.QuantTensor)
    # (on CUDA --workspace-mib's share is at most a quarter of the room, above that floor)
    asked = ec.workspace_mib << 20
    workspace = max(min(asked, room // 4) if dev.type == "cuda" else asked,
                    3 * cfg.d_model * cfg.d_expert * 4 + DEQUANT_CHUNK_BYTES)
    chunk, prompt_weights = auto_chunk(cfg, workspace), None
    if dev.type == "cuda" and ec.kernels == "fused":  # the grouped prompt path's scratch; it
        # and the float32 dequantizing paths never run at once, so they share the workspace
        grouped, chunk, prompt_weights = prompt_scratch(cfg, layouts, room, 4096)
        workspace = max(workspace, grouped)
    max_stride = max(lay.stride for lay in layouts)
    # a decode token's missed pairs, and the rows --prefetch copies the next layer's into
    prefetch = (ec.prefetch_count(cfg.n_experts_used)
                if dev.type == "cuda" and ec.decode_step != "off" else 0)
    staging_slots = cfg.n_experts_used + prefetch
    staging = staging_slots * max_stride
    # the ring: by default four of the largest records (double buffering with room to spare);
    # with the grouped prompt path (banks of a quarter of the ring, copied ahead across layers),
    # up to 256: an eighth of the room from 4 GiB budgets, a sixteenth below. On the H200, an 8K
    # prompt streaming every expert kept PCIe at 45% of its ceiling with 64 records, 71% with 256
    n_ring = 4
    if dev.type == "cuda" and ec.kernels == "fused":
        share = room // 8 if budget >= 4 * GIB else room // 16
        n_ring = max(4, min(256, share // max_stride))
    ring = ring_size(ec.ring_bytes, layouts, n_ring * max_stride)
    if dev.type != "cuda" and ec.stream_min is None and ec.ring_bytes is None:
        # on the CPU device a ring would copy host memory to host memory for torch to
        # dequantize, where the CPU pool computes the misses from the arena itself
        # (bench/2026-12-01-cpu-batched-decode.md); only --stream-min / --ring-bytes ask for one
        ring = 0
    # --ring-bytes auto: during prompt chunks that stream, the ring grows into the VRAM the
    # plan leaves unused (less the margin), up to BORROW_RECORDS of the largest records, and
    # shrinks back before any other pass (OffloadExperts.before_pass)
    borrow_cap = (max(0, BORROW_RECORDS * max_stride - ring)
                  if ec.ring_bytes is None and ring else 0)
    # (and a hybrid model's recurrent state, a fixed size per sequence: config_hybrid)
    # and with --spec T, that state after each of a verify window's T+1 tokens (its rollback)
    states = state_bytes(cfg) * (max(1, ec.sequences) + (ec.spec + 1 if ec.spec else 0))
    # --batch's pool (strata.runtime.kv_slots): each sequence's rows rounded up to whole
    # blocks, and one scratch row (padded rows of a batched step write there)
    seq_row = (kv_per_token - draft_kv) // max(1, ec.sequences)  # one sequence's row's bytes
    pool = (POOL_BLOCK * ec.sequences + 1) * seq_row if ec.sequences > 1 else 0
    # (on CUDA a chunk's own tensors beside the MoE scratch; the CPU's budget is host RAM)
    activations = activation_bytes(cfg, chunk) if dev.type == "cuda" else 0
    # a layer-major prompt's span (--prefill-order): its hidden states from a sixteenth of the
    # room (on the CPU the budget is host RAM: spans of up to 64 chunks, not counted)
    # (no prompt the context holds is longer than the context)
    span = min(layer_span(cfg, ec, room // 16 if dev.type == "cuda" else
                          64 * chunk * layer_span_bytes(cfg, 1), ring), ctx)
    if dev.type == "cuda":
        activations += layer_span_bytes(cfg, span)
    # the batched step's buffers and graphs at every size (--batch on CUDA: step_bytes), a part
    # by the context: a context row costs its KV rows and the step's row indices (per_token)
    steps, step_row, batch_sizes = (
        step_bytes(cfg, ec.sequences) if 1 < ec.sequences <= BATCH_SIZES[-1]
        and dev.type == "cuda" and ec.decode_step != "off" else (0, 0, ()))
    per_token = kv_per_token + step_row
    fixed = (context + dense + draft + workspace + activations + staging + ring + MARGIN + states
             + pool + steps)
    if fixed + MIN_KV_TOKENS * per_token > budget:
        f = fmt_bytes
        raise StrataError(
            f"--vram-budget {budget / GIB:.2f} GiB cannot hold the dense weights ({f(dense)}), "
            f"workspace, activations, staging and ring "
            f"({f(workspace + activations + staging + ring)}), a margin of "
            f"{f(MARGIN)}" + (f", the CUDA context ({f(context)})" if context else "") + " and a "
            f"{MIN_KV_TOKENS}-token KV cache ({f(MIN_KV_TOKENS * per_token)}): give at least "
            f"{(fixed + MIN_KV_TOKENS * per_token) / GIB + 0.01:.2f} GiB")
    kv_room = budget - fixed
    if ec.ctx is not None and ctx * per_token > kv_room:  # (asked for: never shrunk)
        f = fmt_bytes
        raise StrataError(
            f"--ctx {ec.ctx}" + (f" (the model's context, {ctx})" if ctx < ec.ctx else "")
            + f": its KV cache ({f(ctx * kv_per_token)} at --kv-type {ec.kv_type}) does "
            f"not fit the {f(kv_room)} that --vram-budget {budget / GIB:.2f} GiB leaves after the "
            f"dense weights, workspace, activations, staging, ring and margin: give at most --ctx "
            f"{kv_room // per_token}, a smaller --kv-type (f16, q8_0), or at least "
            f"--vram-budget {(fixed + ctx * per_token) / GIB + 0.01:.2f}")
    ctx_note = "--ctx"
    if ec.ctx is None:  # the model's context where its cache takes at most a quarter of the
        # room left, the rest kept for expert cache slots; never below the old default of 4096
        # tokens where those fit
        fit = max(kv_room, 0) // KV_SHARE // per_token
        ctx = min(cfg.context_length, max(fit, DEFAULT_CTX))
        ctx_note = ("the model's context" if ctx == cfg.context_length else
                    f"{'a quarter of the room' if ctx == fit else 'the default'}; the model's "
                    f"context is {cfg.context_length}")
    if ctx * per_token > kv_room:
        ctx = max(MIN_KV_TOKENS, kv_room // 2 // per_token)
        ctx_note = f"what the budget holds; the model's context is {cfg.context_length}"
    kv = ctx * kv_per_token
    steps += ctx * step_row
    fixed += ctx * step_row
    slots = _cache_slots(cfg, ec, layouts, budget - fixed - kv, borrow_cap)
    if ec.prefetch is None and prefetch and not prefetch_pays(
            [n for n, lay in zip(slots, layouts, strict=True) if n < cfg.n_experts
             and not lay.empty], cfg.n_experts_used):
        # --prefetch auto where the cache is large: off, and its rows go back to the cache
        fixed -= prefetch * max_stride
        staging_slots, staging, prefetch = cfg.n_experts_used, staging - prefetch * max_stride, 0
        slots = _cache_slots(cfg, ec, layouts, budget - fixed - kv, borrow_cap)
    if ring and ec.ring_bytes is None and ec.stream_min is None and all(
            n >= cfg.n_experts for n, lay in zip(slots, layouts, strict=True) if not lay.empty):
        # every expert has a slot: no pass misses one, so nothing streams (the ring's VRAM,
        # up to an eighth of the budget, stays with the driver)
        fixed, ring, borrow_cap = fixed - ring, 0, 0
        ring_note = "none: every expert has a cache slot, so nothing streams"
    else:
        ring_note = ""
    room = budget - fixed - kv
    cache = sum(n * lay.stride for n, lay in zip(slots, layouts, strict=True))
    if cache > room:
        raise StrataError(f"--expert-cache {ec.expert_cache}: {sum(slots)} slots need "
                          f"{fmt_bytes(cache)} but the budget leaves {fmt_bytes(room)}; "
                          "use fewer slots, auto, or a larger --vram-budget")
    arena = sum(cfg.n_experts * lay.stride for lay in layouts)
    avail = host_available()
    if arena > avail:
        raise StrataError(f"the expert arena needs {fmt_bytes(arena)} of host RAM but "
                          f"{fmt_bytes(avail)} is available; close other programs or use a "
                          "machine with more RAM")
    borrow = max(0, min(budget - fixed - kv - cache, borrow_cap)) // 256 * 256
    # prompt chunks replayed from CUDA graphs: their pool from what is left (never from the
    # cache: a plan whose experts do not all fit takes none)
    # (and with --spec, the verify windows' graphs beside them: chunk_graph.window_tokens)
    graphs, buckets, windows, graphs_note = plan_buckets(
        cfg, ec, layouts, slots, chunk, prompt_weights, budget - fixed - kv - cache - borrow)
    # and, for the prompt graphs (which take a plain cache), a scratch of up to
    # PREFILL_SCRATCH_ROWS rows that a served prompt runs in before its rows go into the pool:
    # from what is left, where there are prompt graphs (else it would serve nothing)
    prefill_rows = (min(chunk, PREFILL_SCRATCH_ROWS) if ec.sequences > 1 and dev.type == "cuda"
                    and ec.kernels == "fused" and buckets and not cfg.full_attn_interval
                    and not cfg.kv_lora else 0)
    prefill = prefill_rows * seq_row
    if prefill > budget - fixed - kv - cache - borrow - graphs:
        prefill_rows = prefill = 0
    pool += prefill
    lent, lent_ring = (), False
    if dev.type == "cuda" and ec.kernels == "fused" and ec.decode_step != "off" and \
            ec.expert_cache == "auto" and ec.sequences <= 1:
        # (one sequence only: a server's passes mix prompt chunks with decode steps, and each
        # change of kind would shrink and grow every lending layer's slots, a device copy of
        # the cache and a refill over PCIe each time)
        # with no --stream-min 1 no pass that lends streams, so the ring's VRAM is lent too
        lent_ring = (ec.stream_min or 2) >= 2
        lent = lend_slots(cfg, layouts, slots, workspace + (ring if lent_ring else 0))
        lent_ring = lent_ring and bool(lent)
    # (the plan's KV line: the --batch pool's bytes, blocks and scratch row included)
    return MemoryPlan(dev.type, budget, quant_dense, dense, kv + pool, ctx, workspace, staging,
                      staging_slots, ring, max(1, ec.sequences), slots, cache, arena, avail,
                      chunk, prompt_weights, borrow, ec.kv_type,
                      tuple(lay.stride for lay in layouts), prefetch, lent, lent_ring,
                      ring_note, ctx_note, context, prompt_graphs=graphs,
                      prompt_buckets=buckets, prompt_graphs_note=graphs_note,
                      window_graphs=windows, activations=activations, draft=draft,
                      draft_path=ec.draft if draft else "", prefill_rows=prefill_rows,
                      layer_tokens=span, batch_step=steps, batch_sizes=batch_sizes,
                      host_embed=host_embed)


def lend_slots(cfg: ModelConfig, layouts: list[ExpertLayout], slots: list[int],
               workspace: int) -> tuple[int, ...]:
    """Slots per layer `workspace` bytes hold while no pass needs them: only prompt chunks use
    the workspace (moe_grouped's scratch, dequantized intermediates) and, with one decoding
    sequence, the streaming ring (make_plan adds its bytes), so between them decode steps keep
    more experts in VRAM. A layer stays short of all its experts (a full layer would run without
    the host: the decode step is cut for the base slots). Each request pays for them (the lent
    slots refilled over PCIe after its prompt, the decode graphs captured again where the new
    tensors moved), so they are lent only where they add at least half the cache: on the H200
    (Qwen3-30B-A3B Q4_K_M, the workspace alone lent) decode went 43.7 -> 52.1 tok/s at 2 GiB
    (1 + 3 slots a layer), 43.9 -> 58.4 at 3 GiB (1 + 4.8), 59.4 -> 71.7 at 4 GiB (6 + 5.6),
    stayed at 107 at 6 GiB (16 + 9.6) and fell 201 -> 158 at 10 GiB (43 + 14)
    (bench/2026-11-30-h200-lend.md)."""
    full = [n >= cfg.n_experts or lay.empty for n, lay in zip(slots, layouts, strict=True)]
    if all(full):
        return ()
    extra = _cache_slots(cfg, EngineConfig(expert_cache="auto"), layouts, workspace, 0)
    lent = tuple(0 if f else max(0, min(x, cfg.n_experts - 1 - n))
                 for n, x, f in zip(slots, extra, full, strict=True))
    return lent if sum(lent) and 2 * sum(lent) >= sum(slots) else ()


def _cache_slots(cfg: ModelConfig, ec: EngineConfig, layouts: list[ExpertLayout], room: int,
                 borrow_cap: int) -> list[int]:
    """Expert cache slots per layer in `room` bytes (--expert-cache auto), or as given; none in
    a layer without experts (a dense first layer)."""
    per_layer_set = sum(lay.stride for lay in layouts)
    E = cfg.n_experts
    routed = [i for i, lay in enumerate(layouts) if not lay.empty]
    if ec.expert_cache == "auto":
        n = min(E, max(0, room // per_layer_set))
        slots = [0 if lay.empty else n for lay in layouts]
        # what a slot in every layer no longer fits goes to one more slot in some layers,
        # smallest records first (the most slots per byte), less what the ring may borrow (at
        # small budgets all of it; with a fixed --ring-bytes that VRAM is otherwise unused)
        spare = room - n * per_layer_set - borrow_cap
        by_size = sorted(routed, key=lambda i: (layouts[i].stride, i))
        for i in by_size if n < E else ():
            if layouts[i].stride > spare:
                break
            slots[i] += 1
            spare -= layouts[i].stride
    else:
        try:
            total = int(ec.expert_cache)
        except ValueError:
            raise StrataError(f"--expert-cache {ec.expert_cache}: give auto, 0 or a number of "
                              "slots") from None
        if total < 0:
            raise StrataError(f"--expert-cache {total}: must be >= 0")
        total, slots = min(total, E * len(routed)), [0] * cfg.n_layers
        for j, i in enumerate(routed):
            slots[i] = total // len(routed) + (j < total % len(routed))
    return slots

