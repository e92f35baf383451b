"""`strata serve` settings: defaults < a strata-NAME.json file (--config) < command-line flags.

The JSON file holds flag names (dashes or underscores), the server's and the engine's
(cli/engine_flags.py: --device, --offload, --expert-cache, ...), and an "env" object of environment
settings, which are set before the engine process starts:

    {"model": "qwen3-30b-a3b-Q4_K_M.gguf", "port": 8080, "watchdog": 120, "device": "cuda",
     "expert-cache": "auto", "env": {"STRATA_FAULT": "stall@decode:3"}}
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from strata.cli.engine_flags import add_engine_arguments, engine_config
from strata.config import EngineConfig
from strata.errors import StrataError
from strata.kernels.tuning import PREFILL_WHILE_DECODING


def _engine_defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(p)
    return vars(p.parse_args([]))


ENGINE_DEFAULTS = _engine_defaults()  # the engine flags' dests and defaults
_UNSET = object()  # the default of every serve flag: "not given on the command line"


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    batch: int = 4
    queue: int = 16
    max_tokens: int = 4096
    max_body: int = 1 << 20
    watchdog: float = 60.0
    load_timeout: float = 600.0
    queue_timeout: float = 600.0
    max_restarts: int = 3
    restart_window: float = 600.0
    report_dir: str = "."
    template_timeout: float = 5.0
    head_timeout: float = 10.0
    prefix_cache: float = 1.0
    prompt_while_decoding: int = PREFILL_WHILE_DECODING
    warmup: int = 1
    env: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=lambda: dict(ENGINE_DEFAULTS))

    @property
    def device(self) -> str:
        return str(self.engine.get("device", "cpu"))

    def engine_config(self) -> EngineConfig:
        """The engine flags as the engine takes them (checked as generate checks them)."""
        ec = engine_config(argparse.Namespace(**self.engine, debug=False))
        return replace(ec, sequences=self.batch)  # the plan counts every batched KV cache

    @property
    def served_name(self) -> str:
        """The model id clients send: --model-name, else the file name without .gguf and shard
        suffix, else "strata-demo"."""
        if self.model_name:
            return self.model_name
        if not self.model:
            return "strata-demo"
        stem = Path(self.model).name.removesuffix(".gguf")
        parts = stem.rsplit("-", 3)
        if len(parts) == 4 and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
            stem = parts[0]  # name-00001-of-00003
        return stem

    def public(self) -> dict[str, Any]:
        """The effective settings as --print-config shows them: a valid --config file, flat, by
        flag name (the API key hidden)."""
        d = asdict(self)
        if d["api_key"]:
            d["api_key"] = "(set)"
        flat = {k: v for k, v in d.items() if k not in ("env", "engine")} | d["engine"]
        return {k.replace("_", "-"): v for k, v in flat.items()} | {"env": d["env"]}


# flag -> help; the type and default come from ServeConfig
HELP = {
    "model_name": "the model id clients send and /v1/models lists (default: the file's name)",
    "host": "address to listen on; 127.0.0.1 keeps the server on this machine (127.0.0.1)",
    "port": "TCP port; 0 picks a free one and logs it (8000)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/* requests (none: no key)",
    "batch": "requests decoded together, sharing each forward pass (4)",
    "queue": "requests that may wait for a batch slot; more get HTTP 429 (16)",
    "max_tokens": "the most tokens one request may ask for, and the default (4096)",
    "max_body": "the largest request body in bytes; larger gets HTTP 413 (1048576)",
    "watchdog": "seconds without engine progress, while work is pending, before the engine is "
                "declared stalled, reported and restarted (60)",
    "load_timeout": "seconds the engine may take to load the model (600)",
    "queue_timeout": "seconds a request may wait in the queue before HTTP 503 (600)",
    "max_restarts": "restarts allowed within --restart-window; one more failure and the server "
                    "stops restarting and says why in /health (3)",
    "restart_window": "seconds over which --max-restarts counts failures (600)",
    "report_dir": "folder for stall and crash reports (default: the current folder)",
    "template_timeout": "seconds one chat request's template may take to render and tokenize; "
                        "longer fails that request with HTTP 400 (5)",
    "head_timeout": "seconds a connection may stay open without a request running before it "
                    "sends a whole request head; then it is closed (10)",
    "warmup": "1: run a short prompt and a few decode steps at load, so that kernels are built "
              "and decode graphs captured before the first request; 0: off (1)",
    "prompt_while_decoding": "the most prompt tokens a step takes while other requests decode "
                             "(their next token waits for the step): fewer keep their "
                             "inter-token latency lower and a new prompt's first token later; "
                             "a chunk that fits the batched step's rows beside them rides in "
                             "it (512)",
    "prefix_cache": "GiB of host RAM for finished requests' keys and values: a prompt that "
                    "starts like one of them computes only the rest (1; 0: off)",
}
_LIMITS = {"port": (0, 65535), "batch": (1, 256), "queue": (0, 100_000),
           "max_tokens": (1, 1 << 24), "max_body": (1024, 1 << 30), "watchdog": (0.5, 86400),
           "load_timeout": (1, 86400), "queue_timeout": (1, 86400), "max_restarts": (0, 1000),
           "restart_window": (1, 86400 * 7), "template_timeout": (0.1, 600),
           "head_timeout": (0.5, 3600), "prefix_cache": (0, 1 << 20),
           "prompt_while_decoding": (1, 1 << 20), "warmup": (0, 1)}
_TYPES = {f.name: f.type for f in fields(ServeConfig)}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The serve flags and the engine flags. A flag not given reads _UNSET, so that a --config
    file's value for it stands."""
    metavars = {"model_name": "NAME", "host": "ADDR", "api_key": "KEY", "report_dir": "DIR",
                "max_body": "BYTES", "prefix_cache": "GIB", "warmup": "0|1", "int": "N",
                "float": "S"}
    for name, help_text in HELP.items():
        kind = _TYPES[name]
        conv = int if "int" in kind else float if "float" in kind else str
        metavar = metavars.get(name) or metavars[conv.__name__]
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=conv, help=help_text,
                       metavar=metavar, default=_UNSET)
    add_engine_arguments(p)
    p.set_defaults(**{name: _UNSET for name in ENGINE_DEFAULTS})


def load_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise StrataError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise StrataError(f"--config {path}: not valid JSON: {e.msg} at line {e.lineno}, "
                          f"column {e.colno}") from None
    if not isinstance(data, dict):
        raise StrataError(f"--config {path}: expected a JSON object of settings")
    out: dict[str, Any] = {}
    engine_argv: list[str] = []
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in ENGINE_DEFAULTS:
            if value is not None:  # null: the flag's default
                engine_argv += [f"--{name.replace('_', '-')}", str(value)]
        elif name in _TYPES and name != "engine":
            out[name] = _check_type(path, key, name, value)
        else:
            known = sorted(n.replace("_", "-") for n in [*_TYPES, *ENGINE_DEFAULTS]
                           if n != "engine")
            raise StrataError(f"--config {path}: unknown setting {key!r} (known: "
                              f"{', '.join(known)})")
    if engine_argv:  # the engine flags' own types and choices check the file's values
        p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        add_engine_arguments(p)
        try:
            engine = vars(p.parse_args(engine_argv))
        except argparse.ArgumentError as e:
            raise StrataError(f"--config {path}: {e}") from None
        given = {a[2:].replace("-", "_") for a in engine_argv[::2]}
        out["engine"] = {k: v for k, v in engine.items() if k in given}
    return out


def _check_type(path: str, key: str, name: str, value: Any) -> Any:
    kind = _TYPES[name]
    if name == "env":
        if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) and
                                                  not isinstance(v, bool) for v in value.values()):
            raise StrataError(f"--config {path}: \"env\" must be an object of NAME: \"value\"")
        return {str(k): str(v) for k, v in value.items()}
    if value is None and "None" in kind:
        return None
    ok = (isinstance(value, str) if "str" in kind else
          isinstance(value, int) if "int" in kind else isinstance(value, (int, float)))
    if not ok or isinstance(value, bool):
        want = "a string" if "str" in kind else "an integer" if "int" in kind else "a number"
        raise StrataError(f"--config {path}: {key!r} must be {want}, not {value!r}")
    return value


def resolve(args: argparse.Namespace) -> ServeConfig:
    """Defaults, then the --config file, then the flags given on the command line."""
    values: dict[str, Any] = {}
    engine = dict(ENGINE_DEFAULTS)
    if getattr(args, "config", None):
        values.update(load_file(args.config))
        engine.update(values.pop("engine", {}))
    given = {k: v for k, v in vars(args).items() if v is not _UNSET}
    values.update({k: v for k, v in given.items() if k in _TYPES and k not in ("env", "engine")
                   and (k != "model" or v is not None)})
    engine.update({k: v for k, v in given.items() if k in ENGINE_DEFAULTS})
    cfg = replace(ServeConfig(), **values, engine=engine)
    check(cfg)
    return cfg


def check(cfg: ServeConfig) -> None:
    for name, (lo, hi) in _LIMITS.items():
        v = getattr(cfg, name)
        if not lo <= v <= hi:
            raise StrataError(f"--{name.replace('_', '-')} {v}: must be between {lo} and {hi}")
    if cfg.device not in ("auto", "cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise StrataError(f"--device {cfg.device}: choose auto, cpu, cuda or cuda:N")
    cfg.engine_config()  # raises on a bad engine flag
    if cfg.model is not None and not Path(cfg.model).is_file():
        what = "a folder, not a GGUF file" if Path(cfg.model).is_dir() else "no such model file"
        raise StrataError(f"{cfg.model}: {what}")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise StrataError("--api-key: the key is empty")


def apply_env(cfg: ServeConfig) -> None:
    """Set the file's "env" settings; the engine process inherits them. A variable already set in
    the environment wins, as a flag wins over the file."""
    for name, value in cfg.env.items():
        os.environ.setdefault(name, value)
