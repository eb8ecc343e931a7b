"""`KeyMap`: which checkpoint key holds each tensor of a model, where the files use other names.

[Note: names in the files and names in the modules]
torchferry reads a checkpoint by the model's own tensor names. Some libraries save a model under
other names and map them back when they load it: transformers 5 writes Qwen2.5-VL's language model
as ``model.layers.*`` and its vision tower as ``visual.*`` while the modules are
``model.language_model.*`` and ``model.visual.*``, Mistral 3 and Gemma 3 as
``language_model.model.*`` while the modules are ``model.language_model.*``; diffusers renames the
attention blocks of old single-file VAEs (``query`` to ``to_q``). A `KeyMap` is that knowledge as
data, one layer between the files and the reader, whatever wrote the files:

- ``prefixes``: model prefix -> checkpoint prefix (the user's ``checkpoint_prefix_map``; the longest
  matching prefix applies);
- ``renames``: exact model name -> checkpoint key (one tensor under another name, bytes unchanged);
  a rename wins over the prefixes;
- ``conversions``: model tensors a library builds from other stored tensors on load (fused or split
  weights, permuted ones): sources, targets, the model class, the operation and the library's own
  function that carries it out; the reader runs it when a pack is filled (or read by the file tier),
  so bytes and tiers are planned on what the module holds, and refuses one it cannot run by name
  (`Conversion.problem`) rather than call its tensors missing.

`KeyMap` is a `Mapping` of its prefixes, so it travels wherever a prefix map does; the runtime's
`CheckpointReader` looks names up through `KeyMap.key`. Builders: `library_key_map` asks the
libraries that wrote the files (transformers' conversion mapping of the model class, diffusers'
own legacy renames) over the checkpoint's keys; another format's reader (GGUF) can build one from
its own name table the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from torchferry.topology._frozen import FrozenMap

__all__ = ["Conversion", "KeyMap"]


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Conversion:
    """Model tensors ``targets`` that ``library``'s loader makes from the stored tensors ``sources``
    (checkpoint keys) with ``operation`` for ``model_class`` (a fused or split weight, say)."""

    library: str
    #: The path of the model from the pipeline root (``"text_encoder"``; ``""``: the whole pipeline).
    component: str
    model_class: str
    operation: str
    sources: tuple[str, ...] = attrs.field(converter=_names)
    targets: tuple[str, ...] = attrs.field(converter=_names)
    #: The library's own conversion: the stored tensors by checkpoint key -> the tensors it makes,
    #: by model name (``None``: it cannot be carried out here, and is refused by name).
    apply: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = attrs.field(
        default=None, eq=False, repr=False
    )

    def problem(self, where: str, why: str = "a conversion torchferry does not carry out") -> str:
        """The sentence a refusal lists for this conversion (``where``: the checkpoint's path; ``why``:
        what went wrong)."""
        shown = ", ".join(repr(s) for s in self.sources[:4]) + (", ..." if len(self.sources) > 4 else "")
        made = ", ".join(repr(t) for t in self.targets[:4]) + (", ..." if len(self.targets) > 4 else "")
        keep = (
            f"torchferry.from_pretrained(..., {self.component}=model), or offload without it in "
            "checkpoint_components"
            if self.component
            else "offload it without checkpoint="
        )
        return (
            f"{where}: {self.library} {self.model_class} makes {made} from the stored {shown} with "
            f"{self.operation} when it loads, {why}; load that model "
            f"with {self.model_class}.from_pretrained and keep its weights ({keep})"
        )


class KeyMap(FrozenMap[str, str]):
    """A checkpoint prefix map (a `Mapping` of model prefix -> checkpoint prefix) with the exact
    ``renames`` (model name -> checkpoint key) and ``conversions`` a library applies on load.

    See [Note: names in the files and names in the modules] at the top of this module.
    """

    __slots__ = ("conversions", "renames")

    def __init__(
        self,
        prefixes: Mapping[str, str] | tuple[tuple[str, str], ...] = (),
        *,
        renames: Mapping[str, str] | tuple[tuple[str, str], ...] = (),
        conversions: Iterable[Conversion] = (),
    ) -> None:
        super().__init__(prefixes)
        #: Exact model tensor name -> the checkpoint key that holds it.
        self.renames: FrozenMap[str, str] = FrozenMap(renames)
        #: Model tensors made from other stored tensors on load (refused by name).
        self.conversions: tuple[Conversion, ...] = tuple(conversions)

    @classmethod
    def of(cls, prefix_map: Mapping[str, str] | None) -> KeyMap:
        """``prefix_map`` as a `KeyMap` (itself when it is one)."""
        return prefix_map if isinstance(prefix_map, KeyMap) else cls(dict(prefix_map or {}))

    def key(self, name: str) -> str:
        """The checkpoint key of model tensor ``name``: its rename, else the longest matching prefix."""
        renamed = self.renames.get(name)
        if renamed is not None:
            return renamed
        best = max((p for p in self if name.startswith(p)), key=len, default=None)
        return name if best is None else self[best] + name[len(best) :]

    def converted(self, name: str) -> Conversion | None:
        """The conversion that makes model tensor ``name`` on load, if any."""
        return next((c for c in self.conversions if name in c.targets), None)

    def with_library(self, renames: Mapping[str, str], conversions: Iterable[Conversion]) -> KeyMap:
        """This map with ``renames`` and ``conversions`` added (earlier renames of a name win)."""
        return KeyMap(
            dict(self),
            renames={**renames, **self.renames},
            conversions=(*self.conversions, *conversions),
        )

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.renames, self.conversions))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyMap):
            same = (self.renames, self.conversions) == (other.renames, other.conversions)
            return same and dict(self) == dict(other)
        return not (self.renames or self.conversions) and super().__eq__(other)

    def __repr__(self) -> str:
        return f"KeyMap({dict(self)!r}, renames={len(self.renames)}, conversions={len(self.conversions)})"
