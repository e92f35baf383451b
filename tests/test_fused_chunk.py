"""A prompt chunk under --kernels fused (one segment): the residual steps' norms, the q/k norms,
RoPE and the cache store, and the routing's softmax and top k run on the fused decode kernels
(decode_ops.add_rms_norm, qk_rope_store, route_topk) over the chunk's T tokens. Under Triton's
interpreter on the CPU: the first layer's cache rows they store equal the reference path's (to
float32 rounding, or to the cache type's), and the logits stay within the bf16 flash
attention's rounding of the reference's."""

from __future__ import annotations

import pytest
from interpreted import fresh_seed, run_interpreted_side_by_side

pytest.importorskip("triton")

_CHUNK_INTERPRETED = """
    import tempfile
    from dataclasses import replace
    from pathlib import Path
    import torch
    from strata.engine.generator import Engine
    from strata.model.parts import Segment
    from strata.runtime.kv_cache import dequantize_q8_0
    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model
    import strata.model.parts.attention as attention

    calls = []
    chunk = attention.GQAAttention._chunk
    attention.GQAAttention._chunk = lambda self, *a: calls.append(a[0].shape[0]) or chunk(self, *a)
    tokens = [5, 311, 17, 902, 64, 64, 9, 400, 3, 77, 21]  # a chunk of 8 (bf16 attention), then 3

    def rows(kv):
        if kv.quantized:
            return torch.stack([dequantize_q8_0(kv.store[j], kv.scales[j]) for j in range(2)])
        return kv.store.float()

    with tempfile.TemporaryDirectory() as tmp:
        for arch, kv_type in CASES:
            path = Path(tmp) / f"{arch}.gguf"
            if not path.exists():
                preset = get_preset("tiny", arch.removesuffix("-yarn"))
                if arch.endswith("-yarn"):  # (YaRN's table; its scale in the q/k norms)
                    preset = replace(preset, yarn_factor=4.0, yarn_orig_ctx=8)
                if arch == "gpt-oss":  # (sinks; a window of 4 that the 8-token chunk passes)
                    preset = replace(preset, sliding_window=4)
                write_model(path, preset, Recipe("Q8_0"), 0)
            engine = Engine.load(path)
            model = engine.model
            model.kv_dtype = {"f32": torch.float32, "f16": torch.float16,
                              "q8_0": torch.int8}[kv_type]
            out = {}
            for fused in (False, True):
                model.fused_attention = fused
                kv = model.new_cache(len(tokens))
                a = model.forward(torch.tensor(tokens[:8]), [Segment(kv, 8)], all_logits=True)
                b = model.forward(torch.tensor(tokens[8:]), [Segment(kv, 3)], all_logits=True)
                out[fused] = torch.cat([a, b]), rows(kv)[:, :, :len(tokens)]
            n_attn = sum(not model.cfg.is_linear(i) for i in range(model.cfg.n_layers))
            assert calls[-2 * n_attn:] == [8] * n_attn + [3] * n_attn, calls
            (ref, ref_rows), (ours, our_rows) = out[False], out[True]
            # the first layer's rows (its input is the embeddings, the same on both paths;
            # later layers see the bf16 attention's rounding): stored by qk_rope_store where the
            # reference stored its own, rounded to the cache's type from float32 values that
            # differ by float32 rounding (qwen35moe's first layers are linear: the KL only)
            err = 0.0
            if arch.startswith("qwen3moe"):
                tol = {"f32": 1e-6, "f16": 1e-3, "q8_0": 1e-2}[kv_type]
                first, mine = ref_rows[:, 0], our_rows[:, 0]
                err = float((mine - first).abs().max() / first.abs().max())
                assert err < tol, (arch, kv_type, err)
            # the logits: the chunk of 8 attends on bf16 (flash attention's rounding); the 3
            # tokens on the decode kernel, exact in float32 over the same rows
            p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
            kl = float((p.exp() * (p - q)).sum(-1).max())
            assert kl < 2e-3, (arch, kv_type, kl)
            print(arch, kv_type, f"rows {err:.1e}", f"KL {kl:.1e}")
    print("ok")
"""


def test_fused_chunk_path_stores_the_reference_rows():
    # (two processes side by side: the interpreter runs on one core each)
    halves = ([("qwen3moe", "f32"), ("qwen35moe", "f32"), ("gpt-oss", "f16")],
              [("qwen3moe", "f16"),
                                                            ("qwen3moe", "q8_0"),
                                                            ("qwen3moe-yarn", "f32")])
    run_interpreted_side_by_side([f"\n    CASES = {h!r}" + _CHUNK_INTERPRETED for h in halves],
                                 fresh_seed(), timeout=600)
