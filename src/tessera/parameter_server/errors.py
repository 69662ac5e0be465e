"""The parameter server's error: a peer that died, hung or broke the protocol, named in one sentence."""

from __future__ import annotations

from tessera.errors import UserError


class PSError(UserError):
    """A server or worker of a parameter-server job failed; the message names which (exit code 1)."""

    exit_code = 1


def last_line(err: BaseException) -> str:
    """The useful tail of a (possibly remote, multi-line) exception message."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(err).__name__
