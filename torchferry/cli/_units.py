"""Reading byte counts and rates as people write them (``24GiB``, ``25GB/s``): see `torchferry.topology`.

Printing them is `torchferry.policies.format_bytes`.
"""

from __future__ import annotations

from torchferry.topology import parse_bytes, parse_rate

__all__ = ["parse_bytes", "parse_rate"]
