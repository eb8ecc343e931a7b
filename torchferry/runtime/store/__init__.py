"""The host store: every pack's host bytes, filled once at open, and the file tier."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.store._file_tier import TierLayout as TierLayout
from torchferry.runtime.store._file_tier import tier_request as tier_request
from torchferry.runtime.store._host_side import HostPlan as HostPlan
from torchferry.runtime.store._host_side import exchange_budgets as exchange_budgets
from torchferry.runtime.store._host_side import host_figures as host_figures
from torchferry.runtime.store._host_side import host_side as host_side
from torchferry.runtime.store._host_side import open_tier as open_tier
from torchferry.runtime.store._progress import Progress as Progress
from torchferry.runtime.store._store import HostStore as HostStore
