"""The server's parts without a server: faults, stop strings, request checks, config, metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.cli.main import main
from strata.errors import StrataError
from strata.server.config import ServeConfig
from strata.server.errors import APIError
from strata.server.faults import Fault, FaultPlan, FaultTrigger
from strata.server.metrics import Metrics
from strata.server.protocol import StepDone
from strata.server.stops import StopText
from strata.server.validation import parse_chat, parse_completion


def serve_main(argv: list[str]) -> int:
    return main(["serve", *argv])


def test_fault_syntax():
    assert Fault.parse("stall@decode:3") == Fault("stall", "decode", 3, 1)
    assert Fault.parse("crash@prefill") == Fault("crash", "prefill", 1, 1)
    assert Fault.parse("crash@load*5").armed_for(5) and not Fault.parse("crash@load*5").armed_for(6)
    assert FaultPlan.from_env({}) is None
    plan = FaultPlan.from_env({"STRATA_FAULT": "crash@decode:1,timeout@decode:1*2"})
    assert [str(p) for p in (plan.armed_for(1), plan.armed_for(2))] == [
        "crash@decode:1*1,timeout@decode:1*2", "timeout@decode:1*2"]
    assert plan.armed_for(3) is None
    for bad in ("stall", "hang@decode", "stall@sample", "crash@prefill:2", "stall@decode:0",
                "timeout@load", "stall@load,"):
        with pytest.raises(StrataError, match="STRATA_FAULT"):
            FaultPlan.parse(bad)


def test_an_engine_fires_one_fault_once():
    trigger = FaultTrigger(FaultPlan.parse("timeout@decode:2,crash@decode:2"))
    trigger.at("prefill")
    trigger.at("decode", 1)
    with pytest.raises(RuntimeError, match="injected wait timeout"):  # StallError, not the crash
        trigger.at("decode", 2)
    trigger.at("decode", 2)  # fired already: nothing more


@pytest.mark.parametrize("pieces, stops, released, stopped", [
    (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),  # split across pieces
    (["ab", "c"], ["bd"], "abc", False),  # a held-back "b" turns out not to start "bd"
    (["xEN", "Dy"], ["END", "ENDING"], "x", True),  # the first match wins
    (["plain"], [], "plain", False),
])
def test_stop_strings(pieces, stops, released, stopped):
    st = StopText(stops)
    out = "".join(st.push(p) for p in pieces) + st.flush()
    assert (out, st.stopped) == (released, stopped)


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body, param, words", [
    (_chat(temperature=5), "temperature", "out of range"),
    (_chat(top_p="x"), "top_p", "must be a number"),
    (_chat(max_tokens=0), "max_tokens", "out of range"),
    (_chat(max_completion_tokens=10**6), "max_completion_tokens", "out of range"),
    (_chat(n=2), "n", "not supported"),
    (_chat(tools=[{"type": "function"}]), "tools[0].function", "must be an object"),
    (_chat(functions=[{"name": "f"}]), "functions", "not supported"),
    (_chat(response_format={"type": "xml"}), "response_format", "json_schema"),
    (_chat(logprobs=True), "logprobs", "not supported"),
    (_chat(frobnicate=1), "frobnicate", "unknown parameter"),
    (_chat(stream_options={"include_usage": True}), "stream_options", "stream: true"),
    (_chat(reasoning_effort="extreme"), "reasoning_effort", "choose from"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "Strata takes"),
    ({"messages": [{"role": "tool"}]}, "messages[0].content", "missing"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": []}, "messages", "non-empty"),
])
def test_chat_bodies_refused_by_name(body, param, words):
    with pytest.raises(APIError) as e:
        parse_chat(body, 4096)
    assert (e.value.status, e.value.param) == (400, param)
    assert words in e.value.message and e.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_body_accepted():
    req = parse_chat(_chat(temperature=0, top_k=-1, seed=3, stop="x", stream=True, user="u",
                           stream_options={"include_usage": True}, reasoning_effort="low",
                           messages=[{"role": "developer", "content": [
                               {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
                     4096)
    assert req.sampling == {"temperature": 0.0, "top_k": 0, "seed": 3}
    assert req.messages == [{"role": "system", "content": "ab"}]
    assert (req.stop, req.stream, req.include_usage) == (("x",), True, True)
    assert req.template_kwargs == {"reasoning_effort": "low"}


def test_completion_prompts():
    assert parse_completion({"prompt": ["one"]}, 16).prompt == "one"
    assert parse_completion({"prompt": [1, 2, 3]}, 16).prompt == [1, 2, 3]
    for bad, words in (({"prompt": ["a", "b"]}, "one per request"), ({"prompt": ""}, "non-empty"),
                       ({"prompt": "x", "echo": True}, "not supported")):
        with pytest.raises(APIError, match=words):
            parse_completion(bad, 16)


def test_served_name():
    assert ServeConfig().served_name == "strata-demo"
    assert ServeConfig(model="/m/Qwen3-30B-Q4_K_M-00001-of-00003.gguf").served_name == \
        "Qwen3-30B-Q4_K_M"
    assert ServeConfig(model="/m/x.gguf", model_name="y").served_name == "y"


def test_config_file_flags_win(tmp_path, capsys):
    cfg = tmp_path / "strata-test.json"
    cfg.write_text(json.dumps({"port": 9001, "queue": 3, "api-key": "k",
                               "env": {"STRATA_X": 1}}))
    assert serve_main(["--config", str(cfg), "--queue", "5", "--prompt-while-decoding", "64",
                       "--print-config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["port"], shown["queue"], shown["api-key"]) == (9001, 5, "(set)")
    assert shown["prompt-while-decoding"] == 64
    assert shown["env"] == {"STRATA_X": "1"} and shown["host"] == "127.0.0.1"
    assert shown["device"] == "auto" and shown["expert-cache"] == "auto"  # the engine's flags


def test_print_config_is_a_config_file(tmp_path, capsys):
    first = tmp_path / "strata-a.json"
    first.write_text(json.dumps({"threads": 2, "offload": "off", "watchdog": 9}))
    assert serve_main(["--config", str(first), "--threads", "3", "--print-config"]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown)["threads"] == 3 and json.loads(shown)["offload"] == "off"
    second = tmp_path / "strata-b.json"
    second.write_text(shown)
    assert serve_main(["--config", str(second), "--print-config"]) == 0
    assert capsys.readouterr().out == shown


@pytest.mark.parametrize("content, words", [
    (None, "cannot read it"),
    ("{bad json", "not valid JSON"),
    ('{"prot": 1}', "unknown setting 'prot'"),
    ('{"port": "x"}', "'port' must be an integer"),
    ('{"watchdog": -1}', "--watchdog -1"),
    ('{"offload": "maybe"}', "invalid choice: 'maybe'"),
    ('{"decode-step": "fast"}', "invalid choice: 'fast'"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys, content, words):
    path = tmp_path / "strata-bad.json"
    if content is not None:
        path.write_text(content)
    assert serve_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and err.startswith("strata serve: error:")


def test_missing_model_is_exit_2(tmp_path, capsys):
    assert serve_main([str(tmp_path / "nope.gguf")]) == 2
    assert "no such model file" in capsys.readouterr().err
    assert serve_main([str(tmp_path)]) == 2  # a folder: said so
    assert f"{tmp_path}: a folder, not a GGUF file" in capsys.readouterr().err


def test_metrics_text_parses():
    m = Metrics()
    m.request("/v1/completions", 200)
    m.tokens(5, 7)
    m.step(StepDone(0, 2, 0.5, 2))
    text = m.render(running=1, queued=2, loaded=True, restarts=1)
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["strata_completion_tokens_total"] == 7 and got["strata_queue_depth"] == 2
    assert got["strata_decode_tokens_per_second"] == 4 and got["strata_expert_cache_hit_rate"] == 0


def test_server_process_does_not_import_torch():
    code = ("import sys, strata.cli.main, strata.cli.serve, strata.server.app, "
            "strata.server.serve, strata.server.supervisor; "
            "strata.cli.main.build_parser('serve'); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


class _Pipe:
    def __init__(self) -> None:
        self.writes: list = []

    def send(self, msg: object) -> None:
        self.writes.append(msg)


def test_a_steps_messages_go_in_one_write():
    """Inside a step the engine's messages wait for its end; a Progress goes at once, with what
    waited before it; outside a step each goes alone."""
    from strata.server.protocol import Delta, Progress, Stalled
    from strata.server.worker import Outbox

    pipe = _Pipe()
    out = Outbox(pipe)
    prog, d1, d2, done = Progress("decode", "1 sequence(s)"), Delta("a", "x", 1), \
        Delta("b", "y", 1), StepDone(0, 2, 0.1, 2)
    with out.step():
        out.send(prog)
        out.send(d1)
        out.send(d2)
        out.send(done)
    assert pipe.writes == [prog, [d1, d2, done]]
    pipe.writes.clear()
    with out.step():
        out.send(d1)
        out.send(Stalled("stuck"))  # (the stall report needs it now, with the Delta first)
    assert pipe.writes == [[d1, Stalled("stuck")]]
    pipe.writes.clear()
    with out.step():
        out.send(d1)
    out.send(d2)
    assert pipe.writes == [d1, d2]


def test_the_supervisor_reads_a_list_as_its_messages_in_order():
    import asyncio

    from strata.server.protocol import Delta, Finished, Submit
    from strata.server.scheduler import Job
    from strata.server.supervisor import Supervisor

    metrics = Metrics()
    sup = Supervisor(ServeConfig(), None, metrics)
    sup.engine, sup.state = object(), "ready"  # (the engine the messages come from)

    async def run() -> list:
        job = Job(Submit("r", None, "hi", {}, 2, 2))
        sup.scheduler.running["r"] = job
        job.state = "running"
        sup._on_message(sup.engine, [Delta("r", "a", 1), StepDone(0, 1, 0.1, 1),
                                     Delta("r", "b", 2), Finished("r", "length", 1, 2)])
        return [await job.next(1.0) for _ in range(3)]

    got = asyncio.run(run())
    assert [type(m).__name__ for m in got] == ["Delta", "Delta", "Finished"]
    assert [m.text for m in got[:2]] == ["a", "b"] and "r" not in sup.scheduler.running
    assert metrics.completion_tokens == 2 and metrics.forward_passes == 1


def _unwinding_engine() -> None:
    """An engine that raised: its interpreter still tears down for a moment after its pipe
    closed (time.sleep stands in for the teardown), then ends with its own status."""
    import time
    time.sleep(0.5)
    sys.exit(7)


def test_a_crash_report_gives_the_engines_own_exit_status(tmp_path):
    """The supervisor sees a crash when the engine's pipe closes; an engine still unwinding then
    is given a moment to end, so the report says its exit code, not the SIGTERM a stop sends."""
    import multiprocessing

    from strata.server.stall_report import ReportInput, report_and_stop

    class Engine:  # EngineProcess's two members report_and_stop uses
        def __init__(self) -> None:
            self.proc = multiprocessing.get_context("spawn").Process(target=_unwinding_engine)
            self.proc.start()

        def stop(self, graceful: bool = True) -> int | None:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
            return self.proc.exitcode

    info = ReportInput(kind="crash", what="", engine_pid=0, start=1, model="m", device="cpu",
                       engine_up_s=1.0)
    path = report_and_stop(Engine(), info, str(tmp_path))
    assert info.what == "the engine process ended unexpectedly (exit code 7)", info.what
    assert path and "exit code 7" in open(path).read()
