"""`strata serve`: an OpenAI-compatible HTTP server with the engine in a supervised child process.

A request's life:
1. app.py checks the key and the body (validation.py) and asks the supervisor if the engine is up.
2. scheduler.py queues it (bounded: 429 when full) and hands it to the engine when a batch slot
   frees; each request gets its own event queue.
3. engine_process.py carries it over a pipe to the engine process (worker.py), which tokenizes it
   with the model's chat template and checks it against the context (400 if it does not fit).
4. batching.py runs every active request in one forward pass per step and samples each with its
   own generator; text comes back as Delta messages, cut at stop strings (stops.py).
5. app.py answers in one piece or as SSE chunks (responses.py); metrics.py counts it.
6. supervisor.py watches the engine's progress messages: no progress for --watchdog seconds while
   requests run, or a dead process, writes a report (stall_report.py), answers the requests 503,
   and starts the engine again, up to --max-restarts within --restart-window.
Fault injection for tests: faults.py (STRATA_FAULT). Settings: config.py.
"""
