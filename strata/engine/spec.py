"""Speculative decoding: a drafter proposes up to T tokens, one verify window checks them.

One step (`SpecDecoder.step`), the context ending with the last sampled token (not yet in the
KV cache, as in the plain loop):
    draft    d_1 .. d_k = drafter.propose(context, k), k the adaptive window's size (<= --spec T)
    verify   one forward of [last, d_1 .. d_k] with all logits -> L_0 .. L_k  [k+1, V]: every
             layer runs the window's tokens together, so each routed expert is read once for
             all of them (the offload executor groups a pass's pairs by expert)
    accept   greedy: d_i while it is argmax L_{i-1}; sampled: d_i with probability p_{i-1}(d_i),
             else one token from the residual p_{i-1} without d_i (a point-mass drafter's
             rejection sampling: the output follows the target's distribution exactly)
    next     the first rejection's residual token, or after k accepted one from L_k
    rollback the KV cache back to the last accepted token, and the recurrent state of the
             linear-attention layers with it (the window kept the state after each of its
             tokens: KVCache.open_window / rollback)
With no draft (no n-gram match, the window off) the step is a plain decode step.

Every wait is bounded: the window's forward marks each layer (a CUDA event after it on the
GPU), and the host waits for the last mark with a deadline; one that does not come raises
StallError naming the verify window, its size and the first layer the GPU did not finish.

Legend: k drafted tokens in the window, V vocab.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from strata.engine.sampling import SamplingParams, probabilities, sample
from strata.errors import StrataError
from strata.kernels.tuning import (
    SPEC_ACCEPT_WEIGHT,
    SPEC_OFF_ACCEPT,
    SPEC_OFF_MAX,
    SPEC_OFF_STEPS,
    SPEC_PROBE_SHARE,
    SPEC_SLOWER,
    SPEC_START_STEPS,
)
from strata.runtime.kv_cache import KVCache
from strata.runtime.waits import DEFAULT_TIMEOUT_S, PROGRESS, StallError, to_host, wait_event


@dataclass
class SpecStats:
    """Drafted and accepted tokens, in all and by position in the window (0: the first draft)."""

    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0  # decode steps without a window (no draft, or the window off)
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    window_s: float = 0.0
    window_tokens: int = 0  # tokens the windows gave (accepted + one each)
    plain_s: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, drafted: int, accepted: int, seconds: float) -> None:
        self.windows += 1
        self.drafted += drafted
        self.accepted += accepted
        self.window_s += seconds
        self.window_tokens += accepted + 1
        grow = drafted - len(self.drafted_at)
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at,
                                                    strict=True)]

    def line(self) -> str:
        pos = " ".join(f"{a:.2f}" for a in self.by_position())
        rate = self.window_tokens / self.window_s if self.window_s else 0.0
        plain = self.plain_steps / self.plain_s if self.plain_s else 0.0
        return (f"spec: {self.windows} windows, {self.drafted} drafted, {self.accepted} accepted "
                f"({100 * self.acceptance:.1f}%; by position {pos or '-'}); "
                f"{self.window_tokens} tokens from windows at {rate:.1f} tok/s; "
                f"{self.plain_steps} plain decode steps at {plain:.1f} tok/s")

    def as_dict(self) -> dict:
        return {"windows": self.windows, "drafted": self.drafted, "accepted": self.accepted,
                "drafted_at": list(self.drafted_at), "accepted_at": list(self.accepted_at),
                "plain_steps": self.plain_steps, "plain_s": self.plain_s,
                "window_s": self.window_s,
                "window_tokens": self.window_tokens}


class Window:
    """The adaptive window size: one more after a window accepted whole, one less after one
    that accepted nothing; off (size 0) for SPEC_OFF_STEPS steps while the running acceptance
    is below SPEC_OFF_ACCEPT (then one window of 1 probes again; a probe that fails turns them
    off twice as long, up to SPEC_OFF_MAX, until a window accepts a draft), or while a window's
    seconds per token exceed a plain step's by SPEC_SLOWER (both running means; plain steps are
    timed while no draft comes and while the window is off, but not the one right after a
    window, which may pay for it: on an H100 at a 4 GiB budget windows costing ~30 plain steps
    were never judged slower than it, so it took over 7 (inferred, not profiled:
    bench/2026-12-06-h100-glue.md); a window with no plain step timed yet, a first one that may
    pay one-time costs, is not judged, and two plain steps follow it, nor is one that captured
    its size's CUDA graph (on an H100 the demo model's sampled runs gave two windows of 17-28 ms
    each against ~1 ms plain steps, then turned them off: inferred as capture costs, not
    profiled; bench/2026-12-07-h100-attention-demospec.md): then twice as long each time in
    a row, and at least as long as keeps the windows' cost in the pause's plain steps to
    SPEC_PROBE_SHARE, up to SPEC_OFF_MAX. `costs` (the decoder's, shared by its sequences)
    keeps what a window pass costs in plain steps by its drafts: a new sequence's windows start
    off where even a window accepted whole would be slower, and start at 1 draft where a full
    window costs many plain steps."""

    def __init__(self, limit: int, timed: bool = True, costs: PassCosts | None = None):
        self.limit, self.size, self.mean, self.off = limit, limit, 1.0, 0
        self.timed = timed  # False: acceptance alone decides (tests that count windows)
        self.window_s: float | None = None  # seconds per token, running means
        self.plain_s: float | None = None
        self.backoff = SPEC_OFF_STEPS  # the next time-based pause
        self.accept_backoff = SPEC_OFF_STEPS  # the next acceptance-based pause
        self.costs = costs if costs is not None else PassCosts()
        self.after_window = False  # the next plain step follows a window: not timed
        if timed:
            self.off = self.costs.pause_for(limit)
            self.size = self.costs.start_size(limit)

    def next_size(self) -> int:
        if self.off:
            self.off -= 1
            return 0
        return self.size

    def plain(self, seconds: float) -> None:
        """A plain decode step took `seconds` (the first after a window is not taken)."""
        if self.after_window:
            self.after_window = False
            return
        self.plain_s = _mean(self.plain_s, seconds)

    def update(self, drafted: int, accepted: int, seconds: float | None = None,
               one_time: bool = False) -> None:
        """A window of `drafted` drafts accepted `accepted` of them in `seconds`; one_time: it
        also paid a one-time cost (its size's CUDA graph captured after an eager pass), so it
        is not judged (nor is the plain step after it timed)."""
        if seconds is not None and self.timed:
            self.after_window = True
            if self.plain_s is None:
                self.off = max(self.off, 2)  # (two plain steps next: the second is timed)
            elif not one_time:
                self._judge(drafted, accepted, seconds)
        self.mean += SPEC_ACCEPT_WEIGHT * (accepted / drafted - self.mean)
        if accepted == drafted:
            self.size = min(self.limit, self.size + 1)
        elif accepted == 0:
            self.size = max(1, self.size - 1)
        if self.mean < SPEC_OFF_ACCEPT:  # (each pause in a row twice the last)
            self.off = max(self.off, self.accept_backoff)
            self.size, self.mean = 1, SPEC_OFF_ACCEPT
            self.accept_backoff = min(2 * self.accept_backoff, SPEC_OFF_MAX)
        elif accepted:
            self.accept_backoff = SPEC_OFF_STEPS

    def _judge(self, drafted: int, accepted: int, seconds: float) -> None:
        """A timed window against plain steps: its cost into the decoder's, and a pause where
        its seconds per token exceed a plain step's by SPEC_SLOWER."""
        self.window_s = _mean(self.window_s, seconds / (accepted + 1))
        self.costs.add(drafted, seconds / self.plain_s)
        if self.window_s > SPEC_SLOWER * self.plain_s:
            # (the plain steps one such window loses, kept to a share of the pause)
            # (at most 4x the doubling pause: one window slowed by something else, a
            # preempted thread say, does not turn them off for long)
            lost = (self.window_s / self.plain_s - 1) * (accepted + 1)
            self.off = max(self.off, min(SPEC_OFF_MAX, 4 * self.backoff,
                                         max(self.backoff, math.ceil(lost / SPEC_PROBE_SHARE))))
            self.window_s = None  # (measured afresh after)
            self.backoff = min(2 * self.backoff, SPEC_OFF_MAX)
        else:
            self.backoff = SPEC_OFF_STEPS


class PassCosts:
    """What a window pass of k drafts costs in plain decode steps (running means by k, over
    every sequence of one decoder): the engine's, not the text's. A window of k drafts gives at
    most k + 1 tokens, so where it costs more than (k + 1) / SPEC_SLOWER plain steps no
    acceptance pays for it: a new sequence's windows then start off (pause_for)."""

    def __init__(self) -> None:
        self.steps: dict[int, float] = {}
        self.seen: dict[int, int] = {}  # windows measured, by drafts

    def add(self, drafted: int, steps: float) -> None:
        self.steps[drafted] = _mean(self.steps.get(drafted), steps)
        self.seen[drafted] = self.seen.get(drafted, 0) + 1

    def _known(self, limit: int) -> dict[int, float]:
        """The costs of sizes up to `limit` measured in at least two windows (one alone may
        have been slowed by something else)."""
        return {k: c for k, c in self.steps.items() if k <= limit and self.seen[k] >= 2}

    def start_size(self, limit: int) -> int:
        """A new sequence's first window: `limit` drafts, or 1 where a full window is known to
        cost more than SPEC_START_STEPS plain steps (a first window that finds no acceptance
        then loses little; each window accepted whole adds one)."""
        full = self._known(limit).get(limit)
        return 1 if full is not None and full > SPEC_START_STEPS else limit

    def pause_for(self, limit: int) -> int:
        """Steps a new sequence's windows stay off: none while some window size up to `limit`
        could pay, else as long as keeps the cheapest one's loss to SPEC_PROBE_SHARE."""
        known = self._known(limit)
        if not known or any(c * SPEC_SLOWER < k + 1 for k, c in known.items()):
            return 0
        lost = min(c - 1 for c in known.values())
        return min(SPEC_OFF_MAX, max(SPEC_OFF_STEPS, math.ceil(lost / SPEC_PROBE_SHARE)))


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + SPEC_ACCEPT_WEIGHT * (new - old)


class LayerMarks:
    """Where a window's forward stands: PROGRESS.layer after each layer, and on the GPU an
    event recorded after it (`event`: a factory of objects with record() and query(), CUDA
    events by default), so a wait that runs out can say which layer never finished."""

    def __init__(self, tokens: int, position: int, n_layers: int, device: torch.device,
                 event: Callable[[], object] | None = None, sequences: int = 1):
        self.tokens, self.position, self.n_layers = tokens, position, n_layers
        self.sequences = sequences  # several: the windows of a batch in one forward
        self.event = event or (torch.cuda.Event if device.type == "cuda" else None)
        self.events: list = []
        # set by a pass that ran as one (a window replayed from a CUDA graph,
        # strata.engine.chunk_graph): every mark was recorded after all its layers, so a stall
        # cannot say in which layer the GPU stopped
        self.whole_pass = False

    def never_finish(self) -> None:
        """Make every mark from now on one the GPU never reaches (STRATA_FAULT timeout@verify:
        the window's bounded wait then runs out as a real stall's would)."""
        self.event = _NeverDone

    def after(self, layer: int) -> None:
        PROGRESS.layer = layer
        if self.event is not None:
            ev = self.event()
            ev.record()
            self.events.append(ev)

    def what(self, layer: int) -> str:
        part = "the output head" if layer >= self.n_layers else f"layer {layer}"
        return f"the {self._window()} ({part})"

    def _window(self) -> str:
        if self.sequences > 1:
            return (f"verify windows of {self.tokens} tokens of {self.sequences} sequences "
                    f"(the first at position {self.position})")
        return f"verify window of {self.tokens} tokens at position {self.position}"

    def wait(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Wait for the window's GPU work, at most timeout_s in all."""
        if not self.events:
            return
        try:
            wait_event(self.events[-1], self.what(len(self.events) - 1), timeout_s)
        except StallError:
            stuck = next((i for i, ev in enumerate(self.events) if not ev.query()),
                         len(self.events) - 1)
            part = "the output head" if stuck >= self.n_layers else f"layer {stuck}"
            if self.whole_pass:
                part += " (every layer and the head ran as one graph: its marks follow them all)"
            raise StallError(f"{self._window()}: waited {timeout_s:.0f} s; the GPU never "
                             f"finished {part} ({PROGRESS.describe()})") from None


class _NeverDone:
    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False


def accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           gen: torch.Generator | None) -> tuple[int, int]:
    """(accepted drafts, the next token) from a window's logits [k+1, V] (row i: after the
    window's token i). Greedy: the longest prefix that argmax agrees with. Sampled: d_i kept with
    probability p_{i-1}(d_i), else a token of the residual; all kept: one sampled from p_k."""
    k = len(drafts)
    if params.temperature == 0:
        best = to_host(torch.argmax(logits, dim=-1), "the verify window's argmax").tolist()
        n = 0
        while n < k and best[n] == drafts[n]:
            n += 1
        return n, int(best[n])
    for i, d in enumerate(drafts):
        p = probabilities(logits[i], params)  # [V]
        if float(torch.rand(1, generator=gen)) < float(p[d]):
            continue
        p[d] = 0.0  # (a rejection leaves mass elsewhere: p[d] < 1 here)
        return i, int(torch.multinomial(p, 1, generator=gen)[0])
    return k, sample(logits[k], params, gen)


@dataclass(frozen=True)
class Decoding:
    """One sequence of a batch for SpecDecoder.step_batch: `context` ends with its last sampled
    token, which `kv` does not hold yet; `room` tokens it may still take."""

    key: object  # the sequence (the server's request id): whose Window
    context: list[int]
    kv: KVCache
    params: SamplingParams
    gen: torch.Generator | None
    room: int
    constraint: object = None  # strata.engine.constrain.Constraint: the grammar it follows


@dataclass
class SpecDecoder:
    """Decode steps through verify windows: one sequence's (step), or a batch's in one forward
    (step_batch, drafters that draft from the context alone). Each sequence keeps its own
    adaptive Window."""

    model: object  # MoETransformer
    drafter: object  # strata.engine.drafters.Drafter
    limit: int  # --spec T: drafted tokens in a window at most
    stats: SpecStats = field(default_factory=SpecStats)
    timeout_s: float = DEFAULT_TIMEOUT_S
    event: Callable[[], object] | None = None  # LayerMarks' event factory (tests)
    # called with each window's LayerMarks before its forward (the server's injected faults)
    before_window: Callable[[LayerMarks], None] | None = None
    timed: bool = True  # Window.timed
    # strata bench-spec only: every window accepts this many of its drafts whatever its rows
    # say (then the next token from the row after them), so a timed run's acceptance is the
    # one asked for even where a window's rounding flips a random model's near-tie
    forced: int | None = None

    def __post_init__(self) -> None:
        self._windows: dict[object, Window] = {}  # each sequence's, by key
        self.costs = PassCosts()  # a window pass's cost in plain steps: the engine's
        self.window = Window(self.limit, self.timed, self.costs)
        self.sequence: object = None  # whose window state this is (the server's request id)

    @property
    def needs_hidden(self) -> bool:
        """The drafter reads each pass's hidden states (the MTP head): plain steps run the
        forward, not the decode steps, which do not hand them over."""
        return bool(getattr(self.drafter, "needs_hidden", False))

    @property
    def batches(self) -> bool:
        """Whether several sequences' windows can be drafted and checked together: the drafter
        drafts from the context alone (n-gram) or keeps a state per sequence (the MTP head, a
        draft model: propose_for)."""
        d = self.drafter
        return bool(getattr(d, "from_context", False) or getattr(d, "per_sequence", False))

    def reset(self, costs: bool = False) -> None:
        """A new generation: fresh statistics and a full window; costs: also forget what the
        windows' passes cost (PassCosts: otherwise kept, so a new sequence's windows start off
        where they could not pay)."""
        self.stats = SpecStats()
        self._windows.clear()
        if costs:
            self.costs = PassCosts()
        self.new_sequence(None)

    def new_sequence(self, key: object) -> None:
        """Another sequence decodes now: its window as it left it, or a full one (statistics
        carry on)."""
        self.window, self.sequence = self._window_of(key), key

    def forget(self, key: object) -> None:
        """A sequence ended: its window goes."""
        self._windows.pop(key, None)
        if self.sequence == key:
            self.window, self.sequence = Window(self.limit, self.timed, self.costs), None

    def _window_of(self, key: object) -> Window:
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = Window(self.limit, self.timed, self.costs)
        return w

    def step(self, context: list[int], kv: KVCache, params: SamplingParams,
             gen: torch.Generator | None, room: int, constraint: object = None) -> list[int]:
        """The next 1 .. room tokens after `context` (its last token is not in kv yet); kv then
        holds all of the context and every returned token but the last. With a constraint (a
        grammar: constrain.Constraint) every row is masked to what the grammar allows there,
        the drafts cut before the first it forbids, and the grammar takes the tokens given."""
        t0 = time.perf_counter()  # (drafting counts: a draft model's steps cost too)
        k = min(self.window.next_size(), room - 1)
        drafts = self._drafts([(kv, context, k)])[0]
        allowed = None
        if drafts and constraint is not None:
            drafts, allowed = constraint.window(drafts, self.model.device)
        if not drafts:
            if self.needs_hidden:  # (the forward hands them over)
                from strata.model.transformer import Segment

                logits = self.model.forward(torch.tensor(context[-1:]), [Segment(kv, 1)])
            else:
                logits = self.model.decode(context[-1], kv)
            row = logits[0] if constraint is None else constraint.mask(logits[0])
            out = [sample(row, params, gen)]
            if constraint is not None:
                constraint.accept(out[0])
            spent = time.perf_counter() - t0
            self.window.plain(spent)
            self.stats.plain_steps += 1
            self.stats.plain_s += spent
            return out
        start, n = kv.length, len(drafts) + 1
        PROGRESS.at("verify window", position=start)
        marks = LayerMarks(n, start, self.model.cfg.n_layers, self.model.device, self.event)
        if self.before_window is not None:
            self.before_window(marks)
        from strata.model.transformer import Segment

        tokens = torch.tensor([context[-1], *drafts])  # [k+1]
        captured = self._captured()
        logits = self._verify(tokens, [Segment(kv, n)], marks)  # [k+1, V]
        out = self._settle(logits, drafts, kv, start, params, gen, constraint, allowed)
        spent = time.perf_counter() - t0
        self.window.update(len(drafts), len(out) - 1, spent,
                           one_time=self._captured() != captured)
        self.stats.add(len(drafts), len(out) - 1, spent)
        return out

    def _settle(self, logits: torch.Tensor, drafts: list[int], kv: KVCache, start: int,
                params: SamplingParams, gen: torch.Generator | None, constraint: object,
                allowed: torch.Tensor | None) -> list[int]:
        """A window's rows [k+1, V] -> the tokens it gives: the rows masked to its grammar's
        allowed tokens, the drafts accepted (none drafted: one token sampled from its row), the
        cache rolled back to after the last accepted, the grammar fed the tokens."""
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if drafts and self.forced is not None:
            accepted = min(self.forced, len(drafts))
            nxt = sample(logits[accepted], params, gen)
        elif drafts:
            accepted, nxt = accept(logits, drafts, params, gen)
        else:
            accepted, nxt = 0, sample(logits[0], params, gen)
        rollback(self.model, kv, start + 1 + accepted)
        out = [*drafts[:accepted], nxt]
        for t in out if constraint is not None else ():
            constraint.accept(t)
        return out

    def step_batch(self, seqs: list[Decoding]) -> list[tuple[list[int], int] | StrataError] | None:
        """The next tokens of several decoding sequences through one forward: each sequence's
        [last, its drafts] a segment of its own (one without drafts: its last token alone, a
        plain step inside the pass), all logits out, each window accepted and rolled back as
        step() does. Every layer runs the batch's windows together, so a routed expert is read
        once for all of their tokens; a sequence with a grammar has its rows masked as step()
        masks them. -> each sequence's (tokens (1 .. its room), drafted: 0
        without a window; its accepted drafts are all of the tokens but the last), or None where
        none drafted (the caller runs its plain batched step, then plain_batch); a sequence
        whose grammar fails gets its StrataError in its place, out of the pass. The windows are
        timed by the pass's seconds per token given, against plain batched steps' (plain_batch):
        a batch where windows cost more per token than plain steps turns them off as step()
        does."""
        t0 = time.perf_counter()
        drafts, allowed, failed = [], [], {}
        asks = [(d.kv, d.context, min(self._window_of(d.key).next_size(), d.room - 1))
                for d in seqs]
        for i, (d, dr) in enumerate(zip(seqs, self._drafts(asks), strict=True)):
            rows = None
            if d.constraint is not None:  # (with no draft: its one row's mask)
                try:
                    dr, rows = d.constraint.window(dr, self.model.device)
                except StrataError as e:  # (that sequence fails; the others go on)
                    failed[i], dr = e, []
            drafts.append(dr)
            allowed.append(rows)
        if not any(drafts):
            return None
        if failed:  # the pass runs the others
            live = [i for i in range(len(seqs)) if i not in failed]
            out = self._pass([seqs[i] for i in live], [drafts[i] for i in live],
                             [allowed[i] for i in live], t0)
            got = dict(zip(live, out, strict=True)) | failed
            return [got[i] for i in range(len(seqs))]
        return self._pass(seqs, drafts, allowed, t0)

    def _drafts(self, asks: list[tuple[KVCache, list[int], int]]) -> list[list[int]]:
        """Up to k drafts after each context, for each (the sequence's cache, context, k): a
        drafter with a state per sequence is told whose cache; a draft model drafts them all
        together (propose_many)."""
        d = self.drafter
        many = getattr(d, "propose_many", None)
        if many is not None:
            return [dr[:k] for dr, (_, _, k) in zip(many(asks), asks, strict=True)]
        per = getattr(d, "propose_for", None)
        return [((per(kv, ctx, k) if per is not None else d.propose(ctx, k))[:k] if k > 0
                 else []) for kv, ctx, k in asks]

    def _pass(self, seqs: list[Decoding], drafts: list[list[int]],
              allowed: list[torch.Tensor | None], t0: float) -> list[tuple[list[int], int]]:
        """step_batch's forward over the windows drafted (each grammar's rows made)."""
        from strata.model.transformer import Segment

        starts = [d.kv.length for d in seqs]
        tokens = [t for d, dr in zip(seqs, drafts, strict=True) for t in (d.context[-1], *dr)]
        segments = [Segment(d.kv, len(dr) + 1) for d, dr in zip(seqs, drafts, strict=True)]
        PROGRESS.at("verify window", position=starts[0])
        marks = LayerMarks(len(tokens), starts[0], self.model.cfg.n_layers, self.model.device,
                           self.event, sequences=len(seqs))
        if self.before_window is not None:
            self.before_window(marks)
        logits = self._verify(torch.tensor(tokens), segments, marks)  # [sum of windows, V]
        out, row = [], 0
        for d, dr, start, ok in zip(seqs, drafts, starts, allowed, strict=True):
            out.append(self._settle(logits[row:row + len(dr) + 1], dr, d.kv, start, d.params,
                                    d.gen, d.constraint, ok))
            row += len(dr) + 1
        per_token = (time.perf_counter() - t0) / sum(len(o) for o in out)
        for d, dr, got in zip(seqs, drafts, out, strict=True):
            if dr:
                self._window_of(d.key).update(len(dr), len(got) - 1, per_token * len(got))
                self.stats.add(len(dr), len(got) - 1, per_token * len(got))
            else:
                self.stats.plain_steps += 1
                self.stats.plain_s += per_token
        return [(got, len(dr)) for got, dr in zip(out, drafts, strict=True)]

    def plain_batch(self, keys: list[object], seconds: float) -> None:
        """A plain batched step of these sequences (one token each) took `seconds`."""
        for key in keys:
            self._window_of(key).plain(seconds / len(keys))
        self.stats.plain_steps += len(keys)
        self.stats.plain_s += seconds

    def _captured(self) -> int:
        """Verify-window graphs the model's prompt graphs have captured (each size's first
        window on CUDA: an eager pass, then the capture, costing many plain steps once)."""
        chunks = getattr(self.model, "chunks", None)
        return chunks.window_steps["captured"] if chunks is not None else 0

    def _verify(self, tokens: torch.Tensor, segments: list, marks: LayerMarks) -> torch.Tensor:
        """One forward of windows (every logit out), each segment's recurrent state kept after
        each of its tokens, then the bounded wait for its GPU work."""
        ex = self.model.experts
        windowed = hasattr(ex, "window")  # the offload executor: planned misses
        if windowed:
            ex.window = True
        for s in segments:
            open_window = getattr(s.kv, "open_window", None)  # (a recurrent state keeps each
            if open_window is not None:  # token's)
                open_window(s.length)
        try:
            logits = self.model.forward(tokens, segments, all_logits=True, marks=marks)
        finally:
            if windowed:
                ex.window, ex.guessed = False, None
            for s in segments:
                if getattr(s.kv, "state", None) is not None:
                    s.kv.state.stop_recording()
        marks.wait(self.timeout_s)
        return logits


def rollback(model: object, kv: KVCache, length: int) -> None:
    """Back to `length` tokens after a window: the KV rows after it dropped, and the
    linear-attention (Gated DeltaNet) layers' recurrent state as it was after token length-1
    (the window kept each token's state: KVCache.open_window / rollback). A cache without a
    recurrent state (LatentCache) is truncated."""
    hook = getattr(kv, "rollback", None)
    if hook is not None:
        hook(length)
    else:
        kv.truncate(length)


def make_spec(ec, mf, cfg, model, load_engine) -> SpecDecoder:  # noqa: ANN001 (EngineConfig, ...)
    """The SpecDecoder of --spec T --draft D for a loaded target model. A draft model loads on
    the target's device with everything there (--offload off: it is small), inside the target's
    memory plan and VRAM cap (memory_plan.draft_bytes). load_engine(path, config): Engine.load
    (passed in: the engine imports this module)."""
    from dataclasses import replace

    from strata.engine.drafters import make_drafter

    def load(path):  # noqa: ANN001, ANN202
        draft = load_engine(path, replace(ec, offload="off", spec=0, beside_target=True))
        if getattr(draft.config, "full_attn_interval", 0):
            raise StrataError(f"--draft {path}: a {draft.config.arch} draft keeps a recurrent "
                              "state that cannot yet be rolled back; pick a draft of another "
                              "architecture")
        return draft

    return SpecDecoder(model, make_drafter(ec.draft, mf, cfg.arch, load, model), ec.spec)
