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
import pytest
import torch

# cases whose kernels the CUDA tests run, or paths off by default, that make the CPU suite much
# longer under the interpreter: run with STRATA_ALL_TESTS=1 (make test leaves them out)
every_case = pytest.mark.skipif(not os.environ.get("STRATA_ALL_TESTS"),
                                reason="a long interpreter case: STRATA_ALL_TESTS=1 runs it")

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
    # The interpreter checks every int32 add / sub / mul for overflow (each widened to int64,
    # compared with both bounds and asserted): ~40% of a kernel test's time. At these tests'
    # small shapes an index cannot overflow, so make test leaves the check out; STRATA_ALL_TESTS=1
    # keeps it.
    if not os.environ.get("STRATA_ALL_TESTS"):
        import dataclasses
        interpreter.interpreter_builder.options = dataclasses.replace(
            interpreter.interpreter_builder.options, sanitize_overflow=False)

    # Each call of a @triton.jit helper inside a kernel patches triton.language again (every
    # builtin rewrapped, never restored: the launch's own patch is what ends it), ~20% of a
    # kernel test's time: a helper whose language modules the launch has patched skips it.
    import inspect
    import triton.language as tl
    _patch_lang, _live = interpreter._patch_lang, {"langs": None}
    def _patch_lang_once(fn):
        langs = {v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        live = _live["langs"]
        if live is not None and langs <= live:
            return interpreter._LangPatchScope()  # (nothing to patch, nothing to restore)
        scope = _patch_lang(fn)
        if live is None:  # a launch: its scope is restored when it ends
            _live["langs"], restore = set(langs), scope.restore
            def restore_and_forget():
                restore()
                _live["langs"] = None
            scope.restore = restore_and_forget
        else:
            live |= langs
        return scope
    interpreter._patch_lang = _patch_lang_once
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
    run_interpreted_side_by_side([body], seed, timeout)


def run_interpreted_side_by_side(bodies: list[str], seed: int, timeout: float) -> None:
    """run_interpreted for each of `bodies` (parts of one check, each independent of the
    others), in processes of their own at the same time: the interpreter runs on one core, and
    pytest leaves the others idle."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(body),
                               str(seed)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for body in bodies]
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0 and "ok" in out, \
                f"seed={seed} part {i}\n{out[-2000:]}\n{err[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
