"""CPU kernels for the miss path: a layer's missed experts computed from their GGUF blocks.

    experts = make_cpu_experts("auto", threads=8)   # "ggml", "torch" or "auto"
    experts.run(h, jobs, out)                       # out[T, D] += Σ weight * expert(h[tokens])

    jobs.py           ExpertJob, the CpuExperts interface, the float32 reference
    ggml_experts.py   ggml backend (ggml-python): one graph call per layer, persistent threads
    ggml_graph.py     the reusable ggml graph (mul_mat_id over experts where they lie)
    ggml_lib.py       ggml-python plumbing: type support, thread pool, contexts
    torch_experts.py  torch backend: dequantize (strata.quant) + batched matmuls; the fallback

docs/cpu_kernels.md has the design, the tolerances and the measured speeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from strata.kernels.cpu.jobs import CpuExperts, ExpertJob, reference_run

log = logging.getLogger("strata.kernels")


def _ggml(threads: int | None) -> CpuExperts:
    from strata.kernels.cpu.ggml_experts import GgmlExperts

    return GgmlExperts(threads)


def _torch(threads: int | None) -> CpuExperts:
    from strata.kernels.cpu.torch_experts import TorchExperts

    return TorchExperts(threads)


BACKENDS: dict[str, Callable[[int | None], CpuExperts]] = {"ggml": _ggml, "torch": _torch}


def ggml_available() -> bool:
    try:
        import strata.kernels.cpu.ggml_lib  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def make_cpu_experts(kind: str = "auto", threads: int | None = None) -> CpuExperts:
    """A CPU expert backend. "auto" takes ggml when ggml-python imports, else torch."""
    if kind == "auto":
        kind = "ggml" if ggml_available() else "torch"
        reason = "ggml-python not installed"
        if kind == "ggml":
            from strata.kernels.cpu.ggml_lib import cpu_features

            reason = f"ggml-python found, built with {', '.join(cpu_features()) or 'no SIMD'}"
        log.info("cpu experts: %s backend (%s)", kind, reason)
    if kind not in BACKENDS:
        raise ValueError(f"unknown CPU expert backend {kind!r} (choose from auto, "
                         f"{', '.join(BACKENDS)})")
    return BACKENDS[kind](threads)


__all__ = ["BACKENDS", "CpuExperts", "ExpertJob", "ggml_available", "make_cpu_experts",
           "reference_run"]
