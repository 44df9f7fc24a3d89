"""The error hierarchy of mover_plugin.

Every error the plugin raises on purpose derives from :class:`MoverError`, so callers can catch
the plugin's errors without catching everything else.
"""


class MoverError(Exception):
    """Base class of every error mover_plugin raises on purpose."""


class ConfigError(MoverError, ValueError):
    """A flag, config value or file given by the user is invalid.

    The message names the bad value and what would be valid. Raised before any process starts.
    """


class PatchError(MoverError):
    """A framework patch cannot be applied or reverted."""


class UnsupportedVersionError(PatchError):
    """A patch was asked for on a framework version it was not written and tested for."""


class LaunchError(MoverError):
    """The launcher could not start or keep the job running."""


class StateTransferError(MoverError):
    """A rank's state cannot be copied or handed over as it is: its tensors do not match, in
    size, what the other side holds or expects."""
