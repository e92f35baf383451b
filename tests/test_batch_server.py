"""The engine's batch with --batch N: sequences in one KV pool, decoded together by the batched
step; each text as it is alone (greedy and sampled), cancel frees a slot at once, a full pool
refuses with 429 and leaves the others' text as it was."""

from __future__ import annotations

import pytest

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.server.batching import BatchRunner
from strata.server.faults import FaultTrigger
from strata.server.protocol import Delta, Failed, Finished, Submit

PROMPTS = ["hello world", "the quick brown fox", "1 2 3 4 5 6 7", "a"]


def _engine(path, batch: int) -> Engine:  # noqa: ANN001
    return Engine.load(path, config=EngineConfig(device="cpu", offload="on", cpu_kernels="torch",
                                                 kernels="exact", sequences=batch))


def _texts(runner: BatchRunner, sent: list, subs: list[Submit],
           cancel_after: dict[str, int] | None = None) -> dict[str, str]:
    for sub in subs:
        runner.submit(sub)
    steps = 0
    while runner.active:
        runner.step()
        steps += 1
        for rid, at in (cancel_after or {}).items():
            if steps == at:
                runner.cancel(rid)
    out: dict[str, str] = {}
    for m in sent:
        if isinstance(m, Delta):
            out[m.rid] = out.get(m.rid, "") + m.text
        elif isinstance(m, Finished):
            out[m.rid] = out.get(m.rid, "") + m.text
    return out


def _each_as_alone(eng: Engine, sent: list, subs: list[Submit]) -> None:
    """Each request's text in `sent` is its text run alone through the same engine."""
    together: dict[str, str] = {}
    for m in sent:
        if isinstance(m, (Delta, Finished)):
            together[m.rid] = together.get(m.rid, "") + m.text
    for sub in subs:
        sent_alone: list = []
        alone = BatchRunner(eng, sent_alone.append, FaultTrigger(None))
        assert _texts(alone, sent_alone, [sub])[sub.rid] == together[sub.rid], sub.rid


def _submit(rid: str, prompt: str, n: int, seed: int | None = None) -> Submit:
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.9, "seed": seed}
    return Submit(rid, None, prompt, sampling, n, n, ignore_eos=True)


def test_batched_text_is_the_text_alone(synth):
    path = synth("qwen3moe", "Q4_K_M")
    eng = _engine(path, 4)
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    assert runner.batch_step is not None and runner.pool.n_slots == 4
    subs = [_submit(f"r{i}", p, 8, seed=None if i % 2 else 100 + i)
            for i, p in enumerate(PROMPTS)]
    together = _texts(runner, sent, subs)
    assert runner.batch_step.steps["rows"] > 0  # several sequences decoded in one step
    assert runner.pool.used == 0
    runner.pool.check_integrity()
    for sub in subs:  # each alone, through the same engine (one-sequence decode step)
        sent_alone: list = []
        alone = BatchRunner(eng, sent_alone.append, FaultTrigger(None))
        assert _texts(alone, sent_alone, [sub])[sub.rid] == together[sub.rid]


def test_cancel_frees_the_slot_at_once_and_a_full_pool_refuses(synth):
    path = synth("qwen3moe", "Q4_K_M")
    eng = _engine(path, 2)
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    pool = runner.pool
    runner.submit(_submit("a", PROMPTS[0], 6))
    runner.submit(_submit("b", PROMPTS[1], 6))
    assert pool.used == 2 and not pool.can_take()
    runner.submit(_submit("c", PROMPTS[2], 6))  # no slot: refused, the others untouched
    (fail,) = [m for m in sent if isinstance(m, Failed)]
    assert fail.rid == "c" and fail.status == 429 and fail.code == "pool_full"
    assert set(runner.seqs) == {"a", "b"} and pool.used == 2
    runner.step()
    runner.cancel("b")
    assert pool.used == 1 and pool.can_take()  # at once, not when the cache is collected
    pool.check_integrity()
    while runner.active:
        runner.step()
    text_a = "".join(m.text for m in sent if isinstance(m, (Delta, Finished)) and m.rid == "a")
    sent_alone: list = []
    alone = BatchRunner(eng, sent_alone.append, FaultTrigger(None))
    assert _texts(alone, sent_alone, [_submit("a", PROMPTS[0], 6)])["a"] == text_a
    assert pool.used == 0 and sorted(pool.free) == [0, 1]


def test_a_prompt_that_starts_alike_shares_the_pool_blocks(synth):
    path = synth("qwen3moe", "Q4_K_M")
    eng = _engine(path, 2)
    long = "the quick brown fox jumps over the lazy dog " * 3
    texts = {}
    for cache in (1 << 30, 0):
        sent: list = []
        runner = BatchRunner(eng, sent.append, FaultTrigger(None), prefix_cache_bytes=cache)
        _texts(runner, sent, [_submit("first", long, 4)])
        sent.clear()
        texts[cache] = _texts(runner, sent, [_submit("second", long + "and more", 6)])
        (done,) = [m for m in sent if isinstance(m, Finished)]
        assert (done.cached_tokens > 16) == bool(cache)  # whole blocks of the first prompt
        assert runner.pool.used == 0
        runner.pool.check_integrity()
    assert texts[1 << 30] == texts[0]


def test_warm_up_runs_every_batch_size_and_leaves_the_pool_empty(synth):
    path = synth("qwen3moe", "Q4_K_M")
    cold_sent: list = []
    cold = BatchRunner(_engine(path, 3), cold_sent.append, FaultTrigger(None))
    subs = [_submit(f"r{i}", p, 5) for i, p in enumerate(PROMPTS[:3])]
    want = _texts(cold, cold_sent, subs)
    eng = _engine(path, 3)
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    passes = []  # (segments, tokens) of each forward of the warm-up
    forward = eng.model.forward
    eng.model.forward = lambda t, segs, *a, **k: (passes.append((len(segs), len(t))),
                                                  forward(t, segs, *a, **k))[1]
    assert runner.warm_up() > 0
    del eng.model.forward
    # several prompts in one plain forward, at the tl.dot and grouped paths' sizes
    assert (2, 128) in passes and (3, 384) in passes
    step, st = runner.batch_step, eng.model.experts.stats
    # (past the slots, sizes for mixed steps: a prompt's chunk beside the decoding sequences)
    assert step.sizes == (1, 2, 3, 4, 8, 16, 32)
    assert step.steps["eager"] + step.steps["replayed"] == 3 * len(step.sizes)
    assert runner.pool.used == 0 and runner.pool.used_blocks == 0
    runner.pool.check_integrity()
    assert st.hits.sum() + st.cpu.sum() + st.streamed.sum() == 0 and st.routed.sum() == 0
    assert _texts(runner, sent, subs) == want


def test_verify_windows_run_over_the_pool(synth):
    """--spec with the batch's pool: one decoding sequence's verify windows over its blocks
    give the text of plain decoding."""
    path = synth("qwen3moe", "Q4_K_M")
    sent: list = []
    plain = _texts(BatchRunner(_engine(path, 2), sent.append, FaultTrigger(None)), sent,
                   [_submit("a", PROMPTS[0], 12)])
    eng = Engine.load(path, config=EngineConfig(device="cpu", offload="on", cpu_kernels="torch",
                                                kernels="exact", sequences=2, spec=3,
                                                draft=str(path)))
    eng.spec.timed = False
    sent = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    assert runner.pool is not None and runner.pool.paged
    assert _texts(runner, sent, [_submit("a", PROMPTS[0], 12)]) == plain
    assert eng.spec.stats.windows > 0
    runner.pool.check_integrity()


def test_a_failed_batched_step_fails_its_requests_and_frees_their_blocks(synth):
    path = synth("qwen3moe", "Q4_K_M")
    sent: list = []
    runner = BatchRunner(_engine(path, 2), sent.append, FaultTrigger(None))
    for i in range(2):
        runner.submit(_submit(f"r{i}", PROMPTS[i], 6))
    runner.step()  # the prompts
    assert runner.pool.used == 2

    class Broken:
        rows_max = 32

        def __call__(self, tokens, caches, takes=None):  # noqa: ANN001, ANN204
            raise RuntimeError("injected")

        def line(self) -> str:
            return "broken"

    runner.batch_step = Broken()
    runner.step()
    fails = [m for m in sent if isinstance(m, Failed)]
    assert {m.rid for m in fails} == {"r0", "r1"} and all(m.status == 500 for m in fails)
    assert not runner.active and runner.pool.used == 0 and runner.pool.used_blocks == 0
    runner.pool.check_integrity()


def test_stall_state_names_the_pool(synth):
    sent: list = []
    runner = BatchRunner(_engine(synth("qwen3moe", "Q4_K_M"), 2), sent.append,
                         FaultTrigger(None))
    runner.submit(_submit("a", PROMPTS[0], 3))
    runner.step()
    st = runner.state()
    assert st["kv_pool"].startswith("1 of 2 slots, 1 of ") and "batched decode step" in \
        st["batch_step"]


def test_a_long_prompt_advances_between_the_others_tokens(synth, monkeypatch):
    """While a sequence decodes, a prompt arriving adds at most PREFILL_WHILE_DECODING tokens
    a step (here 4, fewer than the rows a mixed step leaves it): the decoding sequence gets its
    next token in every step meanwhile, the two in one batched step, and both texts are their
    texts alone."""
    import strata.server.batching as batching

    monkeypatch.setattr(batching, "PREFILL_WHILE_DECODING", 4)
    eng = _engine(synth("qwen3moe", "Q4_K_M"), 2)
    first, long = _submit("a", "hello world", 12), _submit("b", " ".join(["seven"] * 14), 3)
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    runner.submit(first)
    runner.step()  # a's prompt, then a decodes
    runner.submit(long)
    n_long = runner.seqs["b"].prompt_len
    assert n_long > 8  # (three steps of at most 4 prompt tokens at least)
    a_tokens, b_prefill_steps = [], 0
    while "b" in runner.seqs and not runner.seqs["b"].prefilled:
        before = runner.seqs["a"].generated
        runner.step()
        a_tokens.append(runner.seqs["a"].generated - before)
        b_prefill_steps += 1
    assert b_prefill_steps == -(-n_long // 4) and a_tokens == [1] * b_prefill_steps
    assert runner.batch_step.steps["rows"] == b_prefill_steps + n_long  # (a's token each step)
    while runner.active:
        runner.step()
    _each_as_alone(eng, sent, [first, long])


class _Recorded:
    """A BatchStep whose calls' takes are kept (`calls`)."""

    def __init__(self, step):  # noqa: ANN001
        self.step, self.calls = step, []

    def __call__(self, tokens, caches, takes=None):  # noqa: ANN001, ANN204
        self.calls.append(list(takes or [1] * len(caches)))
        return self.step(tokens, caches, takes)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.step, name)


def test_a_prompt_rides_in_the_decoders_batched_steps(synth):
    """While sequences decode, a prompt arriving with --prompt-while-decoding at most the rows
    the decoders leave of MIXED_STEP_ROWS advances inside their batched step (mixed): each step
    carries every decoder's token and the oldest prompt's next chunk; the decoders get a token
    every step; a later prompt that starts alike shares the first one's blocks from the prefix
    index and rides the same way. Every text, greedy and sampled, is its text alone. At the
    default (512) a chunk larger than those rows does not ride: that step is not the batched
    step's."""
    from strata.kernels.tuning import MIXED_STEP_ROWS
    from strata.server.protocol import Progress

    eng = _engine(synth("qwen3moe", "Q4_K_M"), 3)
    long = " ".join(["seven eleven"] * 20)
    subs = [_submit("a", "hello world", 30), _submit("b", long, 4, seed=5),
            _submit("c", long + " and more", 3, seed=9)]
    default = BatchRunner(eng, lambda m: None, FaultTrigger(None))
    plain = default.batch_step = _Recorded(default.batch_step)
    default.submit(subs[0])
    default.step()
    default.submit(subs[1])
    default.step()  # b's whole prompt beside a's token: past the rows a leaves, not mixed
    assert default.seqs["b"].prefilled and plain.calls == []
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None), prefix_cache_bytes=1 << 30,
                         prompt_while_decoding=MIXED_STEP_ROWS - 1)
    step = runner.batch_step = _Recorded(runner.batch_step)
    assert runner.scratch is None and step.rows_max == MIXED_STEP_ROWS
    runner.submit(subs[0])
    runner.step()  # a's prompt alone
    runner.submit(subs[1])
    n_long = runner.seqs["b"].prompt_len
    assert n_long > 2 * (MIXED_STEP_ROWS - 1)  # (three chunks at least)
    a_tokens, chunks = [], []
    while not runner.seqs["b"].prefilled:
        before, at = runner.seqs["a"].generated, runner.seqs["b"].kv.length
        runner.step()
        a_tokens.append(runner.seqs["a"].generated - before)
        chunks.append(runner.seqs["b"].kv.length - at)
        assert step.calls[-1] == [1, chunks[-1]]  # one batched step: a's token, b's chunk
    assert a_tokens == [1] * len(chunks) and sum(chunks) == n_long
    assert chunks[:-1] == [MIXED_STEP_ROWS - 1] * (len(chunks) - 1)
    while "b" in runner.seqs:
        runner.step()
    runner.submit(subs[2])  # starts like b: its blocks from the prefix index
    assert runner.seqs["c"].cached >= 16
    calls = len(step.calls)
    while not runner.seqs["c"].prefilled:
        runner.step()
    assert all(len(t) == 2 and t[0] == 1 and t[1] > 1 for t in step.calls[calls:])
    while runner.active:
        runner.step()
    assert runner.pool.used == 0
    runner.pool.check_integrity()
    steps = [m.detail for m in sent if isinstance(m, Progress) and "sequence(s)" in m.detail]
    assert sum("a decode step" in d and "b prompt tokens" in d for d in steps) == len(chunks)
    _each_as_alone(eng, sent, subs)


def test_a_hybrids_prompt_beside_decoding_runs_the_plain_forward(synth):
    """A hybrid's recurrent state moves one token a step: a prompt arriving while another
    sequence decodes goes in a plain forward beside it (no mixed step), the decoding steps
    alone on the batched step; both texts are their texts alone."""
    eng = _engine(synth("qwen35moe", "Q4_K_M"), 2)
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    step = runner.batch_step = _Recorded(runner.batch_step)
    assert runner.pool.conv is not None and not runner._mixes()
    subs = [_submit("a", "hello world", 8), _submit("b", PROMPTS[2], 4, seed=3)]
    runner.submit(subs[0])
    runner.step()
    runner.submit(subs[1])
    runner.step()  # b's prompt beside a's token: one plain forward
    assert not step.calls and runner.seqs["b"].prefilled
    while runner.active:
        runner.step()
    assert step.calls and all(t == [1, 1] for t in step.calls)
    runner.pool.check_integrity()
    _each_as_alone(eng, sent, subs)


def test_a_mixed_steps_prompt_cancelled_or_failed_frees_its_blocks(synth):
    """A prompt cancelled between its mixed steps frees its blocks at once and the decoder
    beside it goes on to its text alone; a mixed step that fails fails both its requests and
    frees every block."""
    eng = _engine(synth("qwen3moe", "Q4_K_M"), 2)
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None), prefix_cache_bytes=1 << 30,
                         prompt_while_decoding=16)  # (chunks that fit a mixed step's rows)
    long = " ".join(["seven eleven"] * 20)
    runner.submit(_submit("a", PROMPTS[0], 10))
    runner.step()
    runner.submit(_submit("b", long, 4))
    runner.step()  # a's token and b's first chunk
    assert 0 < runner.seqs["b"].kv.length < runner.seqs["b"].prompt_len
    runner.cancel("b")
    assert runner.pool.used == 1 and [(m.rid, m.finish_reason) for m in sent if isinstance(
        m, Finished)] == [("b", "cancelled")]
    runner.pool.check_integrity()
    text = _texts(runner, sent, [])["a"]
    sent_alone: list = []
    assert _texts(BatchRunner(eng, sent_alone.append, FaultTrigger(None)), sent_alone,
                  [_submit("a", PROMPTS[0], 10)])["a"] == text
    sent.clear()
    runner.submit(_submit("a", PROMPTS[0], 10))
    runner.step()
    runner.submit(_submit("c", long, 4))

    calls = []

    class Broken:
        rows_max = 32

        def __call__(self, tokens, caches, takes=None):  # noqa: ANN001, ANN204
            calls.append(takes)
            raise RuntimeError("injected")

        def line(self) -> str:
            return "broken"

    runner.batch_step = Broken()
    runner.step()
    assert len(calls) == 1 and calls[0][0] == 1 and calls[0][1] > 1  # (a's token, c's chunk)
    fails = [m for m in sent if isinstance(m, Failed)]
    assert {m.rid for m in fails} == {"a", "c"} and all(m.status == 500 for m in fails)
    assert not runner.active and runner.pool.used == 0
    runner.pool.check_integrity()


def test_each_steps_progress_has_the_requests_as_they_stand(synth):
    """A step's Progress carries the requests fresh (a stall report's positions and steps) and
    the costlier lines (the pool, the batch step) as last read, at most a second before."""
    from strata.server.protocol import Progress

    sent: list = []
    runner = BatchRunner(_engine(synth("qwen3moe", "Q4_K_M"), 2), sent.append,
                         FaultTrigger(None))
    runner.submit(_submit("a", PROMPTS[0], 4))
    while runner.active:
        runner.step()
    steps = [m for m in sent if isinstance(m, Progress)]
    n = len(runner.engine.tokenizer.encode(PROMPTS[0]))  # the prompt's KV rows
    # before the prompt's pass and each decode step: (decode steps done, tokens generated)
    assert [m.state["requests"][0][2:] for m in steps] == [(0, 0), (0, 1), (1, 2), (2, 3)]
    assert [m.state["requests"][0][1] for m in steps] == [0, n, n + 1, n + 2]
    assert all(m.state["kv_pool"].startswith("1 of 2 slots") for m in steps)
    assert runner.state()["kv_pool"].startswith("0 of 2 slots")  # (fresh: read again)


def test_a_prompt_beside_decoding_runs_in_the_scratch_and_keeps_every_text(synth, monkeypatch):
    """Where a step cannot mix (BatchRunner._mixes false: forced here; every plan with a
    scratch today mixes, so this is the fallback's own test), a prompt alone in a step with
    decoding sequences runs in the pool's plain scratch (on CUDA: the prompt graphs; here the
    same split of the step, eagerly), its rows copied into its blocks after each chunk: a
    shared prefix comes into the scratch first. While some decode, a step takes one prompt
    (the oldest; the others wait), and its chunk of at most prompt_while_decoding tokens. A
    prompt with no decoder beside it runs in the scratch whether steps mix or not. Every text
    is its text alone."""
    import strata.server.batching as batching
    from strata.runtime.kv_cache import KVCache
    from strata.server import kv_batch
    from strata.server.protocol import Progress

    monkeypatch.setattr(batching, "PREFILL_WHILE_DECODING", 4)
    monkeypatch.setattr(BatchRunner, "_mixes", lambda self: False)
    eng = _engine(synth("qwen3moe", "Q4_K_M"), 3)
    cfg = eng.model.cfg
    copied = []
    to_pool = kv_batch.to_pool
    monkeypatch.setattr(kv_batch, "to_pool",
                        lambda sc, kv, a, b: (copied.append((a, b)), to_pool(sc, kv, a, b)))
    came = []
    from_pool = kv_batch.from_pool
    monkeypatch.setattr(kv_batch, "from_pool",
                        lambda kv, sc: (came.append(kv.length), from_pool(kv, sc)))
    long = "the quick brown fox jumps over the lazy dog " * 2
    subs = [_submit("a", "hello world", 14), _submit("b", long, 5, seed=7),
            _submit("c", "1 2 3 4 5 6 7 8 9", 4), _submit("d", long + "and more", 3)]
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None), prefix_cache_bytes=1 << 30)
    runner.scratch = KVCache(cfg.n_kv_layers, cfg.n_kv_heads, cfg.head_dim, eng.model.device,
                             64, dtype=eng.model.kv_dtype)
    runner.submit(subs[0])
    runner.step()  # a's prompt alone, in the scratch too
    assert copied == [(0, runner.seqs["a"].prompt_len)]
    runner.submit(subs[1])
    runner.step()  # b's first 4 tokens in the scratch beside a's token
    assert copied[-1] == (0, 4) and runner._scratch_for == "b"
    runner.submit(subs[2])  # two prompts: b's go on, c's wait until b's are done
    while runner.active:
        runner.step()
        if "d" not in runner.seqs and not any(isinstance(m, Finished) and m.rid == "d"
                                              for m in sent) and "b" not in runner.seqs \
                and all(s.prefilled for s in runner.seqs.values()) and runner.active:
            runner.submit(subs[3])  # starts like b: its prefix from the pool into the scratch
    # (d's shared prefix)
    assert len(copied) > 3 and len([n for n in came if n]) >= 1 and runner.pool.used == 0
    runner.pool.check_integrity()
    steps = [m.detail for m in sent if isinstance(m, Progress) and "sequence(s)" in m.detail]
    mixed = [d for d in steps if "decode step" in d and "prompt tokens" in d]
    assert mixed and all(d.count("prompt tokens") == 1 for d in mixed)
    c_first = next(i for i, d in enumerate(steps) if "c prompt tokens" in d)
    assert not any("b prompt tokens" in d for d in steps[c_first:])  # b's prompt went first
    (done_d,) = [m for m in sent if isinstance(m, Finished) and m.rid == "d"]
    assert done_d.cached_tokens >= 16
    _each_as_alone(eng, sent, subs)


@pytest.mark.cuda
def test_served_prompts_replay_the_prompt_graphs_in_the_scratch(synth):
    """On CUDA the pool's scratch is the plan's prefill rows; a served prompt replays the
    prompt graphs there, its rows land in the pool as the scratch holds them, and its logits
    are the plain forward's over a pool cache within the graphs' bf16 bound (KL 1e-3)."""
    import torch
    from test_offload import offload

    from strata.model.transformer import Segment
    from strata.server import kv_batch

    eng = offload(synth("qwen3moe", "Q4_K_M"), "cuda", kernels="fused", kv_type="f16",
                  sequences=3)
    model = eng.model
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    assert runner.scratch is not None and runner.scratch.capacity == model.prefill_rows > 0
    runner.warm_up()
    replayed = model.chunks.steps["replayed"]
    runner.submit(_submit("a", PROMPTS[1] * 3, 6))
    runner.step()  # a's prompt alone: in the scratch
    runner.submit(_submit("b", PROMPTS[2] * 8, 6))
    runner.step()  # b's beside a's token: in the scratch too (its prompt longer than the rows
    # a mixed step leaves beside a)
    # (each replays its bucket's graph, captured at the warm-up)
    assert model.chunks.steps["replayed"] == replayed + 2
    texts = _texts(runner, sent, [])
    assert set(texts) == {"a", "b"}
    assert runner.pool.used == 0
    runner.pool.check_integrity()
    ids = eng.tokenizer.encode(PROMPTS[0] * 5)
    n = len(ids)
    kv = runner.pool.take()
    ref = model._forward(torch.tensor(ids), [Segment(kv, n)]).float().cpu()  # (eagerly, paged)
    sc = runner.scratch
    sc.length = 0
    got = model.forward(torch.tensor(ids), [Segment(sc, n)]).float().cpu()
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3
    other = runner.pool.take()
    kv_batch.to_pool(sc, other, 0, n)
    other.advance(n)
    rows = other.rows(0, n)
    assert torch.equal(runner.pool.store[:, :, rows], sc.store[:, :, :n])
    runner.pool.give(kv)
    runner.pool.give(other)


def test_the_reference_path_batch_gives_each_text_alone(synth):
    """The CPU's default path for a small model (the reference executor, no KV pool): 8
    sequences decoding together run each layer's stacked experts at once (ReferenceExperts'
    dense form), one alone runs them one at a time; each text, greedy and sampled, is its text
    alone."""
    eng = Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(device="cpu",
                                                                        sequences=8))
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None))
    assert runner.pool is None and runner.batch_step is None
    prompts = PROMPTS + ["x y z", "one two three four", "fox", "7 7 7"]
    subs = [_submit(f"r{i}", p, 8, seed=None if i % 2 else 200 + i)
            for i, p in enumerate(prompts)]
    together = _texts(runner, sent, subs)
    assert eng.model.experts._stacks  # (the batch ran the stacked form)
    for sub in subs:
        sent_alone: list = []
        alone = BatchRunner(eng, sent_alone.append, FaultTrigger(None))
        assert _texts(alone, sent_alone, [sub])[sub.rid] == together[sub.rid], sub.rid
