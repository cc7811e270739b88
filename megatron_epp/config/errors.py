"""The one error type of bad input to a run: a flag, a combination of flags, or what they name (data, a checkpoint,
a profile) that cannot run. Raised before any work, by the parser and by whatever checks the input at start-up."""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad flag or flag combination, or input the flags name; ``pretrain_gpt.py`` prints it as one line and exits
    with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(f"pretrain_gpt.py: error: {message}")
