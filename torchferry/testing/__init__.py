"""What tests, benchmarks and the demo share: the toy pipeline and a local multi-process runner.

A leaf of the package (as ``torch.testing`` is): nothing in the layers or the session imports it.
"""

from __future__ import annotations

from torchferry.testing import toy
from torchferry.testing._multiproc import RankError, RankFailure, run_ranks

__all__ = ["RankError", "RankFailure", "run_ranks", "toy"]
