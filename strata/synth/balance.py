"""How evenly a model's routers spread tokens over the experts (a check on synthetic weights)."""

from __future__ import annotations

from pathlib import Path

import torch

from strata.config import ModelConfig
from strata.config_hybrid import ffn_norm_name
from strata.gguf import open_model
from strata.model.layers import rms_norm, route
from strata.model.weights import QuantTensor, dense


def routing_balance(path: Path, n_tokens: int = 512, seed: int = 0) -> str:
    """Route random tokens' embeddings through every layer's router (a stand-in for the real
    hidden states) and report the busiest and idlest expert's share of assignments."""
    mf = open_model(path)
    cfg = ModelConfig.from_model(mf)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.n_vocab, (n_tokens,), generator=g)
    x = QuantTensor.load(mf.tensors["token_embd.weight"], cpu).rows(ids)  # [T, D]
    shares = []
    for i in range(cfg.n_dense_lead, cfg.n_layers):  # (the routed layers)
        norm = dense(mf.tensors[f"blk.{i}.{ffn_norm_name(cfg)}.weight"], cpu)
        router = dense(mf.tensors[f"blk.{i}.ffn_gate_inp.weight"], cpu)
        chosen, _ = route(rms_norm(x, norm, cfg.rms_eps), router, cfg.n_experts_used,
                          cfg.norm_topk)
        counts = torch.bincount(chosen.flatten(), minlength=cfg.n_experts).float()
        shares.append(counts / counts.sum())
    s = torch.stack(shares)  # [L, E]
    unused = int((s == 0).sum())
    return (f"strata: routing balance over {len(shares)} layers, {n_tokens} random tokens: "
            f"busiest expert {100 * s.max():.1f}% of a layer's assignments, idlest "
            f"{100 * s.min():.2f}%, even would be {100 / cfg.n_experts:.2f}%; "
            f"{unused} of {s.numel()} experts unused")
