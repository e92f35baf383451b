"""Drafters for speculative decoding (--draft): each proposes the next few tokens of a context,
which one verify window of the target model then checks (strata.engine.spec).

    ngram     prompt lookup: the longest recent n-gram of the context (NGRAM_MAX .. NGRAM_MIN
              tokens) matched earlier in the context proposes what followed it there
    PATH.gguf a small model sharing the tokenizer, greedy, with a KV cache of its own
    mtp       the file's own multi-token-prediction (nextn) layer (strata.model.mtp), fed
              the target's last hidden states; further drafts chain its own hidden state
    auto      mtp where the file has a nextn layer or MTP block (glm4moe, deepseek2,
              qwen35moe), else ngram

Every drafter is a point mass: it proposes tokens, not distributions, so a verify window accepts
a drafted token with the target's probability of it (spec.py).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from strata.errors import StrataError
from strata.gguf import ModelFile
from strata.kernels.tuning import NGRAM_MAX, NGRAM_MIN
from strata.runtime.kv_cache import common_prefix

log = logging.getLogger("strata")

DRAFTS = ("auto", "ngram", "mtp")  # or a path to a .gguf draft model


class Drafter(Protocol):
    name: str

    def propose(self, context: list[int], n: int) -> list[int]:
        """Up to n tokens to follow `context` (it ends with the last sampled token)."""


class NgramDrafter:
    """Prompt lookup over the context itself; no model, nothing to keep in sync."""

    name = "ngram"
    from_context = True  # drafts from the context alone: a batch's sequences draft together

    def __init__(self, longest: int = NGRAM_MAX, shortest: int = NGRAM_MIN):
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths {shortest}..{longest}")
        self.longest, self.shortest = longest, shortest

    def propose(self, context: list[int], n: int) -> list[int]:
        if n < 1:
            return []
        ctx = np.asarray(context, dtype=np.int64)
        for g in range(min(self.longest, len(ctx) - 1), self.shortest - 1, -1):
            # every earlier g-gram that leaves at least one token after it: starts 0 .. L-g-1
            grams = np.lib.stride_tricks.sliding_window_view(ctx[:-1], g)  # [L-g, g]
            hit = np.flatnonzero((grams == ctx[-g:]).all(axis=1))
            if len(hit):
                start = int(hit[-1]) + g  # the latest match: nearest in topic
                return ctx[start:start + n].tolist()
        return []


class _DraftCache:
    """A draft model's cache for one target sequence and the tokens it holds."""

    def __init__(self) -> None:
        self.kv = None
        self.ids: list[int] = []


class ModelDrafter:
    """A small model of the same vocabulary, run greedily, with a cache of its own per target
    sequence (keyed by the target's KV cache, so it goes when that sequence's cache goes). A
    window's rejected drafts are dropped by cutting the draft's cache to the prefix it shares
    with the next context. A batch's sequences draft together (propose_many): their new tokens
    in one forward, then each greedy step of them all in one more."""

    name = "model"
    per_sequence = True  # propose_for / propose_many: a batch's sequences draft together

    def __init__(self, engine, chunk: int = 512):  # noqa: ANN001 (strata.engine.generator.Engine)
        self.engine, self.chunk = engine, chunk
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target kv ->
        self._own = _DraftCache()  # propose()'s: a caller that names no target cache

    def propose(self, context: list[int], n: int) -> list[int]:
        return self._draft([(self._own, context, n)])[0]

    def propose_for(self, kv, context: list[int], n: int) -> list[int]:  # noqa: ANN001
        return self.propose_many([(kv, context, n)])[0]

    def propose_many(self, asks: list[tuple[object, list[int], int]]) -> list[list[int]]:
        """Up to n drafts after each context, for each (target cache, context, n)."""
        states = []
        for kv, _, _ in asks:
            st = self._own if kv is None else self._states.get(kv)
            if st is None:
                st = self._states[kv] = _DraftCache()
            states.append(st)
        return self._draft([(st, ctx, n) for st, (_, ctx, n) in zip(states, asks, strict=True)])

    def _draft(self, asks: list[tuple[_DraftCache, list[int], int]]) -> list[list[int]]:
        model = self.engine.model
        out: list[list[int]] = [[] for _ in asks]
        live = [i for i, (_, ctx, n) in enumerate(asks) if n >= 1 and ctx]
        todo = {}
        for i in live:  # each cache cut to what it shares with its context
            st, ctx, _ = asks[i]
            if st.kv is None:
                st.kv = model.new_cache(len(ctx) + 256)
            # (the last token always runs: its logits are needed)
            same = min(common_prefix(st.ids, ctx), len(ctx) - 1)
            st.kv.truncate(same)
            todo[i] = ctx[same:]
        last = {}
        while todo:  # the contexts' new tokens, a chunk of each sequence's a pass
            order = list(todo)
            parts = [todo[i][:self.chunk] for i in order]
            logits = model.forward(torch.tensor([t for p in parts for t in p]),
                                   [_segment(asks[i][0].kv, len(p))
                                    for i, p in zip(order, parts, strict=True)])
            for row, i in enumerate(order):
                last[i] = logits[row]
            todo = {i: todo[i][self.chunk:] for i in order if len(todo[i]) > self.chunk}
        for i in live:
            out[i].append(int(torch.argmax(last[i])))
        while going := [i for i in live if len(out[i]) < asks[i][2]]:
            if len(going) == 1:  # (one sequence: the draft's decode step, graphed where built)
                i = going[0]
                out[i].append(int(torch.argmax(model.decode(out[i][-1], asks[i][0].kv)[0])))
                continue
            logits = model.forward(torch.tensor([out[i][-1] for i in going]),
                                   [_segment(asks[i][0].kv, 1) for i in going])
            for row, i in enumerate(going):
                out[i].append(int(torch.argmax(logits[row])))
        for i in live:
            st, ctx, _ = asks[i]
            st.ids = ctx + out[i][:-1]  # what its cache holds now
        return out


class _MTPState:
    """One target sequence's drafting state: the target's last hidden states by position, the
    head's own cache (one row per position i < done, made from (h_i, context[i + 1])) and the
    context it was made from."""

    def __init__(self, head, base: int):  # noqa: ANN001 (strata.model.mtp.MTPHead)
        self.kv = head.new_cache()
        self.hidden: torch.Tensor | None = None  # [capacity, D] by position
        self.base = base  # the first position seen (a cache filled elsewhere: no drafts)
        self.seen = base  # positions 0 .. seen-1 have their hidden state here
        self.ids: list[int] = []
        self.done = 0


class MTPDrafter:
    """The file's MTP head as the drafter. The target's forward hands it each pass's last
    hidden states (MoETransformer.hidden_hook), kept by position per target sequence (its KV
    cache: a batch's sequences each have their own, _MTPState); a proposal for a sequence runs
    the head over the rows that changed or are new (a window's rejected drafts and the head's
    own chained rows are dropped first: the head's cache is cut to the prefix it shares with
    the context), then chains: draft j+1 from draft j and the head's hidden state. A sequence
    whose hidden states have a gap (a pass that ran without the hook) drafts no more."""

    name = "mtp"
    needs_hidden = True  # the plain steps between windows must run the forward, not the step
    per_sequence = True  # propose_for(kv, ...): a batch's sequences draft together

    def __init__(self, head, model):  # noqa: ANN001 (strata.model.mtp.MTPHead, MoETransformer)
        self.head = head
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target kv ->
        self._target = None  # a weak reference to the target cache last seen (propose's)
        model.hidden_hook = self.see

    def see(self, segments, hidden: torch.Tensor) -> None:  # noqa: ANN001
        start = 0
        for s in segments:
            rows = hidden[start:start + s.length]
            start += s.length
            st = self._states.get(s.kv)
            if st is None or s.kv.length > st.seen or (s.kv.length == 0 and st.seen):
                # (a new sequence, a gap in what was seen, or a cache used again from 0)
                st = self._states[s.kv] = _MTPState(self.head, s.kv.length)
            self._target = weakref.ref(s.kv)
            end = s.kv.length + s.length
            if st.hidden is None or st.hidden.shape[0] < end:
                grown = torch.empty(max(end, 2 * (0 if st.hidden is None else
                                                  st.hidden.shape[0]), 64),
                                    rows.shape[1], device=rows.device)
                if st.hidden is not None:
                    grown[:st.hidden.shape[0]] = st.hidden
                st.hidden = grown
            st.hidden[s.kv.length:end] = rows
            st.seen = end

    def propose(self, context: list[int], n: int) -> list[int]:
        """Drafts for the sequence the last forward ran (one sequence at a time)."""
        return self.propose_for(self._target and self._target(), context, n)

    def propose_for(self, kv, context: list[int], n: int) -> list[int]:  # noqa: ANN001
        """Up to n drafts after `context` for the target sequence whose cache is `kv`."""
        st = None if kv is None else self._states.get(kv)
        N = len(context) - 1  # the target's cache holds context[:N]: h_0 .. h_N-1
        if (n < 1 or N < 1 or st is None or st.hidden is None or st.base or kv.length != N
                or st.seen < N):
            return []
        same = common_prefix(st.ids, context)
        keep = max(0, min(st.done, same - 1, N - 1))  # row i needs context[i + 1] unchanged
        st.kv.truncate(keep)
        logits, h = self.head.forward(torch.tensor(context[keep + 1:N + 1]),
                                      st.hidden[keep:N], st.kv)
        st.ids, st.done = list(context), N
        out = [int(torch.argmax(logits[-1]))]
        while len(out) < n:
            logits, h = self.head.forward(torch.tensor(out[-1:]), h[-1:], st.kv)
            out.append(int(torch.argmax(logits[-1])))
        return out


def _mtp_drafter(mf: ModelFile, model) -> MTPDrafter:  # noqa: ANN001
    from strata.model.mtp import mtp_head

    return MTPDrafter(mtp_head(model, mf), model)


def _segment(kv, n: int):  # noqa: ANN001, ANN202
    from strata.model.transformer import Segment

    return Segment(kv, n)


def nextn_layers(mf: ModelFile, arch: str) -> int:
    """How many multi-token-prediction (nextn) layers the file declares and holds."""
    n = mf.meta(f"{arch}.nextn_predict_layers", 0)
    has = any(".nextn." in name for name in mf.tensors)
    return int(n) if isinstance(n, int) and n > 0 and has else 0


def check_vocab(target: ModelFile, draft: ModelFile) -> None:
    """A draft model must share the target's tokenizer: same token list, same ids."""
    from strata.tokenizer.vocab import read_tokens

    a = read_tokens(target.metadata, str(target.path))
    b = read_tokens(draft.metadata, str(draft.path))
    if a == b:
        return
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
    raise StrataError(f"--draft {draft.path}: its vocabulary differs from {target.path}'s "
                      f"({len(b)} against {len(a)} tokens, first at id {diff}); a draft model "
                      "must share the target's tokenizer")


def make_drafter(draft: str, mf: ModelFile, arch: str, load_engine,  # noqa: ANN001
                 model=None) -> Drafter:  # noqa: ANN001 (MoETransformer)
    """The drafter of --draft for the target file `mf` (its loaded model: `model`, which an
    MTP drafter needs); load_engine(path) loads a draft model (an Engine) on the target's
    device."""
    n_mtp = nextn_layers(mf, arch)
    runnable = bool(model is not None and (getattr(model.w, "nextn", None)
                                           or getattr(model.w, "mtp", None)))
    if draft == "mtp":
        if not n_mtp:
            raise StrataError(f"--draft mtp: {mf.path} has no nextn layers (no "
                              f"{arch}.nextn_predict_layers and no blk.N.nextn.* tensors); use "
                              "--draft ngram or --draft PATH.gguf")
        if not runnable:
            raise StrataError(f"--draft mtp: {mf.path} has {n_mtp} nextn layer(s), but this "
                              f"engine does not run {arch}'s MTP head yet; use --draft ngram or "
                              "--draft PATH.gguf")
        return _mtp_drafter(mf, model)
    if draft == "auto":
        if runnable:
            return _mtp_drafter(mf, model)
        if n_mtp:
            log.info(f"--draft auto: {n_mtp} nextn layer(s) in the file, but {arch}'s MTP head "
                     "does not run yet: n-gram drafts")
        return NgramDrafter()
    if draft == "ngram":
        return NgramDrafter()
    path = Path(draft)
    if path.suffix != ".gguf":
        raise StrataError(f"--draft {draft}: choose auto, ngram, mtp or a .gguf draft model")
    if not path.is_file():
        raise StrataError(f"--draft {draft}: no such file")
    from strata.gguf import open_model

    check_vocab(mf, open_model(path))
    return ModelDrafter(load_engine(path))
