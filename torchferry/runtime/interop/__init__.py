"""Adapting torch's and diffusers' own behaviour (casting, autocast, inputs, kept dtypes)."""

from __future__ import annotations

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.interop._autocast import CastCache as CastCache
from torchferry.runtime.interop._casting import Casting as Casting
from torchferry.runtime.interop._casting import diffusers_cast as diffusers_cast
from torchferry.runtime.interop._inputs import Inputs as Inputs
from torchferry.runtime.interop._meta import meta_parameters as meta_parameters
from torchferry.runtime.interop._widen import kept_in_float32 as kept_in_float32
