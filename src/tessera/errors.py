"""Errors a user can cause (the CLI turns each into one sentence on stderr and exit code 2), and the
errors of a call between ranks that cannot complete (one sentence too, but a failure of the job, not of
what the user asked for: a rank that raises one exits with code 1 so an elastic agent restarts it)."""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user asked for (config, paths, degrees); never a bug in tessera."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A configuration value, key or combination that cannot work."""


class CommError(RuntimeError):
    """A collective or point-to-point call that could not complete. The message is one sentence naming
    this rank, the op, the axis and its member ranks; the attributes say the same for code."""

    exit_code = 1  # not a user error: the job failed, and an elastic agent may restart it

    def __init__(self, message: str, *, rank: int = -1, op: str = "", axis: str = "",
                 ranks: tuple[int, ...] = (), peer: int | None = None, cause: str = "error"):
        super().__init__(message)
        self.rank, self.op, self.axis, self.ranks = rank, op, axis, tuple(ranks)
        self.peer = peer  # the peer's global rank when it is known (point-to-point, a group of two)
        self.cause = cause  # "timeout", "peer gone" or "error"


class CommTimeoutError(CommError):
    """A collective or point-to-point call that did not complete in time (a peer hung, or issued a
    different collective)."""


class PeerGoneError(CommError):
    """A collective or point-to-point call that failed because a peer process of its group is gone
    (it crashed, was killed or exited); the backend usually says so at once instead of timing out."""
