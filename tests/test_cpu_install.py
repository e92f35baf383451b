"""A CPU-only install runs every model command: `pip install .` with no extras on a machine whose
torch wheel has no Triton (and no ggml-python or llama-cpp-python) must load, plan and run the
model on the CPU.

Each command runs in a subprocess whose sitecustomize makes `import triton`, `import ggml` and
`import llama_cpp` (and their submodules) raise ImportError, with no GPU visible to torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("triton", "ggml", "llama_cpp")

_SITECUSTOMIZE = f"""
import sys

class _Missing:
    '''As if {BLOCKED} were not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _Missing())
"""


@pytest.fixture(scope="module")
def cpu_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("no_triton")
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
               CUDA_VISIBLE_DEVICES="", STRATA_CACHE=str(site / "cache"))
    env.pop("TRITON_INTERPRET", None)
    return env


def _strata(env: dict[str, str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "strata", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"strata {' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def _first_log_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("strata: "))


def test_the_blocked_modules_do_not_import(cpu_env: dict[str, str]) -> None:
    """The hook works: each blocked module raises ImportError, and torch sees no GPU."""
    code = ("import importlib, torch\n"
            f"for m in {BLOCKED!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except ImportError:\n        continue\n"
            "    raise SystemExit(m + ' imported')\n"
            "assert not torch.cuda.is_available()\n")
    r = subprocess.run([sys.executable, "-c", code], env=cpu_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_model_commands_run_without_triton(synth, cpu_env: dict[str, str],
                                           tmp_path: Path) -> None:
    """info, logits, generate, check, bench and profile on a tiny synthetic model; each model
    command's first log line says the device --device auto picked (the CPU), and none of them
    loads Triton."""
    model = str(synth("qwen3moe", "Q4_K_M"))
    auto = "strata: device: cpu (--device auto: torch sees no GPU)"

    r = _strata(cpu_env, "info", model)
    assert "qwen3moe: 3 layers" in r.stdout

    out = tmp_path / "logits.npy"
    r = _strata(cpu_env, "logits", model, "--tokens", "1,2,3", "--out", str(out))
    assert _first_log_line(r.stderr) == auto
    arr = np.load(out)
    assert arr.shape[0] == 3 and np.isfinite(arr).all()

    r = _strata(cpu_env, "generate", model, "--prompt", "Once", "-n", "4", "--seed", "1")
    assert _first_log_line(r.stderr) == auto and r.stdout.startswith("Once")

    r = _strata(cpu_env, "check", model, "--b", "--offload on --expert-cache 2",
                "--prompt-len", "8", "--decode", "2")
    assert _first_log_line(r.stderr) == auto and "same within tolerance" in r.stdout

    r = _strata(cpu_env, "bench", model, "--prompt-len", "8", "--gen-len", "2", "--runs", "1")
    assert _first_log_line(r.stderr) == auto and "tok/s" in r.stderr

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nThe sky is blue")
    profile = tmp_path / "profile.json"
    r = _strata(cpu_env, "profile", model, "--prompts", str(prompts), "--out", str(profile))
    assert _first_log_line(r.stderr) == auto and profile.is_file()


def test_device_cpu_is_said_too(synth, cpu_env: dict[str, str], tmp_path: Path) -> None:
    """--device cpu given: the first log line says so."""
    out = tmp_path / "l.npy"
    r = _strata(cpu_env, "logits", str(synth()), "--tokens", "1,2", "--out", str(out),
                "--device", "cpu")
    assert _first_log_line(r.stderr) == "strata: device: cpu (--device cpu)"
