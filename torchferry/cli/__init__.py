"""The command line and its reports: ``torchferry demo`` and ``torchferry plan``.

A leaf of the package: it imports the layers and the session, and nothing in them imports it.
"""

from __future__ import annotations

from torchferry.cli._main import main

__all__ = ["main"]
