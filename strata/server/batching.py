"""Continuous batching, in the engine process: the requests that run together share one forward
pass per step, and new requests join between steps.

One step (`BatchRunner.step`):
    plan     every active sequence contributes its pending tokens: its prompt in chunks
             (--prefill), then the token it sampled last; while others decode, the prompts
             add at most --prompt-while-decoding tokens to a step, oldest first (the others'
             next token waits for one such chunk, not a whole prompt); where the step mixes
             (below) or the pool has a scratch (CUDA), only the oldest prompt does, and a
             mixed step's chunk fills at most the rows the decoders leave
    forward  one MoETransformer.forward over all of them, one Segment (own KV cache) each, or
             one batched step over the pool (below)  -> [B, V]: each sequence's last row
    sample   every row at once, one wait for the device (strata.engine.sampling.sample_rows),
             each with its sequence's own torch.Generator, so a seed gives the same text whether
             the request ran alone or beside others
    finish   a stop token, max_tokens or a stop string ends a sequence: Finished, its KV rows
             kept in the prefix cache (prefix_cache.py) for a later prompt that starts alike

With --spec T (strata.engine.spec) a step of one decoding sequence is a verify window, which may
give several tokens; a step of several decoding sequences checks each one's window in one
forward (SpecDecoder.step_batch): the drafter drafts from the context alone (n-gram) or keeps
a state per sequence (a draft model, drafting for the batch together; the MTP head, whose plain
steps then run the forward: it needs each pass's hidden states). A sequence with a grammar
(response_format, a forced tool call) has each window row masked to what the grammar allows
after the drafts before it, its drafts cut before the first the grammar forbids
(constrain.Constraint.window).
Where no sequence drafted, the step is the plain one (the batched step).

With a decode step (the offload runtime) and --batch N (2..16) the sequences live in one KV pool
(kv_batch.py; strata.runtime.kv_slots: blocks of 16 rows, N sequences of the planned context,
allocated once): a step whose sequences all decode runs the batched step (strata.engine.
batch_step, CUDA graphs per batch size). A step of decoding sequences and a prompt's chunk that
fits the rows they leave (tuning.MIXED_STEP_ROWS in all: a chunk of a small
--prompt-while-decoding, or a prompt's short rest, e.g. a chat turn after its cached history)
mixes: one batched step carries every decoder's token and the chunk as rows of their own (their
expert reads shared), the prompt's logits used once its last chunk ran: the decoders' next token
waits for that one step, not for a prompt chunk's pass besides (the per-pair MoE kernels' cost
grows with the rows, so a prompt's tokens cost more here than on the prompt graphs: the default
--prompt-while-decoding, 512, keeps longer chunks on them). Where the step cannot mix (a larger
chunk; a hybrid's recurrent state moves one token a step; an MTP drafter needs each pass's hidden
states) it splits where the prompt fits the pool's scratch (CUDA, kv_batch.
prefill_scratch): the decoding sequences on the batched step, the prompt's chunk on the prompt
graphs in the scratch, its rows then copied into the pool; else it is one plain forward. A prompt
with no decoder beside it runs in the scratch where it fits; several prompts at once share one
plain forward. A finished or cancelled sequence's blocks are free at once; a request that finds the
pool full is refused with 429, and no other sequence is touched. With --prefix-cache, a finished
sequence's blocks stay indexed in the pool (until the pool needs them) and a prompt that starts
alike shares them, in place of the host copies of prefix_cache.py.

Legend: B sequences in the step, V vocab.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams, sample_rows
from strata.errors import StrataError
from strata.kernels.tuning import PREFILL_WHILE_DECODING
from strata.model.transformer import Segment
from strata.runtime.kv_cache import KVCache
from strata.runtime.kv_slots import PoolFull
from strata.runtime.waits import PROGRESS, StallError
from strata.server import kv_batch
from strata.server.faults import FaultTrigger
from strata.server.prefix_cache import PrefixCache
from strata.server.protocol import (
    Accepted,
    Cancel,
    Delta,
    Failed,
    Finished,
    Progress,
    Stalled,
    StepDone,
    Submit,
)
from strata.server.stops import StopText
from strata.tokenizer import StreamDecoder

_KV_START = 256  # generated tokens a new KV cache has room for before its first doubling
_STATE_S = 1.0  # the most often a step's Progress reads the pool, expert counters and GPU memory


@dataclass
class Sequence:
    rid: str
    prompt_len: int
    max_tokens: int
    params: SamplingParams
    gen: torch.Generator
    kv: KVCache
    stream: StreamDecoder
    stops: StopText
    pending: list[int]
    ignore_eos: bool = False
    generated: int = 0
    decode_steps: int = 0
    prefilled: bool = field(default=False)
    constraint: Any = None  # strata.engine.constrain.Constraint: response_format's grammar
    context: list[int] = field(default_factory=list)  # the prompt and the tokens generated
    cached: int = 0  # prompt tokens whose KV rows came from the prefix cache


class BatchRunner:
    def __init__(self, engine: Engine, send: Callable[[object], None], faults: FaultTrigger,
                 prefix_cache_bytes: int = 0, prompt_while_decoding: int | None = None):
        self.engine = engine
        self.prompt_while_decoding = prompt_while_decoding or PREFILL_WHILE_DECODING
        self.send = send
        self.faults = faults
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.seqs: dict[str, Sequence] = {}
        self.stage = "idle"
        self.pool, self.batch_step = kv_batch.batched(engine)
        self.scratch = kv_batch.prefill_scratch(engine, self.pool)
        self._scratch_for: str | None = None  # the sequence whose rows the scratch holds
        self._slow: dict = {}  # state()'s costly part, read at _slow_at (time.monotonic)
        self._slow_at = -_STATE_S

    @property
    def active(self) -> int:
        return len(self.seqs)

    def warm_up(self) -> float:
        """The first passes at load (server.warmup's; over the batch's KV pool where there is
        one: kv_batch.warm_up). -> seconds"""
        if self.pool is None:
            from strata.server.warmup import warm_up

            return warm_up(self.engine)
        return kv_batch.warm_up(self.engine, self.pool, self.batch_step, self.scratch)

    def handle(self, msg: Submit | Cancel) -> None:
        if isinstance(msg, Cancel):
            self.cancel(msg.rid)
        else:
            self.submit(msg)

    def submit(self, sub: Submit) -> None:
        """Tokenize and check a request; it joins the batch at the next step. A request that
        breaks the checks themselves fails alone (500, its traceback in the log), as a failed
        step fails its requests: the engine serves on."""
        try:
            seq = self._make_sequence(sub)
        except _Reject as r:
            self.send(Failed(sub.rid, r.status, r.message, r.param, r.code))
            return
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.send(Failed(sub.rid, 500, f"the engine could not take the request: "
                             f"{type(e).__name__}: {e}"))
            return
        self.seqs[sub.rid] = seq
        self.send(Accepted(sub.rid, seq.prompt_len, seq.max_tokens))

    def cancel(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)  # dropping the sequence frees its KV cache
        if seq is not None:
            self.prefix.store(seq.context, seq.kv)  # (the rows written so far are whole)
            self._release(seq)
            self.send(Finished(rid, "cancelled", seq.prompt_len, seq.generated,
                               cached_tokens=seq.cached))
            if not self.seqs and self.pool is not None:  # idle (as after a step): it holds
                self.pool.check_integrity()

    def step(self) -> None:
        batch = list(self.seqs.values())
        take = self._takes(batch)  # the tokens each adds to this pass
        batch = [s for s in batch if take[s.rid]]  # (a prompt past this step's budget waits)
        prompt = [s for s in batch if not s.prefilled]
        # decoders and a prompt's chunk in one batched step where the chunk fits its rows, or
        # else split
        mixed = (bool(prompt) and len(prompt) < len(batch) and self._mixes()
                 and sum(len(take[s.rid]) for s in batch) <= self.batch_step.rows_max)
        scratch = None if mixed else self._scratch_prompt(prompt)  # its rows come last
        if scratch is not None:
            batch = [s for s in batch if s.prefilled] + [scratch]
        self.stage = "prompt" if prompt else "decode"
        self.send(Progress(self.stage, self._detail(batch, take), state=self.state(fresh=False)))
        PROGRESS.at(self.stage, position=batch[0].kv.length)
        t0 = time.perf_counter()
        spec, window, windows = getattr(self.engine, "spec", None), None, None
        tokens = torch.tensor([t for s in batch for t in take[s.rid]])  # [sum of takes]
        segments = [Segment(s.kv, len(take[s.rid])) for s in batch]
        # several sequences decoding, one token each: their verify windows in one forward
        together = (spec is not None and len(batch) > 1 and not prompt
                    and len(tokens) == len(batch) and spec.batches)
        try:
            for s in batch:  # injected faults strike inside the step, as real ones would
                self.faults.at(*(("decode", s.decode_steps + 1) if s.prefilled else ("prefill",)))
            if together:
                windows = self._windows(spec, batch)  # None: no sequence drafted
            if windows is not None:
                logits = []
            elif len(batch) == 1 and not prompt and len(tokens) == 1 and spec is not None:
                window = self._window(spec, batch[0])  # one sequence: a verify window
                logits = []
            elif len(batch) == 1 and not prompt and len(tokens) == 1:  # one sequence decoding
                logits = self.engine.model.decode(int(tokens[0]), batch[0].kv)
            elif mixed or (not prompt and self.batch_step is not None
                           and len(tokens) == len(batch)
                           and not (spec is not None and spec.needs_hidden)):
                # several sequences decoding: the batched step, one token each (and beside
                # them, mixed, a prompt's chunk)
                logits = self.batch_step(tokens.tolist(), [s.kv for s in batch],
                                         [len(take[s.rid]) for s in batch])
            elif scratch is not None:
                logits = self._split(batch[:-1], scratch, take)
            else:
                logits = self.engine.model.forward(tokens, segments)  # [B, V]
        except StallError as e:  # a bounded wait ran out: the GPU or a worker is stuck
            self.send(Stalled(str(e), self.state()))
            while True:  # keep every thread as it is for the report; the server stops us
                time.sleep(3600)
        except Exception as e:  # a failed step fails its requests; the engine serves on
            traceback.print_exc(file=sys.stderr)
            for s in batch:
                if self.seqs.pop(s.rid, None) is not None:
                    self._release(s)
                self.send(Failed(s.rid, 500, f"the engine failed in a {self.stage} step: "
                                 f"{type(e).__name__}: {e}"))
            return
        PROGRESS.steps += 1
        if together and windows is None:  # (a plain step: the windows' measure against it)
            spec.plain_batch([s.rid for s in batch], time.perf_counter() - t0)
        if window is not None:  # (one sequence's window, or a plain step: none drafted)
            windows = ([window[0]], [(window[1], window[2])] if window[1] else [])
        if windows is not None:
            for s, out in zip(batch, windows[0], strict=True):
                if s.rid not in self.seqs:  # (failed in the window: its grammar)
                    continue
                s.pending, s.decode_steps = [], s.decode_steps + 1
                for token in out:  # a stop ends the sequence (its KV cache with it) mid-window
                    if s.rid in self.seqs:
                        self._advance(s, token)
        ready = []  # (sequence, its row in logits) for the sequences that take a token now
        for i, s in enumerate(batch if windows is None else []):
            s.pending = s.pending[len(take[s.rid]):]
            if s.pending:
                continue  # more prompt chunks to come: this chunk's logits are not needed
            if s.prefilled:
                s.decode_steps += 1
            s.prefilled = True
            ready.append((s, i))
        for s, token in self._sample(logits, ready):
            self._advance(s, token)
        stats = getattr(self.engine.model.experts, "stats", None)
        decoded = (len(batch) - len(prompt) if windows is None
                   else sum(len(out) for out in windows[0]))
        each = windows[1] if windows is not None else []
        self.send(StepDone(sum(len(take[s.rid]) for s in prompt), decoded,
                           time.perf_counter() - t0, self.active,
                           getattr(stats, "hit_rate", None), sum(d for d, _ in each),
                           sum(a for _, a in each), tuple(each) if len(each) > 1 else ()))
        self.stage = "decode" if self.seqs else "idle"
        if not self.seqs and self.pool is not None:  # idle: the pool's accounting holds
            self.pool.check_integrity()

    def _mixes(self) -> bool:
        """A step of decoding sequences and a prompt runs as one batched step, the prompt's
        chunk rows beside the others' tokens: where there is a batched step whose pool holds no
        recurrent state (a hybrid's state moves one token a step) and no MTP drafter needs
        each pass's hidden states. (Verify windows never run in a step with a prompt.)"""
        spec = getattr(self.engine, "spec", None)
        return (self.batch_step is not None and self.pool.conv is None
                and not (spec is not None and spec.needs_hidden))

    def _scratch_prompt(self, prompt: list[Sequence]) -> Sequence | None:
        """The step's one prompt, where it runs in the scratch (on the prompt graphs): a step
        with several prompts runs them in one plain forward instead (each graph replay is a
        prompt of its own; one eager pass takes them all)."""
        if self.scratch is None or len(prompt) != 1:
            return None
        spec = getattr(self.engine, "spec", None)
        if spec is not None and spec.needs_hidden:
            return None  # (the decoders' hidden states go to an MTP drafter: one forward)
        s = prompt[0]
        return s if s.prompt_len <= self.scratch.capacity else None  # (its rows fit)

    def _split(self, decoding: list[Sequence], s: Sequence,
               take: dict[str, list[int]]) -> torch.Tensor:
        """A step of one prompt chunk beside decoding sequences: these on the batched step (or
        the decode step), the chunk in the scratch on the prompt graphs, its rows then into the
        pool. -> logits [len(decoding) + 1, V]: the decoding rows, then the chunk's last."""
        model, parts = self.engine.model, []
        if len(decoding) == 1:
            parts.append(model.decode(take[decoding[0].rid][0], decoding[0].kv))
        elif decoding:
            parts.append(self.batch_step([take[d.rid][0] for d in decoding],
                                         [d.kv for d in decoding]))
        sc = self.scratch
        if self._scratch_for != s.rid or sc.length != s.kv.length:
            # (its rows so far: a shared prefix, or chunks that ran in a plain forward beside
            # other prompts)
            kv_batch.from_pool(s.kv, sc)
            self._scratch_for = s.rid
        start, n = s.kv.length, len(take[s.rid])
        parts.append(model.forward(torch.tensor(take[s.rid]), [Segment(sc, n)]))
        kv_batch.to_pool(sc, s.kv, start, start + n)
        s.kv.advance(n)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _window(self, spec, s: Sequence) -> tuple[list[int], int, int]:  # noqa: ANN001
        """One decode step of `s` through spec (a SpecDecoder): (tokens, drafted, accepted).
        Injected verify faults strike inside the window, after its marks exist."""
        if spec.sequence != s.rid:
            spec.new_sequence(s.rid)
        n = spec.stats.windows
        spec.before_window = lambda marks: self.faults.at("verify", n + 1, window=marks)
        drafted, accepted = spec.stats.drafted, spec.stats.accepted
        out = spec.step(s.context, s.kv, s.params, s.gen, s.max_tokens - s.generated,
                        s.constraint)
        return out, spec.stats.drafted - drafted, spec.stats.accepted - accepted

    def _windows(self, spec, batch: list[Sequence],  # noqa: ANN001 (a SpecDecoder)
                 ) -> tuple[list[list[int]], list[tuple[int, int]]] | None:
        """One step of several decoding sequences through their verify windows in one forward
        (spec.step_batch): (each one's tokens, each window's (drafted, accepted)), or None
        where none drafted. Injected verify faults strike inside the pass, after its marks
        exist."""
        from strata.engine.spec import Decoding

        n = spec.stats.windows
        spec.before_window = lambda marks: self.faults.at("verify", n + 1, window=marks)
        out = spec.step_batch([Decoding(s.rid, s.context, s.kv, s.params, s.gen,
                                        s.max_tokens - s.generated, s.constraint)
                               for s in batch])
        if out is None:
            return None
        for s, got in zip(batch, out, strict=True):
            if isinstance(got, StrataError):  # its grammar failed: it alone fails
                self._fail_grammar(s, got)
        out = [((), 0) if isinstance(got, StrataError) else got for got in out]
        return [list(t) for t, _ in out], [(d, len(t) - 1) for t, d in out if d]

    def _sample(self, logits: torch.Tensor, ready: list[tuple[Sequence, int]]
                ) -> list[tuple[Sequence, int]]:
        """The next token of each ready sequence from its row of logits [B, V], all in one wait
        for the device; with a grammar, only one it allows (the rest at -inf). A grammar that
        fails fails its request; the others go on."""
        rows, seqs = [], []
        for s, i in ready:
            try:
                rows.append(logits[i] if s.constraint is None else s.constraint.mask(logits[i]))
                seqs.append(s)
            except StrataError as e:
                self._fail_grammar(s, e)
        if not seqs:
            return []
        whole = len(seqs) == len(logits) and all(s.constraint is None for s in seqs)
        tokens = sample_rows(logits if whole else torch.stack(rows), [s.params for s in seqs],
                             [s.gen for s in seqs])
        out = []
        for s, token in zip(seqs, tokens, strict=True):
            try:
                if s.constraint is not None:
                    s.constraint.accept(token)
                out.append((s, token))
            except StrataError as e:
                self._fail_grammar(s, e)
        return out

    def _fail_grammar(self, s: Sequence, e: StrataError) -> None:
        self.seqs.pop(s.rid, None)
        self._release(s)
        self.send(Failed(s.rid, 500, f"constrained decoding failed: {e}"))

    def _takes(self, batch: list[Sequence]) -> dict[str, list[int]]:
        """Each sequence's tokens for the next pass. While some decode, the prompts' tokens
        in it are at most prompt_while_decoding (--prompt-while-decoding), oldest first, so a
        long prompt arriving holds the others' next token for one such chunk at a time, not for
        a whole prompt chunk. Where steps may mix (_mixes) or the pool has a scratch (CUDA),
        one prompt at a time: its chunk rides in the decoders' batched step where it fits the
        rows they leave (tuning.MIXED_STEP_ROWS in all: a chunk of --prompt-while-decoding 16
        beside up to 16 decoders, or a prompt's short rest), else the step splits onto the
        prompt graphs instead of one eager forward for several prompts."""
        decoding = sum(s.prefilled for s in batch)
        budget = self.prompt_while_decoding if decoding else None
        prompts = 1 if decoding and (self._mixes() or self.scratch is not None) else len(batch)
        take = {}
        for s in batch:
            t = self._take(s)
            if budget is not None and not s.prefilled:
                t = t[:budget] if prompts > 0 else []
                budget -= len(t)
                prompts -= 1
            take[s.rid] = t
        return take

    def _take(self, s: Sequence) -> list[int]:
        """A decoding sequence's last token, or the next chunk of a prompt (--prefill)."""
        if s.prefilled:
            return s.pending
        chunk = getattr(self.engine, "prefill_chunk", None)
        return s.pending[:chunk(s.prompt_len)] if chunk else s.pending

    def state(self, fresh: bool = True) -> dict:
        """What a stall report shows about the batch (ints and strings). Not `fresh` (a step's
        Progress): the pool, expert counters and GPU memory as read at most _STATE_S ago."""
        seqs = [(s.rid, s.kv.length, s.decode_steps, s.generated) for s in self.seqs.values()]
        state: dict = {"requests": seqs, "kv_bytes": sum(s.kv.nbytes for s in self.seqs.values())}
        if PROGRESS.last_wait:
            state["gpu_wait"] = f"{PROGRESS.last_wait} ({PROGRESS.describe()})"
        now = time.monotonic()
        if fresh or now - self._slow_at >= _STATE_S:
            self._slow, self._slow_at = self._slow_state(), now
        return state | self._slow

    def _slow_state(self) -> dict:
        """The part of state() that costs more: lines, expert counters (a settle), memory."""
        state: dict = {}
        if self.pool is not None:  # the batch's KV pool and step
            p = self.pool
            state["kv_pool"] = (f"{p.used} of {p.n_slots} slots, {p.used_blocks} of "
                                f"{p.n_blocks} blocks of {p.block} rows used "
                                f"({len(p.index)} indexed for prefixes)")
            state["batch_step"] = self.batch_step.line()
        stats = getattr(self.engine.model.experts, "stats", None)
        if hasattr(stats, "summary"):  # the offload runtime's counters: hits, CPU, streamed
            state["experts"] = stats.summary()
        if self.engine.model.device.type == "cuda":
            state["gpu_allocated"] = torch.cuda.memory_allocated()
            state["gpu_reserved"] = torch.cuda.memory_reserved()
        return state

    def _detail(self, batch: list[Sequence], take: dict[str, list[int]]) -> str:
        parts = [f"{s.rid} " + (f"prompt tokens {s.kv.length}..{s.kv.length + len(take[s.rid])} "
                                f"of {s.prompt_len}" if not s.prefilled else
                                f"decode step {s.decode_steps + 1} at position {s.kv.length}")
                 for s in batch]
        return f"{len(batch)} sequence(s): " + "; ".join(parts)

    def _advance(self, s: Sequence, token: int) -> None:
        ends = not s.ignore_eos or s.constraint is not None  # a grammar's EOS ends it
        if token in self.engine.tokenizer.stop_ids and ends:
            self._finish(s, "stop")
            return
        s.generated += 1
        s.context.append(token)
        # a Delta for every token, text or not (a control token, an unfinished character, text
        # a stop string holds back): a stream shows each token as it comes
        self.send(Delta(s.rid, s.stops.push(s.stream.push(token)), s.generated))
        if s.stops.stopped:
            self._finish(s, "stop")
        elif s.generated >= s.max_tokens:
            self._finish(s, "length")
        else:
            s.pending = [token]

    def _finish(self, s: Sequence, reason: str) -> None:
        tail = ""
        if not s.stops.stopped:
            tail = s.stops.push(s.stream.flush())
            tail += s.stops.flush()
            reason = "stop" if s.stops.stopped else reason
        del self.seqs[s.rid]
        self.prefix.store(s.context, s.kv)
        self._release(s)
        self.send(Finished(s.rid, reason, s.prompt_len, s.generated, tail, s.cached))

    def _release(self, s: Sequence) -> None:
        """A sequence that left: its KV pool blocks are free at once (or, with --prefix-cache,
        kept indexed for a later prompt that starts alike), its verify window state dropped."""
        spec = getattr(self.engine, "spec", None)
        if spec is not None:
            spec.forget(s.rid)
        if self.pool is not None and getattr(s.kv, "slots", None) is self.pool:
            if self.prefix.max_bytes > 0:
                self.pool.keep(s.context, s.kv)
            self.pool.give(s.kv)

    def _make_sequence(self, sub: Submit) -> Sequence:
        eng = self.engine
        where = sub.where or ("messages" if sub.messages is not None else "prompt")
        try:
            if sub.messages is not None:
                ids = eng.chat.encode(sub.messages, True, **sub.template_kwargs)
                if sub.prefix:
                    ids += eng.tokenizer.encode(sub.prefix, False, True)
            elif isinstance(sub.prompt, str):
                ids = eng.tokenizer.encode(sub.prompt)
            else:
                ids = list(sub.prompt or [])
                bad = [i for i in ids if not 0 <= i < eng.config.n_vocab]
                if bad:
                    raise _Reject(f"token id {bad[0]} is outside the vocabulary "
                                  f"(0..{eng.config.n_vocab - 1})", "prompt")
        except StrataError as e:
            raise _Reject(str(e), where) from None
        if not ids:
            raise _Reject("the prompt is empty", where)
        room = eng.config.context_length - len(ids)
        if self.pool is not None:  # (a slot holds the planned context)
            if len(ids) >= self.pool.capacity:
                raise _Reject(f"prompt of {len(ids)} tokens exceeds the {self.pool.capacity} "
                              "KV rows a sequence holds (--ctx); shorten the " + where, where,
                              "context_length_exceeded")
            room = min(room, self.pool.capacity - len(ids))
        max_tokens = min(sub.max_tokens_limit, room) if sub.max_tokens is None else sub.max_tokens
        try:
            eng.check_prompt(ids, max(max_tokens, 1))
        except StrataError as e:
            raise _Reject(f"{e}; shorten the {where} or lower max_tokens", where,
                          "context_length_exceeded") from None
        try:
            params = SamplingParams(**sub.sampling, max_tokens=max_tokens)
        except StrataError as e:
            raise _Reject(str(e), str(e).split("=")[0]) from None
        gen = torch.Generator()
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        capacity = len(ids) + min(max_tokens, _KV_START)  # grows by doubling when needed
        constraint = None
        if sub.grammar is not None:
            from strata.engine.constrain import Constraint

            try:
                constraint = Constraint(sub.grammar, eng.tokenizer, eng.config.n_vocab)
            except StrataError as e:
                raise _Reject(str(e), "response_format") from None
        stream = eng.tokenizer.stream(skip_special=not sub.keep_special)
        if self.pool is None:
            kv = eng.model.new_cache(capacity)
        elif max_tokens > self.pool.capacity - len(ids):
            raise _Reject(f"prompt of {len(ids)} tokens + {max_tokens} to generate exceeds the "
                          f"{self.pool.capacity} KV rows a sequence holds (--ctx); shorten the "
                          f"{where} or lower max_tokens", where, "context_length_exceeded")
        else:
            try:
                kv = self.pool.take()
            except PoolFull as e:
                raise _Reject(str(e), None, "pool_full", 429) from None
        if self.pool is not None and self.pool.paged and self.prefix.max_bytes > 0:
            cached = self.pool.lookup(ids, kv)  # blocks shared with an earlier request
        else:
            cached = self.prefix.lookup(ids, kv)  # rows 0..cached-1 copied from one
        return Sequence(sub.rid, len(ids), max_tokens, params, gen, kv, stream,
                        StopText(sub.stop), ids[cached:], sub.ignore_eos, constraint=constraint,
                        context=list(ids), cached=cached)


class _Reject(Exception):
    def __init__(self, message: str, param: str | None, code: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

