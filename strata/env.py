"""The environment variables the engine reads, each parsed and checked here (torch-free, so the
command line checks them before any import that reads one; a bad value is one line naming it).

    STRATA_WAIT_TIMEOUT    seconds a bounded wait may take (runtime/waits.py), above 0; 60
    STRATA_CPU_SHARE_POOL  graph | token: the CPU pool --cpu-share runs on (experts/cpu_share.py)
    STRATA_TUNING          tuned values for one process (kernels/tuning.py parses its own)
    STRATA_FAULT           fault injection for the server's tests (server/faults.py)
    STRATA_CACHE           the folder for built kernels and wheels (cache.py)
"""

from __future__ import annotations

import math
import os

from strata.errors import StrataError

WAIT_TIMEOUT_ENV, CPU_SHARE_POOL_ENV = "STRATA_WAIT_TIMEOUT", "STRATA_CPU_SHARE_POOL"
CPU_SHARE_POOLS = ("graph", "token")


def wait_timeout_s() -> float:
    text = os.environ.get(WAIT_TIMEOUT_ENV)
    if text is None:
        return 60.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise StrataError(f"{WAIT_TIMEOUT_ENV}={text}: give the seconds a bounded wait may take, "
                          "a number above 0 (60 when unset)")
    return value


def cpu_share_pool() -> str:
    pool = os.environ.get(CPU_SHARE_POOL_ENV, "graph")
    if pool not in CPU_SHARE_POOLS:
        raise StrataError(f"{CPU_SHARE_POOL_ENV}={pool}: give graph (the default) or token")
    return pool


def check() -> None:
    """Each variable above that this module parses: the first bad one raises StrataError."""
    wait_timeout_s()
    cpu_share_pool()
