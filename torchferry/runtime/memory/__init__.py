"""Host buffers and what points into them: pinning, packs, layouts, wrapper tensors."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.memory._layouts import Layouts as Layouts
from torchferry.runtime.memory._layouts import aliased as aliased
from torchferry.runtime.memory._layouts import shared_elsewhere as shared_elsewhere
from torchferry.runtime.memory._pack import SWAP as SWAP
from torchferry.runtime.memory._pack import Arriving as Arriving
from torchferry.runtime.memory._pack import Pack as Pack
from torchferry.runtime.memory._pack import PackState as PackState
from torchferry.runtime.memory._pack import Piece as Piece
from torchferry.runtime.memory._pack import Sharding as Sharding
from torchferry.runtime.memory._pack import Unit as Unit
from torchferry.runtime.memory._pack import contiguous_strides as contiguous_strides
from torchferry.runtime.memory._pack import dense_strides as dense_strides
from torchferry.runtime.memory._pack import land as land
from torchferry.runtime.memory._pack import lift as lift
from torchferry.runtime.memory._pack import load_docked as load_docked
from torchferry.runtime.memory._pack import shard_span as shard_span
from torchferry.runtime.memory._pack import views_into as views_into
from torchferry.runtime.memory._pinning import PAGE as PAGE
from torchferry.runtime.memory._pinning import CudaPinner as CudaPinner
from torchferry.runtime.memory._pinning import HostMemory as HostMemory
from torchferry.runtime.memory._pinning import HostPinner as HostPinner
from torchferry.runtime.memory._pinning import page_bytes as page_bytes
from torchferry.runtime.memory._pinning import warn_pageable as warn_pageable
from torchferry.runtime.memory._wrappers import check_wrappers as check_wrappers
from torchferry.runtime.memory._wrappers import find_wrappers as find_wrappers
from torchferry.runtime.memory._wrappers import holders as holders
from torchferry.runtime.memory._wrappers import on_host as on_host
from torchferry.runtime.memory._wrappers import standalone as standalone
