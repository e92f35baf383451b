"""strata generate: stream text from a prompt or a chat message, then a one-line summary."""

from __future__ import annotations

import argparse
import sys

from strata.cli.engine_flags import add_engine_arguments, engine_config, warn_unused
from strata.cli.limits import SAMPLING_FLAGS, check_ctx, check_kv_memory, check_sampling
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import StrataError
from strata.experts.stats import GpuTimer
from strata.progress import LiveRate, LoadStages


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (any shard of a split set); "
                   "without it, the built-in demo model")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="raw text to continue (without --prompt or --chat: "
                   "'Once upon a time')")
    g.add_argument("--chat", help="a user message, rendered with the model's chat template")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (0.95)")
    p.add_argument("--top-k", type=int, default=40, help="0 turns it off (40)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top (0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    p.add_argument("--stats", action="store_true",
                   help="print expert cache and miss-path statistics per layer")
    add_engine_arguments(p)


def model_or_demo(model: str | None) -> str:
    if model:
        return model
    from strata.demo import DEMO_TEXT, demo_model

    path = demo_model()
    print(f"strata: {DEMO_TEXT} ({path})", file=sys.stderr)
    return str(path)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags, checked (one line naming the flag where one is off)."""
    check_sampling(args)
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens)
    except StrataError as e:  # "top_p=1.5: must be ..." -> "--top-p 1.5: must be ..."
        field, _, rest = str(e).partition("=")
        raise StrataError(f"{SAMPLING_FLAGS.get(field, field)} {rest}") from None


def load_engine(args: argparse.Namespace) -> Engine:
    """The engine of args.model (the demo model without one) under the engine flags, a line a
    load stage; a long prompt then shows its tokens done / total."""
    stages = LoadStages()
    try:
        engine = Engine.load(model_or_demo(args.model), config=engine_config(args),
                             progress=stages)
    finally:
        stages.close()
    engine.show_progress = True
    warn_unused(args, engine)
    return engine


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    early_limits(args)  # (before the weights load: a mistyped -n fails at once)
    engine = load_engine(args)
    tok = engine.tokenizer
    if args.chat is not None:  # the message's own special-token text stays text
        ids = engine.chat.encode([{"role": "user", "content": args.chat}], add_bos=False)
        text = ""
    else:
        text = args.prompt if args.prompt is not None else "Once upon a time"
        ids = tok.encode(text)
    if not ids:
        raise StrataError("--prompt: the prompt is empty")
    check_ctx(args.ctx, len(ids) + args.max_tokens,
              f"the prompt's {len(ids)} tokens and -n {args.max_tokens}")
    engine.check_prompt(ids, args.max_tokens)
    check_kv_memory(engine, len(ids) + args.max_tokens)
    experts = engine.model.experts
    if args.stats and hasattr(experts, "stats") and engine.model.device.type == "cuda":
        experts.stats.timer = GpuTimer(engine.config.n_layers)
    sys.stdout.write(text if args.chat is None else "")
    sys.stdout.flush()
    stream, live = tok.stream(), LiveRate()  # live tok/s where stderr is a terminal
    try:
        for n, token in enumerate(engine.generate(ids, params), 1):
            live.text(stream.push(token), n)
    finally:
        live.close()
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    st = engine.stats
    print(f"strata: loaded in {engine.load_s:.2f} s; prompt {st.prompt_tokens} tokens at "
          f"{st.prompt_tok_s:.1f} tok/s; generated {st.generated_tokens} tokens at "
          f"{st.decode_tok_s:.1f} tok/s ({st.finish_reason})", file=sys.stderr)
    if args.stats and st.spec is not None:
        print(f"strata: {st.spec.line()}", file=sys.stderr)
    if args.stats and hasattr(experts, "stats"):
        print("\n".join(experts.stats.lines()), file=sys.stderr)
        if engine.model.step is not None:
            print(engine.model.step.line(), file=sys.stderr)
        if engine.model.chunks is not None:
            print(engine.model.chunks.line(), file=sys.stderr)
        if experts.cache.lends:
            print(experts.cache.line(), file=sys.stderr)
    elif args.stats:
        print("strata: --stats: no offload runtime (--offload off); every expert ran on "
              f"{args.device}", file=sys.stderr)
    return 0


def early_limits(args: argparse.Namespace) -> None:
    """-n against the model's context, from its metadata alone: a prompt takes at least one
    token, so -n of the whole context (or of --ctx) or more can never run (the exact check, prompt
    included, follows the load)."""
    if args.ctx is not None and 0 < args.ctx <= args.max_tokens:  # (below 1: engine_config)
        raise StrataError(f"--ctx {args.ctx}: a prompt and -n {args.max_tokens} tokens need "
                          f"more; give --ctx above {args.max_tokens}, or lower -n")
    if args.model is None:
        return
    from strata.config import ModelConfig
    from strata.gguf import open_model

    ctx = ModelConfig.from_model(open_model(args.model)).context_length
    if args.max_tokens >= ctx:
        raise StrataError(f"-n {args.max_tokens}: a prompt and {args.max_tokens} tokens to "
                          f"generate exceed the model's context of {ctx} tokens; give -n below "
                          f"{ctx}")
