"""The session contract: what a user may and may not do to a pipeline while it is served."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.guard._claims import CLAIMS as CLAIMS
from torchferry.runtime.guard._claims import Claim as Claim
from torchferry.runtime.guard._claims import Watch as Watch
from torchferry.runtime.guard._claims import refuse_foreign as refuse_foreign
from torchferry.runtime.guard._guard import SessionGuard as SessionGuard
