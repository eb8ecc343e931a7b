"""Refusals of the host planner as data: each carries its figures, and words them for the Python API
(``host_memory=``, the plan's digest) or for `torchferry plan`'s command line (``--host-memory``).

The command line reads the fields, never the API's sentence, so no wording can fall through.
"""

from __future__ import annotations

from torchferry._errors import Part, PlanError, Words
from torchferry._errors import said as rendered
from torchferry.policies._tokens import format_bytes
from torchferry.topology import parse_bytes

__all__ = ["HostBudgetTooSmall", "Words", "size_at_least"]


def _b(nbytes: int) -> str:
    return format_bytes(nbytes, exact=False)


def size_at_least(nbytes: int) -> str:
    """The shortest ``23.8 MiB`` (one decimal, binary unit) that reads as ``nbytes`` or more: a figure
    a remedy can name that opens whatever budget it rounds (exact bytes when no unit reads so)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes < size:
            continue
        tenths = -(-nbytes * 10 // size)
        while parse_bytes(f"{tenths / 10:.1f}{unit}") < nbytes:  # round() of the parse may fall short
            tenths += 1
        return f"{tenths / 10:.1f} {unit}"
    return f"{nbytes} B"


class HostBudgetTooSmall(PlanError):
    """A host budget too small for a plan however its packs are tiered, with the smallest that opens.

    ``minimum`` is the smallest budget that opens (that budget opens, one byte less is refused);
    ``file_tier`` whether that least is with packs in the file tier (else every pack in host memory);
    ``store``, ``slots`` x ``largest``, ``bounce``, ``kept`` (kept, widened and scratch buffers) and
    ``transient`` (the open's copy of one pack) make it up, with ``device`` (the least of a device
    whose memory is host memory, sharing the one budget; 0: none). ``holder``/``biggest``/``biggest_bytes``
    name a component kept whole whose pack is the largest (streaming its blocks would help), and
    ``select`` the selection that streams it when the request's does not (``("dit", "text_encoder")``);
    ``unfiled`` says which packs cannot be in the file tier and why: those of components that keep their
    own weights (``own``) and those held in ``storage_dtype=`` (``cast``). ``source`` says where the
    budget came from.
    """

    def __init__(
        self,
        *,
        budget: int,
        minimum: int,
        file_tier: bool,
        store: int,
        slots: int,
        largest: int,
        bounce: int,
        kept: int = 0,
        transient: int = 0,
        digest: str = "",
        holder: str | None = None,
        select: tuple[str, ...] = (),
        biggest: str = "",
        biggest_bytes: int = 0,
        unfiled: tuple[Part, ...] = (),
        own: tuple[str, ...] = (),
        cast: bool = False,
        source: str = "config.host_memory_bytes",
        device: int = 0,
    ) -> None:
        self.budget = budget
        self.minimum = minimum
        self.file_tier = file_tier
        self.store = store
        self.slots = slots
        self.largest = largest
        self.bounce = bounce
        self.kept = kept
        self.transient = transient
        self.digest = digest
        self.holder = holder
        self.select = select
        self.biggest = biggest
        self.biggest_bytes = biggest_bytes
        self.unfiled = unfiled
        self.own = own
        self.cast = cast
        self.source = source
        self.device = device
        super().__init__(self.message("api"))

    def with_source(self, source: str) -> HostBudgetTooSmall:
        """This refusal naming ``source`` as where the budget came from."""
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        fields["source"] = source
        return HostBudgetTooSmall(**fields)

    def with_device(self, one: int, device: int, source: str) -> HostBudgetTooSmall:
        """This refusal of a host share as the refusal of ``one`` budget a device whose memory is host
        memory shares (its ``device`` bytes beside the host's): the least that opens is the host's
        least and the device's together."""
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        fields.update(budget=one, minimum=self.minimum + device, device=device, source=source)
        return HostBudgetTooSmall(**fields)

    def _parts(self) -> str:
        parts = []
        if self.file_tier:
            if self.slots:
                parts.append(f"{self.slots} staging slots of {_b(self.largest)}, the largest pack read")
            else:  # the reader fills the device's slots itself: nothing staged in host memory
                parts.append(f"no staging slot (packs of up to {_b(self.largest)} read into device memory)")
            parts.append(f"{_b(self.bounce)} of read buffers")
        parts.append(f"{_b(self.store)} of packs in host memory")
        if self.kept:
            parts.append(f"{_b(self.kept)} of kept, widened and scratch buffers")
        if self.transient:
            parts.append(f"{_b(self.transient)} while the store copies the pipeline's own weights in")
        if self.device:
            parts.append(f"{_b(self.device)} for the device, whose memory is host memory, at its least")
        return "; ".join(parts)

    def body(self) -> str:
        """What the plan needs, in words both the API and the command line use."""
        whose = "its host buffers and the device need" if self.device else "its host buffers need"
        if self.file_tier:
            return (
                f"even with packs read from the checkpoint (the file tier) {whose} "
                f"{_b(self.minimum)} ({self._parts()})"
            )
        said = f"with every pack in host memory {whose} {_b(self.minimum)} ({self._parts()})"
        if not self.unfiled:
            said += ", and the file tier would need more (" + (
                "staging slots as large as the largest pack read)" if self.slots else "read buffers)"
            )
        return said

    def _holder(self) -> str:
        """The component kept whole, by name (a single model's root has none)."""
        return repr(self.holder) if self.holder else "the model"

    def _streamed(self, words: Words) -> str:
        """The request that streams the holder's blocks: the strategy, and its selection when needed."""
        if words == "api":
            chosen = "strategy='layerwise'"
            picked = ", ".join(repr(s) for s in self.select)
            return f"{chosen}, components={{{picked}}}" if self.select else chosen
        chosen = "--strategy layerwise"
        return f"{chosen} --components {','.join(self.select)}" if self.select else chosen

    def _unfiled(self, words: Words) -> str:
        return f", and {rendered(self.unfiled, words)}" if self.unfiled else ""

    def _other_remedies(self, words: Words) -> str:
        said = ""
        if self.own:
            tops = " and ".join(map(repr, self.own))
            it = "it" if len(self.own) == 1 else "them"
            said += (
                f", or fill {tops} from the checkpoint (name {it} in checkpoint_components=, or do not pass "
                f"{it} by keyword)"
            )
        if self.cast:
            said += ", or drop storage_dtype=" if words == "api" else ", or drop --storage-dtype"
        return said

    def message(self, words: Words = "api") -> str:
        """The refusal in the API's words (``host_memory=``) or the command line's (``--host-memory``)."""
        least = size_at_least(self.minimum)
        if words == "api":
            said = (
                f"host budget {_b(self.budget)} ({self.source}) is too small for plan {self.digest}: "
                f"{self.body()}{self._unfiled(words)}; raise host_memory= to {least}"
                f"{self._other_remedies(words)}"
            )
            if self.holder is not None:
                said += (
                    f", or stream the blocks of {self._holder()} ({self._streamed(words)}) so "
                    f"the largest pack read is a block, not {self.biggest} ({_b(self.biggest_bytes)})"
                )
            return said
        said = (
            f"--host-memory {_b(self.budget)} is too small for this plan: {self.body()}"
            f"{self._unfiled(words)}; "
            f"pass --host-memory {least.replace(' ', '')} or more{self._other_remedies(words)}"
        )
        if self.holder is not None:
            if not self.file_tier or self.largest == self.biggest_bytes:
                said += (
                    f", or stream the blocks of {self._holder()} ({self._streamed(words)}) so the largest "
                    f"pack read is a block, not {self.biggest} ({_b(self.biggest_bytes)})"
                )
            else:  # too large to read through the staging slots, so held in host memory
                said += (
                    f", or stream the blocks of {self._holder()} ({self._streamed(words)}), so that "
                    f"{self.biggest} ({_b(self.biggest_bytes)}), kept whole in host memory here, can be "
                    "read from the checkpoint a block at a time"
                )
        return said
