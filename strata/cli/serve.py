"""strata serve: the OpenAI-compatible server (the demo model without MODEL). See docs/server.md."""

from __future__ import annotations

import argparse
import json

from strata.server import config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="GGUF file (any shard of a split set); "
                   "without it, the built-in demo model")
    p.add_argument("--config", help="strata-NAME.json: settings by flag name and an \"env\" "
                   "object of environment settings; flags given here win")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective settings as JSON and exit")
    config.add_flags(p)  # the server's flags, then the engine's (--device, --offload, ...)


def run(args: argparse.Namespace) -> int:
    cfg = config.resolve(args)
    if args.print_config:
        print(json.dumps(cfg.public(), indent=2))
        return 0
    config.apply_env(cfg)
    from strata.server.faults import FaultPlan
    from strata.server.serve import serve

    return serve(cfg, FaultPlan.from_env())
