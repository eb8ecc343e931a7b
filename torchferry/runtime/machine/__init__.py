"""Facts about this machine, read once before planning: memory bounds, rates, profiles."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.machine._host_facts import host_facts as host_facts
from torchferry.runtime.machine._probe import copy_bytes_per_s as copy_bytes_per_s
from torchferry.runtime.machine._probe import host_name as host_name
from torchferry.runtime.machine._probe import load_profile as load_profile
from torchferry.runtime.machine._probe import probe as probe
from torchferry.runtime.machine._probe import profile_path as profile_path
from torchferry.runtime.machine._probe import save_profile as save_profile
