"""strata check: run two engine configurations on the same tokens and compare their logits.

    strata check MODEL --a "--offload off" --b "--device cuda --vram-budget 4 --prefill 64"
    strata check MODEL --b "--device cuda --vram-budget 10" --decode 16   # decode steps too

Prints first-token (the last prompt position) and all-position KL(a || b), max abs diff and top-1
agreement; exit code 1 when they differ beyond --max-kl or disagree on a top token. With
--decode N the last N tokens go through one decode step each (the CUDA-graph decode step where
the configuration has one) instead of the prompt, and their positions are reported apart.

Then the routing: both configurations run again recording every routed layer's top-K experts per
token (strata.model.parts.routing; decode steps eager), the (layer, token) pairs whose expert sets
differ are counted and the first few shown with A's router margin between its K-th and (K+1)-th
expert, and B runs once more with its routing pinned to A's experts (B's weights for them): a KL
spike that falls to the path's usual level when pinned is a router near-tie flipped by rounding;
one that stays is not routing. In that second run every layer's output (what the next residual
step adds) is recorded too, and the relative error of B's against A's is
reported per layer kind (mixer + feed-forward, sliding-window layers apart): where a fast path
loses precision, by the part it runs.
"""

from __future__ import annotations

import argparse
import gc
import math
import shlex
import sys

import numpy as np
import torch

from strata.cli.engine_flags import add_engine_arguments, engine_config
from strata.cli.limits import check_seed
from strata.cli.logits import compute_logits, parse_tokens
from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.errors import StrataError
from strata.model.parts.norm import SharedRows, summed
from strata.model.parts.routing import RoutingPin, RoutingTrace, attach
from strata.model.parts.spec import layer_spec

SHOWN = 5  # routing differences listed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("--a", default="--offload off", help="engine flags of configuration A "
                   "(default: the reference path, --offload off)")
    p.add_argument("--b", required=True, help="engine flags of configuration B, e.g. "
                   "\"--device cuda --vram-budget 4 --prefill 64\"")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (64)")
    p.add_argument("--tokens", default=None, help="comma-separated token ids instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (0)")
    p.add_argument("--max-kl", type=float, default=1e-4, help="tolerance (1e-4)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="run the last N tokens as decode steps, one token each (0)")
    p.add_argument("--no-routing", dest="routing", action="store_false",
                   help="skip the routing comparison and the pinned rerun")


def parse_flags(name: str, text: str) -> EngineConfig:
    p = argparse.ArgumentParser(prog=f"strata check --{name}", add_help=False,
                                exit_on_error=False)
    add_engine_arguments(p)
    # (check compares paths: the KV cache float32 on both sides unless a side names --kv-type,
    # where --kv-type auto would give a CUDA side f16 and the CPU side float32)
    p.set_defaults(kv_type="f32")
    try:
        args, rest = p.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, ValueError) as e:
        raise StrataError(f"--{name} {text!r}: {e}") from None
    if rest:
        raise StrataError(f"--{name} {text!r}: not an engine flag: {' '.join(rest)}")
    if args.spec:  # (no drafted tokens: the logits of a prompt and of plain decode steps)
        raise StrataError(f"--{name} {text!r}: --spec: strata check compares logits and decodes "
                          "no drafted tokens; drop --spec")
    return engine_config(args)


def decode_logits(engine: Engine, ids: list[int], n_decode: int) -> np.ndarray:
    """float32 logits [len(ids), V]: the first tokens as the prompt (in the engine's chunks),
    then one decode step per remaining token."""
    n = len(ids) - n_decode
    kv = engine.model.new_cache(len(ids))
    out = [engine.run_prompt(ids[:n], kv, all_logits=True).float().cpu().numpy()]
    for t in ids[n:]:
        out.append(engine.model.decode(t, kv).float().cpu().numpy().copy())
    return np.concatenate(out)


def kl_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    la = torch.log_softmax(torch.from_numpy(a).double(), -1)
    lb = torch.log_softmax(torch.from_numpy(b).double(), -1)
    return (la.exp() * (la - lb)).sum(-1).numpy()


def run(args: argparse.Namespace) -> int:
    if not args.tokens and args.prompt_len < 1:
        raise StrataError(f"--prompt-len {args.prompt_len}: give at least 1 token")
    check_seed(args.seed)
    if not 0 <= args.max_kl < math.inf:
        raise StrataError(f"--max-kl {args.max_kl}: give a tolerance of 0 or more (a finite "
                          "number)")
    if args.decode < 0:
        raise StrataError(f"--decode {args.decode}: give 0 or more tokens")
    ca, cb = parse_flags("a", args.a), parse_flags("b", args.b)
    logits, traces, outputs = [], [], []
    ids: list[int] | None = None
    for ec in (ca, cb):
        engine = Engine.load(args.model, config=ec)
        if ids is None:
            n_vocab = engine.config.n_vocab
            if args.tokens:
                ids = parse_tokens(args.tokens, n_vocab)
            elif args.prompt_len > engine.config.context_length:  # (before drawing them)
                raise StrataError(f"--prompt-len {args.prompt_len}: the model's context is "
                                  f"{engine.config.context_length} tokens")
            else:
                ids = np.random.default_rng(args.seed).integers(0, n_vocab,
                                                                args.prompt_len).tolist()
            engine.check_prompt(ids, 0)
            if not 0 <= args.decode < len(ids):
                raise StrataError(f"--decode {args.decode}: give 0 .. {len(ids) - 1} (the "
                                  "tokens after the first go through decode steps)")
        logits.append(run_logits(engine, ids, args.decode))
        if args.routing:
            traces.append(RoutingTrace())
            outputs.append(LayerOutputs(engine.model))
            with attach(engine.model, traces[-1]), outputs[-1]:
                run_logits(engine, ids, args.decode)
            if len(traces) == 2:
                with attach(engine.model, RoutingPin(traces[0].ids())):
                    pinned = run_logits(engine, ids, args.decode)
        del engine
        gc.collect()
    a, b = logits
    ok = report(a, b, ids, args)
    if args.routing:
        report_layers(outputs[0], outputs[1])
        report_routing(traces[0], traces[1])
        kl = kl_rows(a, pinned)
        print(f"routing pinned to A: KL max {kl.max():.3e} mean {kl.mean():.3e}  first token "
              f"{kl[-1]:.3e}  (unpinned max {kl_rows(a, b).max():.3e})")
    return 0 if ok else 1


def token_rows(delta: torch.Tensor | SharedRows) -> np.ndarray:
    """A layer's output as the next residual step adds it -> float32 [T, D] on the host. A
    decode step on CUDA's fused expert kernels hands on the K pairs' rows unsummed, [T, K, D]
    (moe_forward's sum_pairs=False), with a shared expert's row beside them (SharedRows):
    summed here in the order add_rms_norm adds them."""
    return summed(delta).float().cpu().numpy().copy()


class LayerOutputs:
    """While entered: each layer's output ([T, D] per pass, float32 on the host: token_rows) in
    the order the passes ran, and each layer's kind. A layer's output is read where the next
    part takes it (the next layer's begin, the head's forward): every path hands it on there,
    the decode step's host layers too. (The routing hooks that run beside it keep the decode
    step and the prompt chunks eager, so those calls happen.)"""

    def __init__(self, model) -> None:  # noqa: ANN001 (MoETransformer)
        self.model = model
        self.rows: list[list[np.ndarray]] = [[] for _ in model.layers]
        self.kinds = [layer_kind(model.cfg, layer) for layer in model.layers]

    def _keep(self, i: int, delta: torch.Tensor | None) -> None:
        if i >= 0 and delta is not None:
            self.rows[i].append(token_rows(delta))

    def __enter__(self) -> LayerOutputs:
        for layer in self.model.layers:
            def begin(x, delta, ctx, _inner=layer.begin, _i=layer.index - 1):  # noqa: ANN001, ANN202
                self._keep(_i, delta)
                return _inner(x, delta, ctx)
            layer.begin = begin
        head, last = self.model.head, len(self.model.layers) - 1

        def forward(x, delta, ctx, rows=None, _inner=head.forward):  # noqa: ANN001, ANN202
            self._keep(last, delta)
            return _inner(x, delta, ctx, rows)
        head.forward = forward
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.model.layers:
            del layer.begin  # (the class's methods again)
        del self.model.head.forward

    def outputs(self, i: int) -> np.ndarray:
        """Layer i's outputs of every pass, joined: [tokens, D]."""
        return np.concatenate(self.rows[i]) if self.rows[i] else np.zeros((0, 0), np.float32)


def layer_kind(cfg, layer) -> str:  # noqa: ANN001 (ModelConfig, Layer)
    spec = layer_spec(cfg, layer.index)
    window = " (sliding window)" if getattr(layer.mixer, "window", 0) else ""
    return f"{spec.mixer}{window} + {spec.ffn}"


def report_layers(a: LayerOutputs, b: LayerOutputs) -> None:
    """Per layer kind: B's layer outputs against A's, ||b - a|| / ||a|| over the tokens."""
    by_kind: dict[str, list[tuple[float, int]]] = {}
    for i, kind in enumerate(a.kinds):
        oa, ob = a.outputs(i), b.outputs(i)
        if oa.shape != ob.shape or not oa.size:
            continue  # (a layer one side did not run as the other did)
        err = float(np.linalg.norm(ob - oa) / max(np.linalg.norm(oa), 1e-30))
        by_kind.setdefault(kind, []).append((err, i))
    print("layer outputs, B against A (relative error over the tokens), by layer kind:")
    for kind, errs in by_kind.items():
        worst, at = max(errs)
        print(f"  {kind}: {len(errs)} layers, max {worst:.2e} (layer {at}), median "
              f"{float(np.median([e for e, _ in errs])):.2e}")


def run_logits(engine: Engine, ids: list[int], n_decode: int) -> np.ndarray:
    return decode_logits(engine, ids, n_decode) if n_decode else compute_logits(engine, ids)


def routing_diffs(ta: RoutingTrace, tb: RoutingTrace) -> list[tuple[int, int, set, set, float]]:
    """(layer, token, A's experts, B's, A's margin p_K - p_K+1) where the sets differ, by token
    then layer."""
    ia, ib, margin = ta.ids(), tb.ids(), ta.margins()
    out = []
    for layer in sorted(ia):
        a, b = np.sort(ia[layer], -1), np.sort(ib[layer], -1)
        for t in np.flatnonzero((a != b).any(-1)):
            out.append((layer, int(t), set(a[t].tolist()), set(b[t].tolist()),
                        float(margin[layer][t])))
    return sorted(out, key=lambda d: (d[1], d[0]))


def report_routing(ta: RoutingTrace, tb: RoutingTrace) -> None:
    diffs = routing_diffs(ta, tb)
    pairs = sum(len(v) for v in ta.ids().values())
    print(f"routing: {len(diffs)} of {pairs} (layer, token) pairs differ in their experts")
    for layer, t, ea, eb, m in diffs[:SHOWN]:
        print(f"  layer {layer} token {t}: A {sorted(ea)} B {sorted(eb)}  A's margin {m:.2e}")
    if len(diffs) > SHOWN:
        print(f"  ... {len(diffs) - SHOWN} more")


def report(a: np.ndarray, b: np.ndarray, ids: list[int], args: argparse.Namespace) -> bool:
    kl = kl_rows(a, b)
    top = a.argmax(-1) == b.argmax(-1)
    diff = np.abs(a - b)
    print(f"first token:   KL {kl[-1]:.3e}  max abs diff {diff[-1].max():.3e}  "
          f"top-1 {'same' if top[-1] else 'DIFFERENT'}")
    print(f"all {len(ids):>5} pos: KL max {kl.max():.3e} mean {kl.mean():.3e}  max abs diff "
          f"{diff.max():.3e}  top-1 agree {100 * top.mean():.1f}%")
    if args.decode:
        d = slice(len(ids) - args.decode, None)
        print(f"{args.decode:>5} decode steps: KL max {kl[d].max():.3e}  max abs diff "
              f"{diff[d].max():.3e}  top-1 agree {100 * top[d].mean():.1f}%")
    ok = kl.max() <= args.max_kl and top.all()
    print("same within tolerance" if ok else f"DIFFERENT beyond --max-kl {args.max_kl:g} or on "
          "a top token", file=sys.stderr if not ok else sys.stdout)
    return ok
