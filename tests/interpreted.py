"""Shared by the kernel tests: fresh seeds, a relative error, and running a script with the
Triton kernels on the CPU under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton
is imported, so the script runs in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

_PRELUDE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    from triton.runtime import interpreter

    # Triton 3.6's interpreter reads loop bounds with int() of a 1-element array, which NumPy 2.4
    # refuses; read them with .item() instead.
    _patch = interpreter._patch_lang_tensor
    def _patched(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))
    interpreter._patch_lang_tensor = _patched
    seed = int(sys.argv[1])
""")


def fresh_seed() -> int:
    """A new seed every run (printed by the tests when they fail)."""
    return int(np.random.SeedSequence().entropy % 2**63)


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = fresh_seed()
    return np.random.default_rng(seed), seed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def run_interpreted(body: str, seed: int, timeout: float) -> None:
    """Run `body` (indented source; `seed`, `np` and `sys` are defined) under the interpreter;
    it must print "ok"."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    script = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script, str(seed)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and "ok" in done.stdout, \
        f"seed={seed}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
