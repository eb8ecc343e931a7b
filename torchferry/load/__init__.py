"""Loading: pipelines and models built on meta from their files and filled once, `from_pretrained()`
for a folder (pre-quantized ones included) and `from_single_file()` for a GGUF file."""

from __future__ import annotations

# The names the package root, the command line and the integrations use: they enter this room only here.
from torchferry.load._pretrained import build_on_meta as build_on_meta
from torchferry.load._pretrained import from_pretrained as from_pretrained
from torchferry.load._pretrained import pipeline_on_meta as pipeline_on_meta
from torchferry.load._pretrained import resolve_folder as resolve_folder
from torchferry.load._single_file import from_single_file as from_single_file
from torchferry.load._single_file import gguf_source as gguf_source
from torchferry.load._single_file import model_on_meta as model_on_meta
