"""The command-line parser of ``autoplan``, ``autoplan calibrate`` and the emitted train.py."""

from __future__ import annotations

import argparse
from typing import NoReturn

from autoplan.errors import AutoplanError


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as every other user error: an
    :class:`AutoplanError` naming the problem and where the options are listed, which the
    command (and train.py, on one rank) prints as ``autoplan: error: ...`` and exits 2
    (argparse's own prints the whole usage first, on every rank of a torchrun job). Sub-command
    parsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        raise AutoplanError(f"{message} (`{self.prog} --help` lists the options)")
