"""What tests, benchmarks and the demo share: the toy pipeline, a multi-process runner, the stream
sanitizer, the CUDA path on a CPU.

A leaf of the package (as ``torch.testing`` is): nothing in the layers or the session imports it.
"""

from __future__ import annotations

from torchferry.testing import toy
from torchferry.testing._cuda_path import CudaPathStreams, cuda_path
from torchferry.testing._multiproc import RankError, RankFailure, run_ranks
from torchferry.testing._sanitizer import StreamOrderError, StreamSanitizer, sanitize

__all__ = [
    "CudaPathStreams",
    "RankError",
    "RankFailure",
    "StreamOrderError",
    "StreamSanitizer",
    "cuda_path",
    "run_ranks",
    "sanitize",
    "toy",
]
