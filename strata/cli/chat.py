"""strata chat: an interactive multi-turn chat in the terminal, on generate's engine flags.

Each turn renders the whole conversation with the model's chat template; the KV cache keeps the
tokens of the turns before, so only the tokens past their longest common prefix with the new
prompt run (the model sees exactly what the template renders). Oldest turns are dropped when the
prompt and a reply of -n tokens would not fit in the context. Ctrl-C during an answer stops it;
at the prompt it ends the program (exit code 130); /exit or end of input ends it with 0.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from strata.cli.engine_flags import add_engine_arguments
from strata.cli.generate import load_engine, sampling_params
from strata.cli.limits import check_kv_memory
from strata.errors import StrataError
from strata.runtime.kv_cache import common_prefix

PROMPT = ">>> "
HELP = "strata: /reset forgets the conversation, /exit (or Ctrl-D) ends; Ctrl-C stops an answer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (any shard of a split set); "
                   "without it, the built-in demo model")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message at the start of the conversation (none)")
    p.add_argument("-n", "--max-tokens", type=int, default=512,
                   help="most tokens in one answer; the context keeps room for them (512)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (0.95)")
    p.add_argument("--top-k", type=int, default=40, help="0 turns it off (40)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top (0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    add_engine_arguments(p)


@dataclass
class Conversation:
    """The messages of a chat and the prompt ids they render to, kept within `limit` tokens
    (the prompt plus `reply` tokens of answer)."""

    chat: Any  # strata.tokenizer.ChatTemplate
    system: str | None
    limit: int
    reply: int
    turns: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant)

    def messages(self, user: str | None = None) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return out + ([{"role": "user", "content": user}] if user is not None else [])

    def prompt(self, user: str) -> tuple[list[int], int]:
        """(prompt ids for the conversation with `user` next, turns dropped to make it fit);
        a StrataError when the message alone does not fit."""
        dropped = 0
        while True:
            ids = self.chat.encode(self.messages(user), add_bos=False)
            if len(ids) + self.reply <= self.limit:
                return ids, dropped
            if not self.turns:
                raise StrataError(f"the message is {len(ids)} tokens; with -n {self.reply} it "
                                  f"does not fit the context of {self.limit} tokens")
            self.turns.pop(0)
            dropped += 1


class Session:
    """The engine, one KV cache and the tokens it holds (`cached`, a prefix of the last prompt
    and answer), reused by the next prompt as far as it extends them."""

    def __init__(self, engine: Any, capacity: int):
        self.engine = engine
        self.capacity = capacity
        self.kv: Any = None
        self.cached: list[int] = []
        self.reused = 0  # prompt tokens the last answer found in the cache
        self.finish = ""

    @property
    def ran(self) -> int:
        """Prompt tokens the last answer ran (those not found in the cache)."""
        return self.engine.stats.prompt_tokens

    def reset(self) -> None:
        self.kv, self.cached = None, []

    def answer(self, ids: list[int], params: Any) -> Any:
        """Yield the answer's token ids (not the stop token); the cache keeps what it ran."""
        eng = self.engine
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)  # >= 1 token runs: its logits
        if self.kv is None or keep == 0:
            self.kv, keep = eng.model.new_cache(self.capacity), 0
        self.kv.truncate(keep)  # (a hybrid model's cache restarts below its length)
        self.reused, self.finish = self.kv.length, ""
        self.cached = list(ids)  # and the answer: settle cuts it to what the cache holds
        for token in eng.generate(ids, params, kv=self.kv):
            self.cached.append(token)
            yield token
        self.finish = eng.stats.finish_reason
        self.settle()

    def settle(self) -> None:
        """After an answer, or an interrupted one: the cache holds only the tokens it committed
        (the last token sampled is not in it)."""
        if self.kv is not None:
            self.cached = self.cached[:self.kv.length]
            self.kv.truncate(len(self.cached))

    def line(self, generated: int) -> str:
        st = self.engine.stats
        if self.finish == "stopped" and not generated and not st.prompt_s:
            return (f"strata: stopped in the prompt of {st.prompt_tokens} new tokens "
                    f"({self.reused} reused); nothing answered")
        pre = st.prompt_tokens / st.prompt_s if st.prompt_s else 0.0
        tok_s = st.decode_tok_s  # (tokens: a verify window gives several a step)
        return (f"strata: prompt {st.prompt_tokens} new tokens ({self.reused} reused) at "
                f"{pre:.1f} tok/s; answer {generated} tokens at {tok_s:.1f} tok/s "
                f"({self.finish})")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:  # (an answer of none: every turn would end before it begins)
        raise StrataError(f"-n {args.max_tokens}: give at least 1 token an answer")
    params = sampling_params(args)
    engine = load_engine(args)
    limit = min(engine.config.context_length, engine.engine_config.ctx
                or getattr(engine.model, "plan_ctx", None) or 4096)
    if args.max_tokens >= limit:
        raise StrataError(f"-n {args.max_tokens}: leaves no room for a prompt in the context "
                          f"of {limit} tokens (--ctx)")
    check_kv_memory(engine, limit, "--ctx")
    conv = Conversation(engine.chat, args.system, limit, args.max_tokens)
    session = Session(engine, limit)
    try:
        import readline  # noqa: F401 (line editing and history for input())
    except ImportError:
        pass
    print(f"strata: loaded in {engine.load_s:.2f} s; context {limit} tokens", file=sys.stderr)
    print(HELP, file=sys.stderr)
    return loop(conv, session, params, sys.stdout)


def loop(conv: Conversation, session: Session, params: Any, out: TextIO) -> int:
    tok = session.engine.tokenizer
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            conv.turns.clear()
            session.reset()
            print("strata: the conversation is forgotten", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:
            print(f"strata: {text}: unknown command; {HELP[8:]}", file=sys.stderr)
            continue
        try:
            ids, dropped = conv.prompt(line)
        except StrataError as e:
            print(f"strata chat: {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"strata: dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} to fit "
                  f"the context of {conv.limit} tokens", file=sys.stderr)
        stream, reply, n = tok.stream(skip_special=True), [], 0
        try:
            for token in session.answer(ids, params):
                n += 1
                piece = stream.push(token)
                reply.append(piece)
                out.write(piece)
                out.flush()
            reply.append(stream.flush())
            out.write(reply[-1] + "\n")
            out.flush()
        except KeyboardInterrupt:
            session.settle()
            session.finish = "stopped"
            out.write("\n")
            out.flush()
        conv.turns.append((line, "".join(reply)))
        print(session.line(n), file=sys.stderr)
