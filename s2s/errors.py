"""One exception type for every user-facing error.

The CLI prints ``S2SError`` as a single line (``s2s: error: ...``) and exits
non-zero; any other exception is a bug and keeps its traceback.
"""


class S2SError(Exception):
    """A bad input: its message names the file, line or key at fault."""


class ConfigError(S2SError):
    """An invalid experiment configuration (unknown key, wrong type, bad value)."""


class Interrupted(S2SError):
    """Ctrl-C or SIGTERM that a command handled (it finished a step, wrote a checkpoint): the CLI
    reports ``s2s: interrupted: ...``, not an error, and exits with ``exit_code`` (128 + signal)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
