"""Load a model and generate: the plain loop (prefill -> decode steps -> sample -> stop)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from strata.config import EngineConfig, ModelConfig
from strata.engine.build import build_model
from strata.engine.memory_plan import auto_chunk
from strata.engine.sampling import SamplingParams, sample
from strata.errors import StrataError
from strata.gguf import open_model
from strata.kernels.tuning import REFERENCE_CACHE_BYTES
from strata.model.transformer import MoETransformer, Segment
from strata.progress import Meter
from strata.runtime.kv_cache import KVCache
from strata.runtime.waits import PROGRESS
from strata.tokenizer import ChatTemplate, Tokenizer

log = logging.getLogger("strata")

PREFILL_ORDERS = ("auto", "layers", "chunks")  # --prefill-order (Engine.layer_major)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0  # forward passes after the prompt's
    prompt_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    decode_tokens: int = 0  # tokens sampled after the first (a verify window gives several)
    spec: object | None = None  # SpecStats (strata.engine.spec) with --spec

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def resolve_device(name: str) -> torch.device:
    """The torch device of --device cpu|cuda|cuda:N; a CUDA one becomes the current device, so
    that the engine's own "cuda" tensors and streams land on it too."""
    if name != "cpu" and name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise StrataError(f"--device {name}: choose cpu, cuda or cuda:N")
    if name == "cpu":
        return torch.device(name)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise StrataError(f"--device {name}: no CUDA device is available (torch sees none); "
                          "use --device cpu")
    dev = torch.device(name)
    if dev.index is not None and dev.index >= n:
        raise StrataError(f"--device {name}: no such device; torch sees {n} (cuda:0..cuda:{n - 1})")
    if dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def cpu_offload(ec: EngineConfig, mf: Any, dev: torch.device) -> EngineConfig:
    """--offload auto on the CPU: the offload runtime (experts read in their GGUF blocks by
    ggml's quantized kernels) where ggml-python is there and the model's experts in float32 pass
    what the reference executor keeps (REFERENCE_CACHE_BYTES: past it, every step dequantizes
    its experts again), else the reference path. On 2 vCPUs two layers of Qwen3-30B-A3B's
    shape ran prompt 64 / decode at 33 / 5.4 tok/s on the reference path against 192 / 11.8 on
    ggml's; the demo model (its experts kept) 2,972 / 103 against 1,508 / 85; the torch CPU
    kernels 16 / 2.9 (bench/2026-12-05-cpu-serve.md)."""
    if ec.offload != "auto" or dev.type != "cpu" or ec.cpu_kernels == "torch":
        return ec
    f32 = sum(4 * math.prod(ref.info.shape) for name, ref in mf.tensors.items()
              if "_exps." in name)
    if f32 <= REFERENCE_CACHE_BYTES:
        return ec
    from strata.kernels.cpu import ggml_available

    if not ggml_available():
        log.info("offload: off (auto on the CPU: the experts are %.1f GiB in float32, past the "
                 "reference's %.0f GiB kept, but ggml-python is not installed: pip install "
                 "'strata[cpu]' for its quantized kernels)", f32 / 2**30,
                 REFERENCE_CACHE_BYTES / 2**30)
        return ec
    log.info("offload: on (auto on the CPU: the experts are %.1f GiB in float32, past the "
             "reference's %.0f GiB kept; ggml's kernels read their GGUF blocks)", f32 / 2**30,
             REFERENCE_CACHE_BYTES / 2**30)
    return replace(ec, offload="on")


@dataclass
class Engine:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    chat: ChatTemplate
    model: MoETransformer
    load_s: float
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    stats: GenerationStats = field(default_factory=GenerationStats)
    spec: object | None = None  # a SpecDecoder (strata.engine.spec) with --spec T
    show_progress: bool = False  # a long prompt's tokens done / total on stderr (the CLI's)

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", config: EngineConfig | None = None,
             progress: Callable[[str, float], None] | None = None) -> Engine:
        """progress(stage, fraction of the load) is called as each stage begins."""
        t0 = time.perf_counter()
        say = progress or (lambda stage, fraction: None)
        ec = config or EngineConfig(device=device)
        dev = resolve_device(ec.device)
        say("reading the model file", 0.0)
        mf = open_model(path)
        cfg = ModelConfig.from_model(mf, dense=ec.beside_target)  # (a dense model: a --draft)
        ec = cpu_offload(ec, mf, dev)
        say("tokenizer and chat template", 0.05)
        tok = Tokenizer.from_metadata(mf.metadata, source=str(mf.path))
        chat = ChatTemplate.from_metadata(mf.metadata, tok, source=str(mf.path))
        say("weights" + (" and the expert arena" if ec.use_offload else ""), 0.1)
        model = build_model(mf, cfg, ec, dev)
        spec = None
        if ec.spec:
            say("the draft for --spec", 0.95)
            from strata.engine.spec import make_spec

            spec = make_spec(ec, mf, cfg, model,
                             lambda path, config: Engine.load(path, config=config))
        say("ready", 1.0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # (loading's float32 pieces back to the driver: not held)
        return cls(mf.path, cfg, tok, chat, model, time.perf_counter() - t0, ec, spec=spec)

    def check_prompt(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise StrataError("the prompt is empty")
        if len(ids) + max_tokens > self.config.context_length:
            raise StrataError(f"prompt of {len(ids)} tokens + {max_tokens} to generate exceeds the "
                              f"model's context of {self.config.context_length} tokens")
        limit = self.model.kv_limit
        if limit is not None and len(ids) + max_tokens > limit:
            raise StrataError(f"prompt of {len(ids)} tokens + {max_tokens} to generate exceeds "
                              f"the KV cache the memory plan holds ({limit} tokens: --ctx, "
                              f"within --vram-budget)")

    def prefill_chunk(self, n_prompt: int) -> int:
        """Tokens per prompt chunk: --prefill auto|auto:N|N|off. auto: what the memory plan
        allows (auto_chunk), at most 4096: larger chunks copy each streamed expert fewer times
        per prompt."""
        spec = self.engine_config.prefill
        if spec == "off":
            return max(n_prompt, 1)
        auto = self.model.max_chunk or auto_chunk(self.config,
                                                  self.engine_config.workspace_mib << 20)
        try:
            if spec == "auto":
                return auto
            n = int(spec[5:]) if spec.startswith("auto:") else int(spec)
            if spec.startswith("auto:") and n >= 1:
                return min(auto, n)
        except ValueError:
            n = 0
        if n < 1:
            raise StrataError(f"--prefill {spec}: give auto, auto:N, a number of tokens >= 1, "
                              "or off")
        return n

    def layer_major(self, n_prompt: int, chunk: int, kv: KVCache) -> bool:
        """Whether a prompt of n_prompt tokens runs layer by layer (strata.model.layer_major):
        --prefill-order layers, or auto where some layer's experts stream through the ring for
        it (each streamed expert is then copied once a prompt, not once a chunk); only a
        prompt of several chunks, on a cache that is not paged."""
        order = self.engine_config.prefill_order
        if order not in PREFILL_ORDERS:
            raise StrataError(f"--prefill-order {order}: choose {', '.join(PREFILL_ORDERS)}")
        span = self.model.layer_tokens  # (None: unbounded; spans of whole chunks, two at least)
        if (n_prompt <= chunk or order == "chunks" or getattr(kv, "paged", False)
                or (span is not None and span < 2 * chunk)):
            return False
        streams = getattr(self.model.experts, "streams", None)
        return order == "layers" or (streams is not None and streams(n_prompt))

    def run_prompt(self, ids: list[int], kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """The prompt in chunks through the model, appending to kv: each chunk through every
        layer, or every chunk through each layer in turn (layer_major). Returns the last
        position's logits [1, V], or every position's [n, V] with all_logits."""
        chunk = self.prefill_chunk(len(ids))
        meter = Meter("prompt", len(ids), "tokens") if self.show_progress else None
        out = []
        try:
            # layer by layer: in spans of what the memory plan holds so (model.layer_tokens)
            layered = self.layer_major(len(ids), chunk, kv)
            span = self.model.layer_tokens
            step = (chunk if not layered else len(ids) if span is None
                    else span // chunk * chunk)
            for c, start in enumerate(range(0, len(ids), step)):
                part = ids[start:start + step]
                PROGRESS.at("prompt", chunk=c, position=kv.length)
                marks = meter.layers(start, len(part), len(self.model.layers)) if meter else None
                tokens = torch.tensor(part)
                out.append(self.model.forward_layers(tokens, kv, chunk, all_logits, marks)
                           if layered else
                           self.model.forward(tokens, [Segment(kv, len(part))],
                                              all_logits=all_logits, marks=marks))
                PROGRESS.steps += 1
                if meter is not None:
                    meter.update(start + len(part))
        except BaseException:  # (Ctrl-C in `strata chat`: the bar goes, the chat goes on)
            if meter is not None:
                meter.erase()
            raise
        if meter is not None:
            meter.close()
        return torch.cat(out) if all_logits else out[-1]

    def generate(self, prompt: list[int], params: SamplingParams,
                 kv: KVCache | None = None, constraint: Any = None) -> Iterator[int]:
        """Yield generated token ids until a stop token or max_tokens; fills self.stats.

        kv: a cache that already holds the prompt's first kv.length tokens (a chat's earlier
        turns): only the rest run (stats.prompt_tokens counts those); it grows by every token
        run, so after the answer it holds the prompt and the answer but its last token.
        constraint: a grammar (engine/constrain.py) that every token follows."""
        self.check_prompt(prompt, params.max_tokens)
        if kv is not None and not kv.length < len(prompt):
            raise ValueError(f"the cache holds {kv.length} tokens: at least one of the "
                             f"{len(prompt)} of the prompt must run")
        done = 0 if kv is None else kv.length
        st = self.stats = GenerationStats(prompt_tokens=len(prompt) - done,
                                          finish_reason="length")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        if kv is None:
            kv = self.model.new_cache(len(prompt) + params.max_tokens)
        t0 = time.perf_counter()
        logits = self.run_prompt(prompt[done:], kv)[0]
        if self.spec is not None and params.max_tokens:
            yield from self._generate_spec(prompt, params, kv, gen, logits, t0, constraint)
            return
        token = -1
        for i in range(params.max_tokens):
            if i:
                PROGRESS.at("decode", position=kv.length)
                logits = self.model.decode(token, kv)[0]
                PROGRESS.steps += 1
            token = sample(logits if constraint is None else constraint.mask(logits), params, gen)
            if constraint is not None:
                constraint.accept(token)
            now = time.perf_counter()
            if i == 0:
                st.prompt_s = now - t0
            else:
                st.decode_s += now - t0
                st.decode_steps += 1
                st.decode_tokens += 1
            t0 = now
            if token in self.tokenizer.stop_ids:
                st.finish_reason = "stop"
                return
            st.generated_tokens += 1
            yield token

    def _generate_spec(self, prompt: list[int], params: SamplingParams, kv: KVCache,
                       gen: torch.Generator | None, logits: torch.Tensor,
                       t0: float, constraint: Any = None) -> Iterator[int]:
        """generate's loop through verify windows (strata.engine.spec): each step gives one
        token or several (with a grammar, every row masked: SpecDecoder.step)."""
        from strata.engine.spec import rollback

        st, spec = self.stats, self.spec
        spec.reset()
        st.spec = spec.stats
        context = list(prompt)
        tokens = [sample(logits if constraint is None else constraint.mask(logits), params, gen)]
        if constraint is not None:
            constraint.accept(tokens[0])
        st.prompt_s = time.perf_counter() - t0
        while True:
            for token in tokens:
                if token in self.tokenizer.stop_ids:
                    st.finish_reason = "stop"
                    # as the plain loop leaves it: drafts after the stop token are dropped too
                    rollback(self.model, kv, len(context))
                    return
                st.generated_tokens += 1
                context.append(token)
                yield token
                if st.generated_tokens == params.max_tokens:
                    return
            t0 = time.perf_counter()
            PROGRESS.at("decode", position=kv.length)
            tokens = spec.step(context, kv, params, gen, params.max_tokens - st.generated_tokens,
                               constraint)
            PROGRESS.steps += 1
            st.decode_s += time.perf_counter() - t0
            st.decode_steps += 1
            st.decode_tokens += len(tokens)
