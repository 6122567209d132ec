"""The one exception the configuration system raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or value that cannot work; the message names the key and the fix.

    A ValueError, so the command line reports it as an input error (no traceback).
    """
