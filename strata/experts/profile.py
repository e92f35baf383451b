"""Routing profiles: how often each (layer, expert) is routed to, recorded by `strata profile`
and used to seed the cache (`--expert-profile P`, `--cache-policy profile`).

The file is JSON: {"model": name, "n_layers": L, "n_experts": E, "tokens": N, "counts": [[...]]}.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from strata.config import ModelConfig
from strata.errors import StrataError


def save_profile(path: str | Path, model: str, counts: np.ndarray, tokens: int) -> None:
    L, E = counts.shape
    data = {"model": model, "n_layers": L, "n_experts": E, "tokens": tokens,
            "counts": counts.astype(int).tolist()}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def load_profile(path: str | Path, cfg: ModelConfig) -> np.ndarray:
    """Routing frequency [L, E], each layer summing to 1."""
    try:
        data = json.loads(Path(path).read_text())
        counts = np.asarray(data["counts"], dtype=np.float64)
    except FileNotFoundError:
        raise StrataError(f"--expert-profile {path}: no such file") from None
    except (ValueError, KeyError, TypeError) as e:
        raise StrataError(f"--expert-profile {path}: not a routing profile ({e})") from None
    if counts.shape != (cfg.n_layers, cfg.n_experts):
        raise StrataError(f"--expert-profile {path}: made for {counts.shape[0]} layers x "
                          f"{counts.shape[1] if counts.ndim == 2 else '?'} experts, the model has "
                          f"{cfg.n_layers} x {cfg.n_experts}")
    return counts / np.maximum(counts.sum(1, keepdims=True), 1)
