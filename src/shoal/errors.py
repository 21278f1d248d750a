"""The one exception type for mistakes a user can make (bad config, bad flags, missing files).

The CLI prints its message as one line on stderr and exits with code 2; anything else is a bug and
keeps its traceback.
"""


class UserError(ValueError):
    """A problem the user can fix: the message names the key, the value and the fix."""


class TrainingError(RuntimeError):
    """Training cannot go on (diverged, nothing to roll back to): reported as one line, exit code 1."""
