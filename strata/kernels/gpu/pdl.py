"""Programmatic dependent launch (sm_90 and later) for the kernels of a decode step.

A decode token is ~500 small kernels in a row, each a few microseconds long, so the time a
kernel takes to get its CTAs onto the SMs after the one before it ends adds up. Launched with
`launch_pdl`, a kernel starts while the one before it finishes: its CTAs call `wait` before
their first read or write of anything an earlier kernel may touch (`griddepcontrol.wait` returns
once the kernel before has completed and its memory is visible), and signal that the next kernel
may launch once every CTA of this one is running (`griddepcontrol.launch_dependents`). A kernel
may read what no kernel writes (a dense GEMV's weights) before it waits.

    kernel[grid](..., **pdl.options(x))       # {"PDL": True, "launch_pdl": True} on sm_90+
    pdl.wait(PDL)                             # in the kernel, before reading a predecessor's output

A kernel launched without the attribute waits for the whole of the one before, as usual, so the
launches that are not Triton kernels of this package (torch ops, copies) need nothing. CUDA graphs
capture the attribute as a programmatic edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # scripts/profile_decode.py --no-pdl times the step without it

_CAPABLE: dict[int, bool] = {}


def options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose tensors are on t's device: the PDL constexpr and, on
    CUDA devices of compute capability 9 or more, the launch attribute."""
    on = ENABLED and t.is_cuda and not knobs.runtime.interpret and _capable(t.device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


@triton.jit
def wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the one before (no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
