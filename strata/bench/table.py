"""strata bench's matrix of tests (llama-bench's -p, -n, -d) and its markdown table: llama-bench's
columns (model, size, params, backend, test, t/s as median ± standard deviation) and Strata's own
(expert hit rate, VRAM peak against --vram-budget, the depth)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gguf import LlamaFileType

from strata.bench.runner import BenchResult, llama_name
from strata.gguf.model_file import open_model


@dataclass(frozen=True)
class Cell:
    """One test on a fresh KV cache: depth random tokens (untimed), then prompt_len random
    tokens and gen_len decode steps (timed)."""

    prompt_len: int
    gen_len: int
    name: str
    depth: int = 0


def matrix(prompts: list[int], gen: int, depths: list[int]) -> list[Cell]:
    """llama-bench's matrix in its order: at each depth D (the KV cache first filled with D
    random tokens, untimed), every ppN (N more prompt tokens timed), then tgN (N decode steps
    timed): pp512, tg64, pp512 @ d4096, tg64 @ d4096."""
    cells = []
    for d in depths:
        cells += [Cell(p, 0, llama_name(p, 0, d), d) for p in prompts if p > 0]
        if gen > 0:
            cells.append(Cell(0, gen, llama_name(0, gen, d), d))
    return cells


@dataclass(frozen=True)
class ModelInfo:
    label: str  # arch, parameters, file type (as llama-bench names the model): "qwen3moe 30.53B
    # Q4_K_M"; without general.file_type the tensor type holding most bytes
    size_gib: float
    params: int

    def to_dict(self) -> dict:
        return {"label": self.label, "size_gib": self.size_gib, "params": self.params}


def model_info(path: str | Path) -> ModelInfo:
    mf = open_model(path)
    params = sum(math.prod(t.info.shape) for t in mf.tensors.values())
    by_type: Counter[str] = Counter()
    for t in mf.tensors.values():
        by_type[t.info.type_name] += t.info.nbytes
    arch = mf.metadata.get("general.architecture", "?")
    qtype = by_type.most_common(1)[0][0] if by_type else "?"
    try:
        qtype = LlamaFileType(int(mf.metadata["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError, TypeError):
        pass
    return ModelInfo(f"{arch} {_count(params)} {qtype}", mf.nbytes / 2**30, params)


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def rows(results: list[BenchResult]) -> list[dict]:
    """One row per timed figure: a ppN test's prompt, a tgN test's decode steps (a test that
    times both, the older --prompt-len P --gen-len N, gives both rows: pp128, tg64 @ d128),
    each with llama-bench's n_prompt, n_gen and n_depth (the KV cache tokens before it)."""
    out = []
    for r in results:
        budget = r.config.get("vram_budget_gib")
        # (the table's peak: what torch's allocator held, its cache of freed blocks included,
        # nearer nvidia-smi's than the live tensors' peak)
        common = {"budget_gib": budget, "vram_peak_gib": r.vram_peak_gib,
                  "vram_held_gib": r.vram_reserved_peak_gib}
        if r.prompt_len and r.prompt_tok_s is not None:
            out.append({"test": llama_name(r.prompt_len, 0, r.n_depth), "tok_s": r.prompt_tok_s,
                        "std": r.prompt_tok_s_std, "hit_rate": None, **common,
                        "n_prompt": r.prompt_len, "n_gen": 0, "n_depth": r.n_depth})
        if r.gen_len:
            out.append({"test": llama_name(0, r.gen_len, r.depth), "tok_s": r.decode_tok_s,
                        "std": r.decode_tok_s_std, "hit_rate": r.hit_rate, **common,
                        "n_prompt": 0, "n_gen": r.gen_len, "n_depth": r.depth})
    return out


def markdown(info: ModelInfo, backend: str, table: list[dict]) -> str:
    # (VRAM peak: what torch's allocator held at most, live tensors and its cached blocks)
    head = ["model", "size", "params", "backend", "test", "t/s", "hit rate", "VRAM peak / budget",
            "depth"]
    lines = ["| " + " | ".join(head) + " |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in table:
        hit = f"{100 * row['hit_rate']:.1f}%" if row["hit_rate"] is not None else "-"
        peak = "-"  # no VRAM on the CPU
        gib = row.get("vram_held_gib") or row["vram_peak_gib"]
        if gib is not None:
            budget = f"{row['budget_gib']:g} GiB" if row["budget_gib"] else "free VRAM"
            peak = f"{gib:.2f} GiB / {budget}"
        size = (f"{info.size_gib:.2f} GiB" if info.size_gib >= 1
                else f"{info.size_gib * 1024:.2f} MiB")
        cells = [info.label, size, _count(info.params), backend, row["test"],
                 f"{row['tok_s']:.2f} ± {row['std']:.2f}", hit, peak, str(row["n_depth"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
