"""Stall and crash reports: what the engine was doing, where every thread stood, and the memory.

A report answers, in this order: what happened (no progress for how long, or how the process
ended), the stage and position of every request, the last GPU wait, the expert cache and CPU pool,
KV caches, host and GPU memory, the last progress messages, then every thread's Python stack.
Docs: docs/TROUBLESHOOTING.md ("Reading a stall report").
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata import __version__
from strata.server.engine_process import EngineProcess, exit_text

log = logging.getLogger("strata.serve")

MIB = 1 << 20


@dataclass
class ReportInput:
    kind: str  # "stall" or "crash"
    what: str  # one line: what happened
    engine_pid: int
    start: int
    model: str
    device: str
    engine_up_s: float
    stage: str = "unknown"
    detail: str = ""
    state: dict[str, Any] = field(default_factory=dict)
    last_progress_age: float | None = None
    recent: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # from Loaded: executor, cache, pool
    fault: str | None = None
    stacks: str | None = None


def capture_stacks(pid: int, path: str, timeout: float = 3.0) -> str | None:
    """Every thread's stack: SIGUSR1 makes the engine's faulthandler write them to `path`; wait
    (at most `timeout`) until the file stops growing."""
    try:
        before = os.path.getsize(path)
        os.kill(pid, signal.SIGUSR1)
    except (OSError, AttributeError):  # gone, or no SIGUSR1 on this platform
        return None
    deadline, size, settled = time.monotonic() + timeout, before, 0
    while time.monotonic() < deadline and settled < 3:
        time.sleep(0.1)
        now = os.path.getsize(path)
        settled = settled + 1 if now == size and now > before else 0
        size = now
    with open(path, errors="replace") as f:
        f.seek(before)
        return f.read() or None


def memory_lines(pid: int) -> list[str]:
    lines = []
    status = _proc_fields(f"/proc/{pid}/status")
    if status:
        lines.append(f"engine process: RSS {_kib(status.get('VmRSS'))}, peak "
                     f"{_kib(status.get('VmHWM'))}, threads: {status.get('Threads', '?')}")
    info = _proc_fields("/proc/meminfo")
    if info:
        lines.append(f"host: {_kib(info.get('MemAvailable'))} available of "
                     f"{_kib(info.get('MemTotal'))}")
    return lines or ["host memory: unknown (no /proc on this system)"]


def gpu_lines(timeout: float = 5.0) -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ["no nvidia-smi on this machine"]
    query = "index,name,memory.used,memory.total,utilization.gpu"
    try:
        out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"nvidia-smi did not answer: {e}"]
    return [f"GPU {line.strip()}" for line in out.stdout.splitlines() if line.strip()]


def render(r: ReportInput) -> str:
    s = r.state
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    lines = [
        f"Strata {r.kind} report (strata {__version__})",
        f"what:        {r.what}",
        f"stage:       {r.stage}: {r.detail or '-'}",
    ]
    for rid, position, steps, generated in s.get("requests", []):
        lines.append(f"request:     {rid} at position {position}; decode steps done: {steps}, "
                     f"tokens generated: {generated}")
    if r.last_progress_age is not None:
        lines.append(f"last progress: {r.last_progress_age:.1f} s before this report")
    lines += [
        f"when:        {when}; server pid {os.getpid()}, engine pid {r.engine_pid} "
        f"(start #{r.start}, up {r.engine_up_s:.1f} s)",
        f"model:       {r.model} on {r.device}",
        f"executor:    {r.info.get('executor', 'not loaded yet')}",
        f"last GPU wait: {s.get('gpu_wait') or 'none recorded (this engine records none)'}",
        f"expert cache: {r.info.get('expert_cache') or 'none in this engine'}",
        f"CPU pool:    {r.info.get('cpu_pool') or 'none in this engine'}",
        f"KV caches:   {len(s.get('requests', []))} sequence(s), {_size(s.get('kv_bytes', 0))}",
    ]
    if "experts" in s:
        lines.append("expert stats: " + ", ".join(f"{k} {v}" for k, v in s["experts"].items()))
    if "layer" in s:
        lines.append(f"layer:       {s['layer'] + 1} (the last one the forward pass reported)")
    if "gpu_allocated" in s:
        lines.append(f"torch CUDA:  {s['gpu_allocated'] / MIB:.0f} MiB allocated, "
                     f"{s['gpu_reserved'] / MIB:.0f} MiB reserved (at the last step)")
    lines += [f"memory:      {m}" for m in memory_lines(r.engine_pid)]
    lines += [f"gpu:         {g}" for g in gpu_lines()]
    if r.fault:
        lines.append(f"fault:       STRATA_FAULT={r.fault} was armed in this engine (injected)")
    lines += ["", "recent progress (oldest first):"] + [f"  {p}" for p in r.recent]
    lines += ["", f"Python stacks of every thread of engine pid {r.engine_pid} (most recent call "
              "first; threads that never ran Python, such as torch's, have none):"]
    if r.stacks:
        lines.append(r.stacks.rstrip())
    elif r.kind == "crash":
        lines.append("  (the process was already gone; anything it printed is in the server log)")
    else:
        lines.append("  (the engine did not write them in time: it may be stuck outside Python)")
    return "\n".join(lines) + "\n"


def write(report_dir: str, r: ReportInput) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(report_dir).resolve() / f"strata-{r.kind}-{r.engine_pid}-{stamp}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(r))
    return path


_EXIT_GRACE_S = 3.0  # how long a crashed engine is given to finish exiting


def report_and_stop(eng: EngineProcess, info: ReportInput, report_dir: str) -> str | None:
    """In a worker thread: a stalled engine is looked into before it is stopped, a crashed one
    after (for its exit status). Returns the report's path; a report that fails is logged and
    never stands in the way of the restart."""
    if info.kind == "stall":
        info.stacks = _guard("capture the stacks", capture_stacks, eng.pid, eng.opts.stacks_path)
        path = _guard("write the report", write, report_dir, info)
        eng.stop(graceful=False)
    else:
        # its pipe closed as it ended; one that raised may still be unwinding (its interpreter's
        # teardown): its own exit status, not the SIGTERM stop would send it first
        eng.proc.join(_EXIT_GRACE_S)
        code = eng.stop(graceful=False)
        info.what = f"the engine process ended unexpectedly ({exit_text(code)})"
        path = _guard("write the report", write, report_dir, info)
    return str(path) if path else None


def _guard(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        log.error("could not %s: %s: %s", what, type(e).__name__, e)
        return None


def top_frame(stacks: str | None) -> str | None:
    """The innermost frame of the engine's main thread (the block that runs worker.py)."""
    for block in (stacks or "").split("\n\n"):
        if "strata/server/worker.py" in block:
            frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
            return frames[0] if frames else None
    return None


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB"


def _proc_fields(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in f)}
    except OSError:
        return {}


def _kib(value: str | None) -> str:
    if not value or not value.split()[0].isdigit():
        return "?"
    return f"{int(value.split()[0]) / 1024:.0f} MiB"
