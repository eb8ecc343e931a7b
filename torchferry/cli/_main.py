"""The ``torchferry`` command line, ``demo``, ``plan`` and ``probe`` (also ``python -m torchferry``).

Every mistake in the input (an unknown model id, a size or rate that does not parse, a missing or
broken checkpoint) ends in one line on stderr, ``torchferry <command>: error: <what and how to fix
it>``, and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from torchferry._errors import OffloadError
from torchferry.policies import BUILTINS, DEVICE_CLASSES
from torchferry.topology import STORAGE_DTYPES, parse_bytes, parse_rate

__all__ = ["main"]

EXIT_USAGE = 2

_N = TypeVar("_N", int, float)
_T = TypeVar("_T")


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, raised instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parsed(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """An argument type that runs ``parse`` and turns its `ValueError` into the parser's one-line error."""

    def run(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return run


def _size(text: str) -> int:
    value = _parsed(lambda body: parse_bytes(body, bare_bytes=False))(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


_rate = _parsed(parse_rate)


def _positive(kind: Callable[[str], _N], noun: str, bound: str) -> Callable[[str], _N]:
    """An argument type that parses with ``kind`` and refuses anything not above zero."""

    def parse(text: str) -> _N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be {bound}")
        return value

    return parse


_positive_int = _positive(int, "a whole number", "at least 1")
_positive_float = _positive(float, "a number", "positive")


def _device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; write cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the demo runs on cpu or cuda, not {device.type}")
    return text


def _components(text: str) -> frozenset[str]:
    """``dit,text_encoder`` as the selection ``offload(components=...)`` takes; unknown names refused."""
    from torchferry.topology import COMPONENT_NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMPONENT_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r} names {', '.join(map(repr, unknown)) or 'no component'}; "
            f"write some of {', '.join(COMPONENT_NAMES)}, comma-separated"
        )
    return frozenset(names)


def _resolution(text: str) -> object:
    from torchferry.cli._plan_input import parse_resolution

    return _parsed(parse_resolution)(text)


def _parser() -> _Parser:
    parser = _Parser(
        prog="torchferry",
        description="Stream diffusion-model weights between host and device on a planned schedule.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    demo = commands.add_parser(
        "demo",
        help="run the bundled toy pipeline resident and under every strategy, and compare",
        description="Build the toy DiT pipeline (weights from a seed, cached as a safetensors checkpoint), "
        "run it resident and under model-level, layerwise (two depths) and distributed layerwise offload "
        "loading from the checkpoint, and print peak device bytes, time per step, overhead and whether "
        "the outputs are identical. Exits 1 if any output differs.",
    )
    demo.add_argument(
        "--device",
        type=_device,
        metavar="cpu|cuda|cuda:N",
        help="cuda, cuda:N or cpu (default: cuda when present, else cpu)",
    )
    demo.add_argument("--steps", type=_positive_int, default=8, help="denoising steps per call (default 8)")
    demo.add_argument(
        "--calls",
        type=_positive_int,
        default=3,
        help="pipeline calls per strategy; the first warms up (default 3)",
    )
    demo.add_argument(
        "--cache-dir", help="where the checkpoint is kept (default: $TORCHFERRY_CACHE or ~/.cache/torchferry)"
    )
    demo.add_argument("--timeline", metavar="FILE.svg", help="draw the copy/comm/compute streams of one step")
    demo.add_argument(
        "--no-distributed", action="store_true", help="skip the distributed row (it starts 2 gloo processes)"
    )

    plan = commands.add_parser(
        "plan",
        help="will MODEL fit a device, with which strategy, and how much slower",
        description="Plan MODEL (a known id, a hub id such as black-forest-labs/FLUX.1-dev, a diffusers "
        "pipeline folder, a safetensors file, a folder of shards or an *.index.json; headers only) for a "
        "device memory budget: per-component bytes, and for each strategy whether its weights fit, its "
        "simulated peak device bytes of weights, step time and overhead versus all-resident, and the "
        "automatic choice. 'fits' and 'peak device' count weights only: activations and the VAE decode "
        "need room beyond them. With --host-memory, also which packs stay in the checkpoint (the file "
        "tier), each component's host bytes, and the step with those reads.",
    )
    plan.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="known id or hub id (see --list), pipeline folder, or checkpoint path",
    )
    plan.add_argument("--list", action="store_true", help="list the known model ids with their sizes")
    plan.add_argument(
        "--device-memory",
        type=_size,
        metavar="SIZE",
        help="device budget for the weights, with a unit: 24GiB or 80GB (a bare number is refused)",
    )
    plan.add_argument(
        "--host-memory",
        type=_size,
        metavar="SIZE",
        help="host budget for torchferry's host buffers, with a unit: 32GiB (default: no limit; a session's "
        "default is this machine's available memory); what does not fit is read from the checkpoint on "
        "demand (the file tier)",
    )
    plan.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="the device a session runs on (default cuda: file-tier reads go through pinned staging slots; "
        "cpu: its memory is host memory, so the reader fills device slots itself, with no staging slot)",
    )  # fmt: skip
    plan.add_argument(
        "--spill",
        action="store_true",
        help="plan as a session given spill=<a folder>: the file tier of a model with no checkpoint (a known "
        "id) is written there once and read back; without it such a file tier is refused, as offload "
        "refuses it; only with --host-memory",
    )
    plan.add_argument(
        "--read-bandwidth",
        type=_rate,
        metavar="RATE",
        help="how fast the file tier reads the checkpoint (default: the rate `torchferry probe PATH` saved "
        "on this machine, even in a CPU profile whose other figures plan leaves out; else 3.5GB/s, a "
        "PCIe Gen3 NVMe drive); only with --host-memory",
    )
    plan.add_argument(
        "--h2d", type=_rate, metavar="RATE", help="host-to-device bandwidth (default: the device's; 25GB/s)"
    )
    plan.add_argument(
        "--allgather",
        type=_rate,
        metavar="RATE",
        help="bytes per second one rank receives in an all-gather (default: the device's; 100GB/s)",
    )
    plan.add_argument(
        "--device-class",
        choices=sorted(DEVICE_CLASSES),
        help="assume this device class's figures (default: those a session on the device starts from: "
        "the profile `torchferry probe` saved of it here, else its class by --device-name or this machine's "
        "GPU, else an RTX 4090-class GPU with a 100GB/s all-gather)",
    )
    plan.add_argument(
        "--device-name",
        metavar="NAME",
        help="plan for the GPU of this name, as torch.cuda.get_device_name() gives it (\"NVIDIA H100 80GB "
        "HBM3\"): the figures a session on it starts from, its saved profile if `torchferry probe` measured "
        "it here, else its class (default: this machine's GPU)",
    )
    plan.add_argument(
        "--profile",
        metavar="FILE",
        help="a profile written by `torchferry probe` (default: $TORCHFERRY_PROFILE, else "
        "$TORCHFERRY_CACHE/profile.json, else $XDG_CACHE_HOME/torchferry/profile.json, else "
        "~/.cache/torchferry/profile.json, when it exists)",
    )
    plan.add_argument(
        "--forwards-per-step",
        type=_positive_int,
        metavar="N",
        help="DiT forwards per denoising step, 2 for guidance run as two forwards (default: the pipeline's)",
    )
    plan.add_argument(
        "--text-tokens",
        type=_positive_int,
        metavar="N",
        help="text tokens per forward (default: the pipeline's)",
    )
    plan.add_argument(
        "--host-op-us",
        type=_positive_float,
        metavar="US",
        help="host microseconds the runtime spends per op it issues (default 0)",
    )
    plan.add_argument(
        "--strategy",
        choices=["auto", *BUILTINS],
        help="evaluate only this strategy (default: all of them and auto)",
    )
    plan.add_argument(
        "--depth", type=_positive_int, default=1, metavar="N", help="prefetch depth of the ring (default 1)"
    )
    plan.add_argument(
        "--world-size",
        type=_positive_int,
        metavar="N",
        help="ranks sharing the weights under distributed layerwise (default: 2 for its row; "
        "when given, auto considers it)",
    )
    plan.add_argument(
        "--resolution",
        type=_resolution,
        metavar="WxH[xF]",
        help="output size for the compute estimate (default: the pipeline's default)",
    )
    plan.add_argument(
        "--tflops",
        type=_positive_float,
        metavar="TFLOPS",
        help="achieved device TFLOP/s for the compute estimate (default 150)",
    )
    plan.add_argument(
        "--block-ms",
        type=_positive_float,
        metavar="MS",
        help="compute time per block in ms (overrides FLOPs)",
    )
    plan.add_argument(
        "--block-attrs",
        metavar="A,B",
        help="block attributes of a checkpoint, comma-separated (default: guessed from tensor names)",
    )
    plan.add_argument(
        "--storage-dtype",
        choices=STORAGE_DTYPES,
        help="plan the DiTs' Linear/Conv/Embedding weights stored in this dtype and cast around each "
        "forward, as offload(storage_dtype=...) and diffusers' layerwise casting store them "
        "(docs/quantized.md; from headers, which tensors is guessed from names)",
    )
    plan.add_argument(
        "--components",
        type=_components,
        metavar="A,B",
        help="the components to offload, as offload(components=...): dit, text_encoder, vae, comma-separated "
        "(default: what offload selects without components=: the DiTs, the text encoders whose blocks "
        "a known model declares, and under model_level every encoder)",
    )
    plan.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16", "float16"),
        help="for a GGUF model: the dtype its GGUFLinear layers compute in, as "
        "from_single_file(compute_dtype=...) builds it (default float32, diffusers' default); it sizes "
        "the dequantized weight counted beside the weights",
    )
    plan.add_argument("--show-schedule", action="store_true", help="print the recommended steady DiT step")
    plan.add_argument(
        "--format", choices=["text", "json"], default="text", help="output format (default text)"
    )

    probe = commands.add_parser(
        "probe",
        help="measure this machine's pinned host-to-device bandwidth and matmul rate (and, given PATH, "
        "its drive's read rates), and save them",
        description="Time pinned host-to-device copies and square matrix products (bf16 on CUDA, fp32 on "
        "the CPU) on DEVICE and save the figures as a JSON profile, which `torchferry plan` then uses "
        "in place of assumed ones (for GPUs: plan leaves out a CPU profile's device figures unless given "
        "with --profile). Takes a few seconds. With PATH (a *.safetensors checkpoint file or folder, at "
        "least --min-bytes of it), also time reads of it as the file tier reads, buffered and with "
        "O_DIRECT, each after dropping the files from the page cache (posix_fadvise DONTNEED), and save "
        "both rates in the profile, where plan and sessions on this machine take the read rate from.",
    )
    probe.add_argument(
        "path", nargs="?", metavar="PATH", help="a checkpoint file or folder on the drive to measure"
    )
    probe.add_argument(
        "--read-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="read at most this much of PATH per measurement (default 1GiB)",
    )
    probe.add_argument(
        "--min-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="refuse PATH, saving nothing, when it holds fewer *.safetensors bytes than this to time "
        "(default 64MiB: a shorter read times file opening more than the drive)",
    )
    probe.add_argument(
        "--device",
        type=_device,
        metavar="cpu|cuda|cuda:N",
        help="cuda, cuda:N or cpu (default: cuda when present, else cpu)",
    )
    probe.add_argument(
        "--output",
        metavar="FILE",
        help="where to save it (default: $TORCHFERRY_PROFILE, else $TORCHFERRY_CACHE/profile.json, else "
        "$XDG_CACHE_HOME/torchferry/profile.json, else ~/.cache/torchferry/profile.json)",
    )
    probe.add_argument("--no-save", action="store_true", help="print the figures without saving them")
    probe.add_argument(
        "--format", choices=["text", "json"], default="text", help="output format (default text)"
    )
    return parser


def _plan(args: argparse.Namespace) -> int:
    from torchferry.cli import _plan_device, _plan_input, _plan_output, _plan_report

    if args.list:
        if args.format == "json":
            doc = {"torchferry_models": _plan_output.JSON_VERSION, "models": _plan_output.list_document()}
            print(json.dumps(doc, indent=2))
        else:
            sys.stdout.write(_plan_output.format_list())
        return 0
    if args.model is None:
        raise UsageError("plan needs MODEL (a known id, or a checkpoint path), or --list")
    if args.device_memory is None:
        raise UsageError("plan needs --device-memory SIZE, the device budget (e.g. 24GiB)")
    if args.read_bandwidth is not None and args.host_memory is None:
        raise UsageError(
            "--read-bandwidth is the file tier's read rate, and there is no file tier without --host-memory; "
            "pass --host-memory SIZE too"
        )
    if args.spill and args.host_memory is None:
        raise UsageError(
            "--spill is where the file tier is written, and there is no file tier without --host-memory; "
            "pass --host-memory SIZE too"
        )
    if args.block_ms is not None and args.tflops is not None:
        raise UsageError("--block-ms and --tflops are two ways to set compute time; pass one of them")
    attrs_ = (
        None
        if args.block_attrs is None
        else tuple(a.strip() for a in args.block_attrs.split(",") if a.strip())
    )
    named = [f for f, v in (("--device-class", args.device_class), ("--profile", args.profile),
                            ("--device-name", args.device_name)) if v is not None]  # fmt: skip
    if len(named) > 1:
        many = "two" if len(named) == 2 else "three"
        raise UsageError(f"{' and '.join(named)} are {many} sources of device figures; pass one of them")
    start = time.perf_counter()
    topo, known = _plan_input.load_model(args.model, attrs_, compute_dtype=args.compute_dtype)
    if args.profile is not None and not os.path.exists(args.profile):
        raise UsageError(
            f"--profile {args.profile}: no such file; write one with `torchferry probe --output FILE`"
        )
    device, read_note = _plan_device.with_reads(args, _plan_device.device_figures(args))
    options = _plan_report.Options(
        budget_bytes=args.device_memory,
        h2d_bytes_per_s=args.h2d,
        collective_bytes_per_s=args.allgather,
        device=device,
        read_note=read_note,
        forwards_per_step=args.forwards_per_step,
        text_tokens=args.text_tokens,
        host_op_s=(args.host_op_us or 0.0) / 1e6,
        world_size=args.world_size,
        depth=args.depth,
        strategy=args.strategy,
        resolution=args.resolution,
        tflops=args.tflops,
        block_ms=args.block_ms,
        host_bytes=args.host_memory,
        device_type=args.device,
        spill=args.spill,
        read_bytes_per_s=args.read_bandwidth,
        storage_dtype=args.storage_dtype,
        components=args.components,
        **_checkpoint_options(args.model),
    )
    if known is None and (args.resolution is not None or args.tflops is not None):
        raise UsageError(
            "--resolution and --tflops need a known model id, whose block FLOPs are known; "
            "for a checkpoint pass --block-ms"
        )
    result = _plan_report.build_report(args.model, topo, known, options)
    elapsed = time.perf_counter() - start
    if args.format == "json":
        doc = _plan_output.report_document(result, show_schedule=args.show_schedule)
        doc["planning_s"] = round(elapsed, 4)
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write(_plan_output.format_report(result, show_schedule=args.show_schedule))
    return 0


def _checkpoint_options(model: str) -> dict[str, Any]:
    """A model read from files is planned as a session opened from them: with that checkpoint, and the
    facts read of its pipeline (`_plan_input.store_facts`), so the host figures are the session's."""
    from torchferry.cli import _plan_input

    if not os.path.exists(model):
        return {}
    opened = _plan_input.opened_as(model)
    return {"checkpoint": model, "facts": _plan_input.store_facts(model), "opened_as": opened}


def _probe(args: argparse.Namespace) -> int:
    from torchferry.runtime import probe, save_profile

    if args.path is None and (args.read_bytes is not None or args.min_bytes is not None):
        raise UsageError("--read-bytes and --min-bytes size the reads of PATH; name PATH (a checkpoint)")
    reads = {} if args.read_bytes is None else {"read_bytes": args.read_bytes}
    if args.min_bytes is not None:
        reads["read_min_bytes"] = args.min_bytes
    profile = probe(args.device, read_path=args.path, **reads)
    where = None if args.no_save else save_profile(profile, args.output)
    cpu = profile.device == "cpu"
    if cpu:
        why = "--device cpu" if args.device is not None else "no CUDA device is available here"
        measured = f"this machine's CPU ({why}), on {profile.host}"
        used = (
            "sessions on this machine's CPU; `torchferry plan` plans for GPUs and leaves CPU figures "
            "out unless given with --profile FILE"
        )
    else:
        measured = f"{profile.name}, on {profile.host}"
        used = f"sessions on this machine's {profile.name} devices, and `torchferry plan`"
    if args.format == "json":
        doc = {**profile.to_json(), "measured": measured, "used_by": used}
        print(json.dumps({**doc, "saved_to": None if where is None else str(where)}, indent=2))
        return 0
    print(f"measured: {measured}")
    copy = "a host memcpy" if cpu else "pinned"
    print(f"host-to-device ({copy}): {profile.h2d_bytes_per_s / 1e9:.2f} GB/s")
    print(f"matmul ({profile.dtype}): {profile.flops_per_s / 1e12:.2f} TFLOP/s")
    if profile.read_bytes_per_s is not None and profile.read_direct_bytes_per_s is not None:
        print(f"read {args.path} (page cache dropped first):")
        print(f"  buffered: {profile.read_bytes_per_s / 1e9:.2f} GB/s")
        print(f"  direct (O_DIRECT): {profile.read_direct_bytes_per_s / 1e9:.2f} GB/s")
    print(f"used by: {used}")
    print(f"saved to {where}" if where is not None else "not saved (--no-save)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from torchferry.cli import _demo

    return _demo.run(
        device=args.device,
        steps=args.steps,
        calls=args.calls,
        cache_dir=args.cache_dir,
        timeline=args.timeline,
        distributed=not args.no_distributed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if a in ("demo", "plan", "probe")), None)
    prog = f"torchferry {command}" if command else "torchferry"
    try:
        args = parser.parse_args(args_list)
        if args.command == "plan":
            return _plan(args)
        if args.command == "probe":
            return _probe(args)
        return _demo(args)
    except SystemExit as exit_:  # --help and --version print, then exit through argparse
        return exit_.code if isinstance(exit_.code, int) else 0
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as shell tools do
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0
    except (OffloadError, ValueError, OSError) as exc:
        text = exc.message("cli") if isinstance(exc, OffloadError) else str(exc)
        message = "; ".join(line.strip() for line in text.splitlines() if line.strip())
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
