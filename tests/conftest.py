"""Shared fixtures: synthetic models written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory):
    """synth(arch, recipe, seed=0, **write_kwargs) -> path of a tiny synthetic model (cached)."""
    root = tmp_path_factory.mktemp("models")
    made: dict[tuple, Path] = {}
    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model

    def make(arch: str = "qwen3moe", recipe: str = "Q4_K_M", seed: int = 0, **kw) -> Path:
        key = (arch, recipe, seed, tuple(sorted(kw.items())))
        if key not in made:
            name = f"{arch}-{recipe.replace(',', '_').replace('=', '-').replace('*', 'x')}-{seed}"
            out = root / f"{name}-{len(made)}.gguf"
            write_model(out, get_preset("tiny", arch), Recipe(recipe), seed, **kw)
            made[key] = out
        return made[key]

    return make


def pytest_configure(config: pytest.Config) -> None:
    """STRATA_TUNING's overrides apply to the whole run (scripts/gpu_bench.sh's TUNING); text
    they could not be read from stops it before any test, naming the entry."""
    from strata.kernels import tuning

    if tuning.OVERRIDE_ERROR is not None:
        pytest.exit(str(tuning.OVERRIDE_ERROR), returncode=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    """Runs a test on the CPU, and on CUDA where there is a GPU."""
    return request.param


@pytest.fixture(autouse=True)
def _uncapped_allocator():
    """An engine loaded with --vram-budget on CUDA caps torch's allocator for the process
    (build.py): each test starts without the cap an earlier test's engine left."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(1.0, i)
    yield
