"""Facts read once before planning: the machine's memory bounds, rates and profiles, the device's
type, name and free memory (and for auto its saved profile and timed host-to-device rate), and what
the open planner needs of a live pipeline and its checkpoint (`read_facts`)."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.machine._device_facts import device_facts as device_facts
from torchferry.runtime.machine._facts import READ_MODE_ENV as READ_MODE_ENV
from torchferry.runtime.machine._facts import module_bytes as module_bytes
from torchferry.runtime.machine._facts import read_facts as read_facts
from torchferry.runtime.machine._facts import strided_names as strided_names
from torchferry.runtime.machine._facts import widened_names as widened_names
from torchferry.runtime.machine._host_facts import host_facts as host_facts
from torchferry.runtime.machine._probe import copy_bytes_per_s as copy_bytes_per_s
from torchferry.runtime.machine._probe import host_name as host_name
from torchferry.runtime.machine._probe import load_profile as load_profile
from torchferry.runtime.machine._probe import probe as probe
from torchferry.runtime.machine._probe import profile_path as profile_path
from torchferry.runtime.machine._probe import save_profile as save_profile
