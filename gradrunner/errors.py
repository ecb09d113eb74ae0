"""The one exception type for user mistakes (bad config, bad tap spec, bad model or data)."""

from __future__ import annotations


class GradrunnerError(Exception):
    """A mistake in what the user asked for; the message names the bad value and what is allowed.

    Example::

        raise GradrunnerError("capture.strategy='hooks' is not a strategy; allowed: retain_grad, hook, autograd_grad")

    The CLI prints the message alone (no traceback) and exits with status 2.
    """
