"""Decode attention (decode_ops.decode_attention: split kernel + reduce) by split kernel variant,
model shape, cache type, new tokens and length: microseconds a call and GB/s of the K and V rows
it reads (q8_0: with their scales), against the HBM copy ceiling measured in the same run.

Shapes: Qwen3-30B-A3B (H 32, Hkv 4, hd 128), gpt-oss-20b's full-attention layers (H 64, Hkv 8,
hd 64, with sinks), Qwen3.6-35B-A3B's full-attention layers (H 16, Hkv 2, hd 256). Every cache
has the capacity --capacity (S = attention_splits(capacity, Hkv), as a decode step's planned
context fixes it); each timed call reads a copy of its own (--copies), so lengths whose K and V
fit the L2 are not read from it. Calls are captured in a CUDA graph (graph_seconds). Each row
also names the variant the launch picks (decode_ops.attention_variant) for --kernels exact and
fused.

    python scripts/bench_attention.py [--json OUT] [--warm N] [--shapes 30b,gpt-oss]
        [--lengths 512,4096] [--caches f32,q8_0] [--tokens 1,4] [--variants fma,tf32]
        [--tiles fma:8:16:3:16:16,ieee:16:64:3:8]

--tiles times other tiles beside the variants' own (decode_ops.AttnLaunch: variant, rows a
CTA, keys a step, stages, warps[, fma's DC]), each a row of its own named by its spec; a tile
that does not build or fit is reported and skipped.

--field sdpa,flex times the field's kernels beside them on the same rows (T new tokens over
a cache's first `length` rows, f32 / f16 caches; q8_0 has no such form): "sdpa" torch's
scaled_dot_product_attention with enable_gqa (flash / cuDNN / efficient, whichever torch picks
for the case), "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math" that backend alone
(one that cannot run the case is reported and skipped), "flex" torch's FlexAttention
(torch.compile'd once a shape), each over K and V laid out as they take them ([1, Hkv, rows,
hd], each head's rows contiguous, copied once a case, outside the timing) and timed with CUDA
events over a loop of calls (not captured in a graph: a compiled FlexAttention may not be), so
their figures include launch overhead the graph-timed rows do not; their error is against the
ieee variant's as for the rest.

--mla times MLA's absorbed decode instead (latent_ops.latent_attention, one token over a latent
cache of --capacity rows [L 512 + R 64]: DeepSeek-V3's 128 heads and Kimi-K2's 64, f32 / f16 /
bf16 rows): "exact" and "tf32" the split kernel's two tiles, "torch" the torch form over every
stored row, masked (what the decode step ran before the kernel); GB/s of the rows below the
length, err against the torch form on the same inputs. --caches, --lengths, --shapes (among
MLA_SHAPES) and --splits apply; --tokens, --variants, --tiles and --field do not.

--warm N (default: min(8, CPUs / 2)) first runs the cases once in N processes at once, so that
Triton's cache on disk holds every kernel before the timed pass (kernel builds dominate a cold
run: ~100 of them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.bench.ceilings import hbm_copy_gbs  # noqa: E402
from strata.bench.graph_timing import graph_seconds  # noqa: E402
from strata.kernels.gpu import decode_ops as ops  # noqa: E402
from strata.kernels.gpu import latent_ops  # noqa: E402
from strata.runtime.kv_cache import quantize_q8_0  # noqa: E402

# name -> (H, Hkv, hd, sinks)
SHAPES = {"30b-a3b": (32, 4, 128, False), "gpt-oss-20b": (64, 8, 64, True),
          "qwen3.6-35b-a3b": (16, 2, 256, False)}
CACHES = {"f32": torch.float32, "f16": torch.float16, "q8_0": torch.int8}
LENGTHS = (512, 4096, 16384, 32768)
# MLA: name -> (H, L kv_lora, R rope dims); the forms latent_attention runs
MLA_SHAPES = {"deepseek-v3": (128, 512, 64), "kimi-k2": (64, 512, 64)}
MLA_FORMS = ("exact", "tf32", "torch")
LATENT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def kv_bytes(n: int, hkv: int, hd: int, cache: str) -> int:
    """Bytes of K and V rows (and q8_0's float16 scales) that n keys take."""
    per = {"f32": 4 * hd, "f16": 2 * hd, "q8_0": hd + 2 * (hd // 32)}[cache]
    return 2 * n * hkv * per


def make_caches(copies: int, cap: int, hkv: int, hd: int, cache: str,
                dev: torch.device) -> list[tuple]:
    """(k, v, k_scales, v_scales) per copy, every row random (the kernels read only < length)."""
    out = []
    for _ in range(copies):
        k, v = (torch.randn(cap, hkv, hd, device=dev) for _ in range(2))
        if cache == "q8_0":
            (kq, ks), (vq, vs) = quantize_q8_0(k), quantize_q8_0(v)
            out.append((kq, vq, ks, vs))
        else:
            out.append((k.to(CACHES[cache]), v.to(CACHES[cache]), None, None))
        del k, v
    return out


def cases(a: argparse.Namespace) -> list[tuple]:
    return [(shape, cache, t, n, variant)
            for shape in a.shapes for cache in a.caches for t in a.tokens for n in a.lengths
            for variant in a.variants + a.tiles
            + ([f for f in a.field] if cache != "q8_0" else [])]


# sdpa: whichever backend torch picks; sdpa-B: that backend alone (torch.nn.attention's
# SDPBackend), a case it cannot run reported and skipped
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                 "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-math": "MATH"}
FIELD = ("sdpa", *SDPA_BACKENDS, "flex")


def field_layout(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's first n rows [C, Hkv, hd] as the field's kernels take them: [1, Hkv, n, hd],
    each head's rows contiguous (made once a case, outside the timed calls)."""
    return (k[:n].transpose(0, 1).contiguous()[None], v[:n].transpose(0, 1).contiguous()[None])


def field_call(kind: str, h: int, hkv: int, t: int, n: int, hd: int, sinks: torch.Tensor | None,
               device: str = "cuda"):
    """fn(q [T, H, hd] f32, k, v [1, Hkv, n, hd] (field_layout)) -> [T, H*hd]: the field's
    kernel over the n rows in the cache's type (q cast to it), causal for the T new tokens (the
    last T rows)."""
    if sinks is not None:
        raise ValueError("no sinks in the field's forms here")
    if kind.startswith("sdpa"):
        from contextlib import nullcontext

        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        only = SDPA_BACKENDS.get(kind)
        scope = (lambda: sdpa_kernel(getattr(SDPBackend, only))) if only else nullcontext

        def run(q, kb, vb):  # noqa: ANN001, ANN202
            qb = q.to(kb.dtype).transpose(0, 1)[None]  # [1, H, T, hd]
            mask = causal_lower_right(t, n) if t > 1 else None
            with scope():
                o = torch.nn.functional.scaled_dot_product_attention(
                    qb, kb, vb, attn_mask=mask, scale=hd ** -0.5, enable_gqa=True)
            return o[0].transpose(0, 1).reshape(t, h * hd).float()

        return run
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    block = None
    if t > 1:
        def causal(b, hh, qi, ki):  # noqa: ANN001, ANN202
            return ki <= qi + (n - t)

        block = create_block_mask(causal, None, None, t, n, device=device)

    def run(q, kb, vb):  # noqa: ANN001, ANN202
        qb = q.to(kb.dtype).transpose(0, 1)[None]
        o = flex(qb, kb, vb, block_mask=block, scale=hd ** -0.5, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(t, h * hd).float()

    return run


def event_seconds(fn, calls: int, reps: int = 5) -> float:  # noqa: ANN001
    """Median seconds of one call of fn(0) .. fn(calls - 1), run in a loop (not a graph)."""
    import statistics

    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(calls):
            fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def parse_tile(spec: str) -> ops.AttnLaunch:
    """variant:block_m:block_n:stages:warps[:dc] -> the launch's tile."""
    v, *nums = spec.split(":")
    return ops.AttnLaunch(v, *map(int, nums))


def mla_rows(a: argparse.Namespace, res: dict, shapes: list[str], timed: bool,
             dev: torch.device) -> None:
    """--mla: each (shape, cache type, length, form) timed over --copies caches in one graph,
    printed and added to res["rows"]."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in shapes:
        h, lat, rope = MLA_SHAPES[shape]
        for cache in [c for c in a.caches if c in LATENT]:
            stores = [torch.randn(a.capacity, lat + rope, device=dev, generator=gen)
                      .to(LATENT[cache]) for _ in range(a.copies if timed else 1)]
            q_lat = torch.randn(1, h, lat, device=dev, generator=gen) * lat ** -0.25
            q_pe = torch.randn(1, h, rope, device=dev, generator=gen) * rope ** -0.25
            for n in a.lengths:
                length = torch.full((1,), n, dtype=torch.int64, device=dev)
                ref = latent_ops._latent_torch(q_lat, q_pe, stores[0], length, 0.1, None)
                for form in MLA_FORMS:
                    call = mla_call(form, q_lat, q_pe, stores, length, a.splits)
                    if not timed:
                        call(0)
                        continue
                    us = graph_seconds(call, calls=2 * len(stores), reps=5) * 1e6
                    gbs = n * (lat + rope) * stores[0].element_size() / us / 1e3
                    err = float((call(0) - ref).abs().max() / ref.abs().max())
                    res["rows"].append(dict(shape=shape, H=h, L=lat, R=rope, cache=cache,
                                            length=n, form=form, us=round(us, 2),
                                            GBs=round(gbs, 1), err_vs_torch=err))
                    print(f"{shape:12} {cache:5} {n:6} {form:5} {us:9.1f} us {gbs:7.0f} GB/s "
                          f"{100 * gbs / res['hbm_copy_GBs']:4.0f}%  err {err:.0e}", flush=True)
                    if a.json:
                        Path(a.json).write_text(json.dumps(res, indent=1))
            stores.clear()  # (one shape and type's copies held at a time)
            torch.cuda.empty_cache()


def mla_call(form: str, q_lat: torch.Tensor, q_pe: torch.Tensor, stores: list[torch.Tensor],
             length: torch.Tensor, splits: int | None):  # noqa: ANN201
    """call(i) -> o_lat: `form` over copy i of the latent rows."""
    def call(i: int) -> torch.Tensor:
        c = stores[i % len(stores)]
        if form == "torch":
            return latent_ops._latent_torch(q_lat, q_pe, c, length, 0.1, None)
        return latent_ops.latent_attention(q_lat, q_pe, c, length, 0.1, fused=form == "tf32",
                                           n_splits=splits)

    return call


def warm(n: int) -> None:
    """This script's cases in n processes at once (each every n-th, one call each, untimed)."""
    args = [v for v in sys.argv[1:] if not v.startswith(("--warm=", "--json="))]
    for flag in ("--warm", "--json"):  # (as "--flag value")
        if flag in args:
            i = args.index(flag)
            del args[i:i + 2]
    procs = [subprocess.Popen([sys.executable, __file__, *args, "--warm", "0", "--shard",
                               f"{i}/{n}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(n)]
    for i, p in enumerate(procs):
        out, _ = p.communicate()
        bad = [line for line in out.splitlines() if "rror" in line or "failed" in line]
        print("\n".join(bad[-5:]) or f"warm process {i}: built", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--variants", default=",".join(ops.ATTN_VARIANTS))
    ap.add_argument("--tiles", default="", help="other tiles: variant:m:n:stages:warps[:dc],..")
    ap.add_argument("--field", default="", help="the field's kernels beside them: "
                    + ",".join(FIELD))
    ap.add_argument("--capacity", type=int, default=max(LENGTHS))
    ap.add_argument("--copies", type=int, default=8, help="caches a graph's calls cycle over")
    ap.add_argument("--splits", type=int, default=None, help="S instead of attention_splits")
    ap.add_argument("--warm", type=int, default=min(8, (os.cpu_count() or 2) // 2))
    ap.add_argument("--mla", action="store_true", help="MLA's absorbed decode instead")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    pick = {k: [x for x in getattr(a, k).split(",") if x] for k in
            ("shapes", "caches", "tokens", "lengths", "variants")}
    shapes = MLA_SHAPES if a.mla else SHAPES
    if a.mla and a.shapes == ",".join(SHAPES):
        pick["shapes"] = list(MLA_SHAPES)
    a.shapes = [s for s in shapes if any(p in s for p in pick["shapes"])]
    a.caches, a.variants = pick["caches"], pick["variants"]
    a.tiles = [x for x in a.tiles.split(",") if x]
    a.field = [x for x in a.field.split(",") if x]
    if any(f not in FIELD for f in a.field):
        ap.error(f"--field {','.join(a.field)}: choose from {','.join(FIELD)}")
    a.tokens, a.lengths = [int(x) for x in pick["tokens"]], [int(x) for x in pick["lengths"]]
    if a.mla and a.caches == list(CACHES):
        a.caches = list(LATENT)
    if a.shard is None and a.warm > 1 and not a.mla:
        warm(a.warm)
    shard, shards = map(int, a.shard.split("/")) if a.shard else (0, 1)
    dev = torch.device("cuda")
    timed = a.shard is None
    res: dict = {"capacity": a.capacity, "rows": []}
    if timed:
        res["hbm_copy_GBs"] = hbm_copy_gbs()
        print(f"HBM copy {res['hbm_copy_GBs']:.0f} GB/s; capacity {a.capacity} rows; err: "
              + ("max |out - torch's| / max |torch's|" if a.mla else
                 "max |out - ieee's| / max |ieee's|") + " on the same inputs")
    if a.mla:
        mla_rows(a, res, a.shapes, timed, dev)
        return
    todo = [c for i, c in enumerate(cases(a)) if i % shards == shard]
    gen = torch.Generator(device=dev).manual_seed(0)
    caches_at: dict = {}
    for shape, cache, t, n, variant in todo:
        h, hkv, hd, has_sinks = SHAPES[shape]
        if (shape, cache) not in caches_at:
            caches_at.clear()  # (one shape and type's copies held at a time)
            torch.cuda.empty_cache()
            caches_at[(shape, cache)] = make_caches(a.copies if timed else 1, a.capacity, hkv,
                                                    hd, cache, dev)
        kvs = caches_at[(shape, cache)]
        q = torch.randn(t, h, hd, device=dev, generator=gen) * 0.5
        sinks = torch.randn(h, device=dev, generator=gen) if has_sinks else None
        length = torch.full((1,), n, dtype=torch.int64, device=dev)
        out = torch.empty(t, h * hd, device=dev)

        tile = parse_tile(variant) if ":" in variant else None
        field = variant in FIELD

        def call(i: int, kvs=kvs, q=q, sinks=sinks, length=length, out=out, hd=hd,
                 variant=variant, tile=tile) -> None:
            k, v, ks, vs = kvs[i % len(kvs)]
            ops.decode_attention(q, k, v, length, hd ** -0.5, out=out, n_splits=a.splits,
                                 sinks=sinks, k_scales=ks, v_scales=vs,
                                 variant=None if tile else variant, tile=tile)

        try:
            if field:
                run = field_call(variant, h, hkv, t, n, hd, sinks)
                laid = [field_layout(k, v, n) for k, v, _, _ in kvs]

                def call(i: int, laid=laid, q=q, out=out, run=run) -> None:  # noqa: F811
                    out.copy_(run(q, *laid[i % len(laid)]))

            if not timed:
                call(0)
                continue
            us = (event_seconds(call, calls=2 * len(kvs)) if field
                  else graph_seconds(call, calls=2 * len(kvs), reps=5)) * 1e6
        except Exception as e:  # noqa: BLE001 (a tile that does not build or fit: say so)
            print(f"{shape} {cache} T={t} {n} {variant}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            torch.cuda.synchronize()
            continue
        gbs = kv_bytes(n, hkv, hd, cache) / us / 1e3
        call(0)  # this case's output against the ieee variant's on the same inputs
        got = out.clone()
        k, v, ks, vs = kvs[0]
        ref = ops.decode_attention(q, k, v, length, hd ** -0.5, n_splits=a.splits, sinks=sinks,
                                   k_scales=ks, v_scales=vs, variant="ieee")
        err = float((got - ref).abs().max() / ref.abs().max())
        g = h // hkv
        row = dict(shape=shape, H=h, Hkv=hkv, hd=hd, cache=cache, T=t, length=n,
                   variant=variant, us=round(us, 2), GBs=round(gbs, 1), err_vs_ieee=err,
                   pick_exact=ops.attention_variant(t, g, CACHES[cache], False),
                   pick_fused=ops.attention_variant(t, g, CACHES[cache], True))
        res["rows"].append(row)
        mark = "".join(m for m, k in (("e", "pick_exact"), ("f", "pick_fused"))
                       if row[k] == variant)
        print(f"{shape:16} {cache:5} T={t} {n:6} {variant:5} {us:9.1f} us {gbs:7.0f} GB/s "
              f"{100 * gbs / res['hbm_copy_GBs']:4.0f}%  err {err:.0e} {mark}", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    if timed:
        print("(e / f: the variant the launch picks under --kernels exact / fused)")


if __name__ == "__main__":
    main()
