"""Adapters that put torchferry inside serving engines, one room per engine (`vllm_omni`).

Each imports its engine lazily (importing torchferry never imports an engine), changes nothing until
the engine's own configuration selects torchferry, and is tested against the engine's own functions
(docs/engines.md).
"""
