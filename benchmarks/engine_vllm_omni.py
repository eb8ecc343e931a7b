"""torchferry's vLLM-Omni backend beside vLLM-Omni's own LayerWiseOffloadBackend, on one pipeline, in one run.

Run in the environment tools/vllm_omni_env.sh builds (vLLM-Omni 0.30.0 on the CPU):

    .venv-vllm-omni/bin/python benchmarks/engine_vllm_omni.py [--quick]

A native vLLM-Omni-style pipeline (a plain nn.Module declaring ``_dit_modules``) holds a diffusers
``WanTransformer3DModel`` of 16 blocks of 4.2 MiB (float32, 64 tokens). Three copies are timed
round-robin, one thread each: resident (no offload), vLLM-Omni's ``LayerWiseOffloadBackend`` (built as
its ``get_offload_backend`` builds it for ``enable_layerwise_offload=True``; ``pin_cpu_memory=False``,
nothing pins on a CPU), and torchferry's backend returned by the same ``get_offload_backend`` for the
same flag plus ``additional_config={"offload_backend": "torchferry"}``. For each: the forward's
min/median/max, the overhead per block over resident (from the least forwards), bit identity with
resident, and in a child process of its own the resident set size (RssAnon) the backend adds once
enabled and after a forward. On a CPU both backends' "device" is host memory, so the figures compare
bookkeeping and copies, not PCIe; a GPU row is gpu_check's to add.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from typing import Any

import _common as common

BLOCKS = 16


def pipeline(blocks: int) -> Any:
    import diffusers
    import torch
    from torch import nn

    class Native(nn.Module):
        _dit_modules = ("transformer",)
        _encoder_modules: tuple[str, ...] = ()
        _vae_modules: tuple[str, ...] = ()

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.transformer = diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16,
                out_channels=16, text_dim=32, freq_dim=16, ffn_dim=1024, num_layers=blocks,
                rope_max_seq_len=32,
            ).eval()  # fmt: skip

        def forward(self, latents: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.transformer(latents, torch.tensor([500.0]), embeds, return_dict=False)[0]
            return out

    return Native()


def inputs() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 16, 1, 16, 16, generator=g), torch.randn(1, 8, 32, generator=g)


def enable(kind: str, pipe: Any) -> Any:
    """The backend of ``kind`` enabled on ``pipe`` through vLLM-Omni's own functions (None: resident)."""
    import torch

    if kind == "resident":
        return None
    from vllm_omni.diffusion import offloader
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.offloader import LayerWiseOffloadBackend, OffloadConfig

    cpu = torch.device("cpu")
    if kind == "torchferry":
        from vllm_omni.plugins import load_omni_general_plugins

        load_omni_general_plugins()
        selected = {"offload_backend": "torchferry"}
        config = OmniDiffusionConfig.from_kwargs(
            enable_layerwise_offload=True, pin_cpu_memory=False, additional_config=selected
        )
        backend = offloader.get_offload_backend(config, device=cpu)  # torchferry's, once registered
    else:  # vLLM-Omni's get_offload_backend returns None on a CPU (no platform): build what it would build
        config = OmniDiffusionConfig.from_kwargs(enable_layerwise_offload=True, pin_cpu_memory=False)
        backend = LayerWiseOffloadBackend(OffloadConfig.from_od_config(config), cpu)
    backend.enable(pipe)
    return backend


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def memory(kind: str, blocks: int) -> dict[str, int]:
    """In this (child) process: RssAnon the backend adds when enabled and after one forward."""
    import torch

    torch.set_num_threads(1)
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    pipe = pipeline(blocks)
    latents, embeds = inputs()
    with torch.no_grad():
        pipe(latents, embeds)
    base = rss_anon()
    enable(kind, pipe)
    enabled = rss_anon()
    with torch.no_grad():
        pipe(latents, embeds)
    return {"enabled": enabled - base, "after_forward": rss_anon() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks, short timing")
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks = 4 if args.quick else BLOCKS
    if args.memory:
        print(json.dumps(memory(args.memory, blocks)))
        return
    import torch

    torch.set_num_threads(1)
    kinds = ["resident", "vllm-omni layerwise", "torchferry"]
    base = pipeline(blocks)
    latents, embeds = inputs()
    with torch.no_grad():
        expected = base(latents, embeds)
    pipes = {kind: copy.deepcopy(base) for kind in kinds}
    backends = {kind: enable(kind, pipes[kind]) for kind in kinds}
    same = {}
    with torch.no_grad():
        for kind in kinds:
            same[kind] = torch.equal(pipes[kind](latents, embeds), expected)
    load = common.load_average()

    def forward(kind: str) -> Any:
        def run() -> None:
            with torch.no_grad():
                pipes[kind](latents, embeds)

        return run

    stats = common.round_robin({kind: forward(kind) for kind in kinds}, 5 if args.quick else 15, clock="cpu")
    rows, results = [], {}
    for kind in kinds:
        child = subprocess.run(
            [sys.executable, __file__, "--memory", kind, *(["--quick"] if args.quick else [])],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        mem = json.loads(child.stdout.strip().splitlines()[-1])
        s = stats[kind]
        per_block = (s.min - stats["resident"].min) / blocks
        rows.append([
            kind, common.fmt_seconds(s.min), common.fmt_seconds(s.median), common.fmt_seconds(s.max),
            "-" if kind == "resident" else common.fmt_seconds(per_block), same[kind],
            common.fmt_bytes(mem["enabled"]), common.fmt_bytes(mem["after_forward"]),
        ])  # fmt: skip
        results[kind] = {"stats": s, "per_block_s": per_block, "bit_identical": same[kind], "rss_anon": mem}
    for backend in backends.values():
        if backend is not None:
            backend.disable()
    headers = ["backend", "min", "median", "max", "per block", "bit-identical", "RssAnon enabled"]
    headers.append("after forward")
    print(f"{blocks} blocks of a WanTransformer3DModel, CPU, 1 thread; load {common.fmt_load(load)}")
    print(common.table(headers, rows))
    common.write_json(
        common.RESULTS / "engine_vllm_omni.json",
        {"machine": common.machine(), "blocks": blocks, "load_before": load, "results": results},
    )


if __name__ == "__main__":
    main()
