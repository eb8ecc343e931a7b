"""The executor: a schedule compiled to handlers and carried out from forward hooks."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.executor._engine import Engine as Engine
from torchferry.runtime.executor._engine import execute as execute
from torchferry.runtime.executor._engine import stream_factory as stream_factory
from torchferry.runtime.executor._program import listing as listing
from torchferry.runtime.executor._step_cache import Steps as Steps
from torchferry.runtime.executor._step_cache import prove as prove
from torchferry.runtime.executor._trace import Span as Span
from torchferry.runtime.executor._trace import StepTrace as StepTrace
from torchferry.runtime.executor._trace import Tracer as Tracer
