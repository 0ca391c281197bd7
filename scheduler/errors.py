"""Errors the scheduler raises for input a user can fix.

`JobSpecError` (a bad job file or job data) lives in `proto.job` because clusters validate
the same spec; it is re-exported here so callers catch scheduler errors from one place.
"""

from __future__ import annotations

from proto.errors import FabricError
from proto.job import JobSpecError


class SchedulerError(FabricError):
    """Base of the scheduler's own errors; the message is one line a user can act on."""


class ClusterSpecError(SchedulerError, ValueError):
    """A `--clusters` argument (or cluster list) is malformed."""


class PlanError(SchedulerError):
    """A placement cannot be computed from these inputs."""


class CapacityError(PlanError):
    """The clusters cannot hold the clients (total capacity is too small)."""


class JobFailed(SchedulerError):
    """The job cannot go on; the message names the cluster and what happened."""


class AssignmentFileError(PlanError):
    """A precomputed assignment file is missing, malformed or inconsistent with the job."""


__all__ = [
    "AssignmentFileError",
    "CapacityError",
    "ClusterSpecError",
    "JobFailed",
    "JobSpecError",
    "PlanError",
    "SchedulerError",
]
