"""Moved to strata.runtime.waits (below the model and the experts); kept for old imports."""

from strata.runtime.waits import (
    DEFAULT_TIMEOUT_S,
    PROGRESS,
    Progress,
    StallError,
    to_device,
    to_host,
    wait_event,
)

__all__ = ["DEFAULT_TIMEOUT_S", "PROGRESS", "Progress", "StallError", "to_device", "to_host",
           "wait_event"]
