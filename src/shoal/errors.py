"""The one exception type for mistakes a user can make (bad config, bad flags, missing files).

The CLI prints its message as one line on stderr and exits with code 2; anything else is a bug and
keeps its traceback.
"""


class UserError(ValueError):
    """A problem the user can fix: the message names the key, the value and the fix."""


class TrainingError(RuntimeError):
    """Training cannot go on (diverged, nothing to roll back to): reported as one line, exit code 1."""


def first_line(e: BaseException) -> str:
    """A library's exception as one line of a UserError (its first line, at most 200 characters)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def require(module: str, extra: str, feature: str):
    """Import an optional dependency, or fail in one line naming the install that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{feature} needs the {module.split('.')[0]} package; install it with: "
                        f"pip install 'shoal[{extra}]'") from None
