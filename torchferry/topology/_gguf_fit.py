"""`check_gguf_fits`: whether a GGUF file fills the model its configuration builds, tensor by tensor.

A GGUF file carries no configuration, so a configuration given beside it can disagree with it: a
``ffn_dim`` of 512 for a file whose feed-forward weights have 256 rows, 16 layers for a file of 12
blocks, a Wan configuration for a FLUX file. diffusers' GGUF load then fails on the shapes; building
``GGUFLinear(out_features=512)`` around 256 rows of bytes would run and return wrong numbers. This
one pure check, over the file's logical shapes (under the model's names) and the shapes of the model
built from the configuration, is what ``torchferry.from_single_file`` and ``torchferry plan`` both
refuse by, before anything is read.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from torchferry._errors import Flag, PlanError
from torchferry.topology._gguf import GGUFEntry
from torchferry.topology._gguf_layouts import GIVE_CONFIG, infer_gguf_model

__all__ = ["GGUF_CONFIG_FIX", "check_gguf_counts", "check_gguf_fits"]

#: What to do about a configuration the file does not fill, in the API's words (``config=``) and the
#: command line's (the ``config.json`` beside the file).
GGUF_CONFIG_FIX = Flag(
    "pass config= the configuration the file was made from, or leave config= out to infer it from the file",
    "put the config.json of the model the file was made from beside it, or remove it to infer the "
    "configuration from the file",
)
#: At most this many problems are listed; a count says how many more there are.
_LISTED = 12
_NUMBERED = re.compile(r"^(.+?)\.(\d+)\.")

Shapes = Mapping[str, tuple[int, ...]]


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _fields(config: Mapping[str, Any], value: int) -> list[str]:
    """The integer fields of ``config`` equal to ``value``, else the pairs whose product is (heads x
    head width), else none."""
    ints = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    found = [k for k, v in ints.items() if v == value]
    if found:
        return found
    heads = {k: v for k, v in ints.items() if "head" in k}  # the width is heads x head width
    return [f"{a} x {b}" for (a, va), (b, vb) in itertools.combinations(heads.items(), 2) if va * vb == value]


def _blame(config: Mapping[str, Any], expected: int, actual: int, *, count: bool = False) -> str:
    """`` (config field ffn_dim gives 512; the file has 256)``, or ``""`` when no field gives it. For a
    block ``count``, fields named for layers or blocks are preferred."""
    fields = _fields(config, expected)
    if count:
        fields = [f for f in fields if "layer" in f or "block" in f] or fields
    if not fields:
        return ""
    named = " or ".join(fields)
    return f" (config field {named} gives {expected}; the file has {actual})"


def _blocks(names: Shapes | list[str]) -> dict[str, set[int]]:
    """Each numbered list (``blocks``) and the indices under it."""
    found: dict[str, set[int]] = {}
    for name in names:
        match = _NUMBERED.match(name)
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    return found


def _whole_blocks(
    problems: list[str],
    found: Shapes,
    expected: Shapes,
    config: Mapping[str, Any],
    class_name: str,
    *,
    extra: bool,
) -> set[str]:
    """Append one problem per numbered list with whole blocks the model has and the file lacks (or,
    if ``extra``, the file has and the model lacks), named as a range with the config field that
    gives the model's count; returns the names of those blocks' tensors."""
    have, want = (expected, found) if extra else (found, expected)
    held, wanted = _blocks(have), _blocks(want)
    whole: set[str] = set()
    for prefix, indices in wanted.items():
        lacking = sorted(indices - held.get(prefix, set()))
        names = [n for n in want if n.startswith(tuple(f"{prefix}.{i}." for i in lacking))]
        if not lacking or any(n in have for n in names):
            continue  # none lacking, or partly there: named tensor by tensor
        whole.update(names)
        span = f"{prefix}.{lacking[0]}" + (f" to {prefix}.{lacking[-1]}" if len(lacking) > 1 else "")
        span += f" ({len(lacking)} block{'s' if len(lacking) > 1 else ''})"
        count = len(held.get(prefix, ()))
        are = "are" if len(lacking) > 1 else "is"
        if extra:
            verb = "have" if len(lacking) > 1 else "has"
            said = f"{span} of the file {verb} no place in {class_name}, which has {count} of {prefix}"
            problems.append(said + _blame(config, count, len(indices), count=True))
        else:
            said = f"{span} {are} not in the file, which holds {count} of {prefix}"
            problems.append(said + _blame(config, len(indices), count, count=True))
    return whole


def check_gguf_counts(
    file: str, class_name: str, entries: Iterable[GGUFEntry], config: Mapping[str, Any]
) -> None:
    """Raise a `PlanError` when the GGUF ``file`` (its header ``entries``) is recognisably of another
    class than ``class_name`` (`infer_gguf_model`), or when a count field of ``config`` (one named for
    layers or blocks) asks for more blocks than any numbered list of the file holds.

    Checked before the model is built: `check_gguf_fits` would refuse such a configuration too, but
    only after building it, and ``"num_layers": 1e9`` builds a billion blocks first (on meta, for
    hours). The file fixes the count; a configuration asking for more is refused by its field.
    """
    found = list(entries)
    head = f"{file} does not fill the {class_name} its configuration builds (nothing was built or read): "
    try:
        inferred = infer_gguf_model(file, found)
    except PlanError:
        inferred = None  # no layout torchferry knows: the counts below, and check_gguf_fits, decide
    if inferred is not None and inferred.class_name != class_name:
        raise PlanError.worded(
            f"{head}it holds none of its tensors: they are named as {inferred.layout} files are\n",
            GGUF_CONFIG_FIX,
        )
    held = {prefix: len(indices) for prefix, indices in _blocks([e.name for e in found]).items()}
    most = max(held.values(), default=0)
    fields = {
        k: v
        for k, v in config.items()
        if ("layer" in k or "block" in k) and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    over = [f"config field {k} gives {v!r}" for k, v in fields.items() if not v <= most]  # NaN too
    if not over:
        return
    if held:
        widest = max(held, key=lambda p: held[p])
        holds = f"the file's longest numbered list, {widest}, holds {most}"
    else:
        holds = "the file holds no numbered blocks"
    raise PlanError.worded(
        f"{head}{' and '.join(over)} blocks, and {holds}\n",
        GGUF_CONFIG_FIX,
    )


def check_gguf_fits(
    file: str,
    class_name: str,
    found: Shapes,
    expected: Shapes,
    config: Mapping[str, Any],
    *,
    inferred: str | None = None,
) -> None:
    """Raise a `PlanError` listing every way the GGUF ``file`` does not fill the model.

    ``found`` is each of the file's tensors under the model's name with its logical shape (a
    quantized tensor's values, not its bytes); ``expected`` each tensor of ``class_name`` built from
    ``config``. A shape that differs names the tensor, both shapes and the config field that gives
    the model's figure where one does; blocks the configuration has and the file lacks are named as a
    range with the count field; a file holding none of the model's tensors says so once; the file's
    tensors the model has no place for are named too (the session's checkpoint check refuses them).
    ``inferred`` names the layout the configuration was inferred by (`infer_gguf_model`), if it was.
    """
    problems: list[str] = []
    present = [n for n in expected if n in found]
    if not present:
        theirs = ", ".join(repr(n) for n in list(found)[:3])
        ours = ", ".join(repr(n) for n in list(expected)[:3])
        problems.append(
            f"it holds none of the {len(expected)} tensors of {class_name} (the file's are named like "
            f"{theirs}; the model's like {ours}): it is a checkpoint of another model"
        )
    else:
        whole = _whole_blocks(problems, found, expected, config, class_name, extra=False)
        whole |= _whole_blocks(problems, found, expected, config, class_name, extra=True)
        for name in expected:
            if name in whole:
                continue
            if name not in found:
                problems.append(f"tensor {name!r} of {class_name} is not in the file")
                continue
            theirs_shape, ours_shape = tuple(found[name]), tuple(expected[name])
            if theirs_shape == ours_shape:
                continue
            blame = ""
            if len(theirs_shape) == len(ours_shape):
                differ = [(e, a) for e, a in zip(ours_shape, theirs_shape, strict=True) if e != a]
                blame = _blame(config, *differ[0])
            problems.append(
                f"tensor {name!r}: the file's shape is {_shape(theirs_shape)}, the configuration's "
                f"{_shape(ours_shape)}{blame}"
            )
        problems.extend(
            f"tensor {name!r} of the file has no place in {class_name}"
            for name in found
            if name not in expected and name not in whole
        )
    if not problems:
        return
    shown = problems[:_LISTED]
    if len(problems) > _LISTED:
        shown.append(f"... and {len(problems) - _LISTED} more")
    listing = "".join(f"\n  - {p}" for p in shown)
    problems_text = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}; nothing was read"
    if inferred is not None:
        raise PlanError.worded(
            f"{file} does not fill the {class_name} configuration inferred from its tensors ({inferred}) "
            f"({problems_text}):{listing}\n",
            GIVE_CONFIG,
        )
    raise PlanError.worded(
        f"{file} does not fill the {class_name} its configuration builds ({problems_text}):{listing}\n",
        GGUF_CONFIG_FIX,
    )
