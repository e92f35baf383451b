"""`strata`: the command line. Each subcommand lives in its own module with add_parser/run."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
import traceback
from typing import NoReturn

from strata import __version__, env
from strata.config import cpu_threads, usable_cores
from strata.errors import StrataError
from strata.kernels import tuning
from strata.logs import StderrHandler

# subcommand -> (module, one-line help)
COMMANDS = {
    "generate": ("strata.cli.generate",
                 "generate text from a prompt (the demo model without MODEL)"),
    "chat": ("strata.cli.chat",
             "chat with a model in the terminal (the demo model without MODEL)"),
    "logits": ("strata.cli.logits", "write the logits of a token sequence to a .npy file"),
    "info": ("strata.cli.info", "show a model's architecture, shapes and tensor types per layer"),
    "synth": ("strata.cli.synth", "write a synthetic GGUF model (real layout, random weights)"),
    "serve": ("strata.cli.serve", "serve an OpenAI-compatible API (the demo model without MODEL)"),
    "bench": ("strata.cli.bench", "measure prompt and decode speed against the machine's limits"),
    "bench-serve": ("strata.cli.bench_serve",
                    "load a running OpenAI-compatible server with concurrent clients: TTFT, "
                    "inter-token latency, aggregate tok/s"),
    "bench-spec": ("strata.cli.bench_spec",
                   "time verify windows (--spec) against plain decode, with drafts of a fixed "
                   "acceptance"),
    "check": ("strata.cli.check", "compare the logits of two engine configurations"),
    "profile": ("strata.cli.profile", "record routing frequency per (layer, expert) over prompts"),
    "perplexity": ("strata.cli.perplexity",
                   "perplexity on a text file, measured as llama.cpp's llama-perplexity does"),
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors in one line as the commands' own are (no usage block:
    --help shows it); the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} "
                     "--help\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (so `strata serve` keeps torch out of the
    server process, and `strata --help` starts fast)."""
    parser = Parser(
        prog="strata",
        description="Run Mixture-of-Experts GGUF models larger than the GPU, on one machine.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show full tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks instead of one-line errors")
        if name == command:
            importlib.import_module(module).add_arguments(p)
            parser.set_defaults(command_parser=p)  # (its errors name it: see parse)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, where an argument no parser knows is its command's error, not strata's."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "command_parser", parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    return args


def setup_logging(debug: bool) -> None:
    handler = StderrHandler("strata: %(message)s")
    root = logging.getLogger("strata")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    try:
        env.check()  # (read by modules when imported: before a command's errors are caught)
    except StrataError as e:
        print(f"strata{' ' + command if command else ''}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    args = parse(build_parser(command), argv)
    setup_logging(args.debug)
    try:
        tuning.check_overrides()
    except StrataError as e:
        print(f"strata {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    if tuning.OVERRIDES:
        logging.getLogger("strata").info("tuning from %s: %s", tuning.TUNING_ENV, ", ".join(
            f"{k}={v}" for k, v in tuning.OVERRIDES.items()))
    set_thread_pools(getattr(args, "threads", None), spare=int(args.command == "serve"))
    # torch's CUDA allocator maps its free blocks into one growing range instead of keeping
    # fixed-size segments: under a --vram-budget cap, a prompt chunk's scratch of another size
    # found 1.13 GiB reserved but split into pieces too small for it and failed at 10 GiB
    # (bench/2026-12-02-h200-prompt-graphs.md). Read when CUDA starts; the user's setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args) or 0
    except StrataError as e:
        if args.debug:
            raise
        print(f"strata {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except PermissionError as e:  # a file given that this process may not read or write
        if args.debug:
            raise
        print(f"strata {args.command}: error: {e.filename or ''}: {e.strerror or e}; check its "
              "permissions", file=sys.stderr)
        return 2
    except MemoryError:
        if args.debug:
            raise
        print(f"strata {args.command}: error: out of memory; lower -n, --ctx or the request's "
              "size", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: one line, and the traceback in a report file
        if args.debug:
            raise
        report = _write_report(args.command, argv)
        if type(e).__name__ == "OutOfMemoryError":  # (torch's, for the GPU)
            print(f"strata {args.command}: error: out of GPU memory: the engine needed more "
                  "than its memory plan holds; raise --vram-budget, or lower --ctx, "
                  f"--expert-cache or the prompt's size (report: {report})", file=sys.stderr)
            return 2
        print(f"strata {args.command}: internal error: {type(e).__name__}: {_one_line(e)} "
              f"(report: {report}; --debug shows the traceback)", file=sys.stderr)
        return 1


def set_thread_pools(threads: int | None = None, spare: int = 0) -> None:
    """OpenMP's pool (torch's and ggml's CPU kernels) sized to --threads where given, else to the
    usable cores less those other processes keep busy (config.cpu_threads) less `spare`, unless
    OMP_NUM_THREADS is set: on a busy machine fewer threads degrade gently where a thread per
    core stalls on every preempted one. `strata serve` spares one core for its HTTP process and
    the clients beside it: on 2 vCPUs its engine on 2 threads served one local client at
    221-244 tok/s against 278-317 on 1, and 8 clients no faster (bench/2026-12-06-cpu-serve.md)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    usable = usable_cores()
    given = isinstance(threads, int) and threads > 0  # (serve's flags: a sentinel when unset)
    n = min(threads, usable) if given else max(1, cpu_threads(usable) - spare)
    if n < usable or given:
        os.environ["OMP_NUM_THREADS"] = str(n)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _write_report(command: str, argv: list[str]) -> str:
    try:
        fd, path = tempfile.mkstemp(prefix=f"strata-{command}-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"strata {__version__}: strata {' '.join(argv)}\n\n")
            f.write(traceback.format_exc())
            torch = sys.modules.get("torch")  # (a GPU's out-of-memory: what the allocator held)
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                f.write("\n" + torch.cuda.memory_summary())
        return path
    except OSError:
        return "none written"


if __name__ == "__main__":
    sys.exit(main())
