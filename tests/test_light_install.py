"""`make demo` installs only what the demo runs: the base install (torch and pyproject's
dependencies, no extras). Its target depends on the base step alone, that step installs no extra,
and the demo, the chat and the server (its chat page and API) run with every module of every
extra ([cpu], [serve], [cuda], [test]) made to fail on import.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from strata.server.testing import ServerProcess

tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads pyproject.toml")
REPO = Path(__file__).resolve().parents[1]
# each extra's distribution -> the top-level module it installs
MODULES = {"pytest": "pytest", "ruff": "ruff", "transformers": "transformers",
           "pytest-xdist": "xdist", "accelerate": "accelerate", "sentencepiece": "sentencepiece",
           "protobuf": "google", "matplotlib": "matplotlib", "openai": "openai", "httpx": "httpx",
           "prometheus-client": "prometheus_client", "selenium": "selenium",
           "ggml-python": "ggml", "llama-cpp-python": "llama_cpp", "triton": "triton",
           "llguidance": "llguidance", "fla-core": "fla"}


def _extras() -> dict[str, list[str]]:
    """Each extra's distribution names, from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {extra: [re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in reqs]
            for extra, reqs in project["optional-dependencies"].items()}


def test_extras_are_named_for_what_they_bring():
    extras = _extras()
    assert set(extras) == {"cpu", "serve", "cuda", "test"}
    assert extras["cpu"] == ["ggml-python"] and extras["serve"] == ["llguidance"]
    assert extras["cuda"] == ["fla-core"]  # (GPU only: make test's CPU machine goes without)
    assert set(extras["cpu"] + extras["serve"]) <= set(extras["test"])  # make test has them all
    unknown = {d for ds in extras.values() for d in ds} - set(MODULES)
    assert not unknown, f"name the module of {sorted(unknown)} in MODULES"


def _rule(makefile: str, target: str) -> tuple[str, list[str]]:
    """(prerequisites, recipe lines) of `target:` in the Makefile."""
    m = re.search(rf"^{re.escape(target)}:([^\n]*)\n((?:\t[^\n]*\n)*)", makefile, re.M)
    assert m, f"no {target} rule in the Makefile"
    return m.group(1).strip(), [line.strip() for line in m.group(2).splitlines()]


def test_make_demo_installs_the_base_only():
    makefile = (REPO / "Makefile").read_text()
    deps, recipe = _rule(makefile, "demo")
    assert deps == "$(BASE)" and recipe and all("$(PIP)" not in line for line in recipe)
    deps, recipe = _rule(makefile, "$(BASE)")
    installs = [line for line in recipe if "$(PIP)" in line]
    assert len(installs) == 2 and installs[1] == "$(PIP) install -q -e ."
    assert installs[0].startswith("$(PIP) install -q torch==2.13.0") and "[" not in installs[0]
    assert any(line.startswith("@echo") for line in recipe)  # it says what it does
    _, venv = _rule(makefile, "$(BIN)/python")
    assert [line for line in venv if "$(PIP)" in line] == ["$(PIP) install -q --upgrade pip"]


_SITECUSTOMIZE = """
import sys

class _Missing:
    '''As if {blocked} were not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"No module named {{name!r}} (not in the base install)", name=name)
        return None

sys.meta_path.insert(0, _Missing())
"""


@pytest.fixture(scope="module")
def base_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    blocked = tuple(sorted({MODULES[d] for ds in _extras().values() for d in ds}))
    site = tmp_path_factory.mktemp("base_install")
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(blocked=blocked))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    code = (f"import importlib\nfor m in {blocked!r}:\n    try:\n"
            "        importlib.import_module(m)\n    except ImportError:\n        continue\n"
            "    raise SystemExit(m + ' imported')\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr  # the hook works
    return env


def _strata(env: dict[str, str], *args: str, stdin: str | None = None):
    r = subprocess.run([sys.executable, "-m", "strata", *args], env=env, capture_output=True,
                       text=True, timeout=300, input=stdin,
                       stdin=None if stdin is not None else subprocess.DEVNULL)
    assert r.returncode == 0, f"strata {' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_the_demo_chat_and_server_run_on_the_base_install(base_env: dict[str, str]):
    r = _strata(base_env, "generate", "--prompt", "The Linux kernel", "-n", "8", "--seed", "1")
    assert r.stdout.startswith("The Linux kernel") and "generated 8 tokens" in r.stderr

    r = _strata(base_env, "chat", "-n", "8", "--seed", "1", stdin="Hello\n/exit\n")
    assert re.search(r"answer \d+ tokens at [\d.]+ tok/s", r.stderr), r.stderr

    with ServerProcess(None, ["--max-tokens", "16"], env=base_env) as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        with urllib.request.urlopen(s.url + "/", timeout=30) as page:
            assert b"<title>Strata chat</title>" in page.read()
        answer = _post(s.url, {"messages": ASK, "max_tokens": 4})
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert answer["usage"]["completion_tokens"] >= 1
        # the demo's template takes no tools: they, the call and its result reach the prompt
        # as hermes text (server/tool_prompt.py)
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'}]
        tools = _post(s.url, {"messages": history, "tools": [WEATHER], "max_tokens": 4})
        plain = answer["usage"]["prompt_tokens"]
        assert tools["usage"]["prompt_tokens"] > plain + 60, (plain, tools["usage"])
        assert tools["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read().decode()}") from None
