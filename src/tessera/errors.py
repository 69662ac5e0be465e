"""Errors a user can cause. The CLI turns each into one sentence on stderr and exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user asked for (config, paths, degrees); never a bug in tessera."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A configuration value, key or combination that cannot work."""


class CommTimeoutError(RuntimeError):
    """A collective or point-to-point call that did not complete in time (a peer hung or died)."""
