"""``python -m torchferry`` runs the command-line interface."""

from __future__ import annotations

import sys

from torchferry.cli import main

sys.exit(main())
