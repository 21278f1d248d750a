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
        quiet_library_logs()
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{feature} needs the {module.split('.')[0]} package; install it with: "
                        f"{install_hint(extra)}") from None


def install_hint(extra: str) -> str:
    """The command that installs shoal's `extra` where this shoal came from: the clone or wheel it was
    installed from (pip's direct_url.json; -e where it was editable), with this interpreter's pip; else the
    package by name. `pip install 'shoal[ray]'` alone names a package that is not published."""
    import json
    import sys
    from importlib import metadata
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    try:
        origin = json.loads(metadata.distribution("shoal").read_text("direct_url.json") or "null") or {}
    except (metadata.PackageNotFoundError, ValueError):
        origin = {}
    url = urlparse(origin.get("url", ""))
    where = Path(unquote(url.path)) if url.scheme == "file" else None
    if where is None or not where.exists():
        return f"pip install 'shoal[{extra}]'"
    editable = "-e " if origin.get("dir_info", {}).get("editable") else ""
    return f"{sys.executable} -m pip install {editable}'{where}[{extra}]'"


def quiet_library_logs() -> None:
    """Importing transformers imports torchao wherever it is installed (its quantizers, some lazily), and
    torchao's import logs "Failed to load" for each kernel library built for another torch or for CUDA (every
    one, on a CPU build of torch), and torch logs a deprecation for each enum torchao registers with pytree:
    four lines before shoal's own output on every run of a Hugging Face model, none about the user's run.
    Those two messages are dropped, by a filter on their own loggers (installed once; every other record of
    those loggers still shows)."""
    import logging

    for name, noise in (("torchao", "Failed to load "),
                        ("torch.utils._pytree", "is an Enum subclass and is now natively supported")):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(noise))


class _Drop:
    """A logging filter dropping the records whose message contains `noise`."""

    def __init__(self, noise: str):
        self.noise = noise

    def filter(self, record) -> bool:
        return self.noise not in record.getMessage()
