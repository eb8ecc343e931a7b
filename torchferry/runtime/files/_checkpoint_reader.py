"""`CheckpointReader`: safetensors weights copied by mmap straight into packed host buffers.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and ``data_offsets`` (relative to the end of the header), then the raw bytes. The
reader finds its files with topology's `locate`, opens each once with `open_regular` and checks its
header with `parse_header` on that open file (one locator, one parser and one `HeaderEntry` serve
planning and loading; only the headers are read when it opens), and copies tensor bytes only when
asked, from the same open file, into buffers laid out by `torchferry.topology.pack`. So a file
replaced on disk while the reader is open still yields the tensors its header described.

[Note: why windows of the file are mapped per copy]
Each copy maps a bounded window of the file with Python's `mmap` (``ACCESS_COPY``: a private
mapping, so torch may view it as writable without a warning, while nothing is ever written and no
page is duplicated), views it with `torch.frombuffer`, copies it into the destination with
``Tensor.copy_`` and unmaps it. Pages of a mapping count in the process's resident set while mapped,
so a mapping of the whole file kept open would make a full load peak at twice the checkpoint (the
mapped pages plus the host buffers). With windows of at most `WINDOW_BYTES` the peak is the host
buffers plus one window, the bytes never pass through an intermediate tensor, and the page cache is
still shared by every process reading the same file. `safetensors.safe_open` was not used: its
``get_tensor`` returns views of a whole-file mapping (copies, in older releases), so how much of the
file stays resident is out of the reader's hands. `torch.UntypedStorage.from_file` maps whole
files too.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import BinaryIO, NoReturn

import attrs
import torch

from torchferry._errors import ExecutionError, PlanError
from torchferry.runtime.files._converted import bytes_of, conversion_problems, converted
from torchferry.runtime.files._expected import Expected
from torchferry.runtime.files._expected import expected_specs as _expected_specs
from torchferry.runtime.files._expected import plural as _plural
from torchferry.runtime.files._expected import shape_text as _shape_text
from torchferry.runtime.files._identity import SpanDigests, changed, crc32
from torchferry.runtime.files._spans import FileSpan, Source, merge_runs
from torchferry.topology import SAFETENSORS_DTYPES as _HEADER_DTYPES
from torchferry.topology import (
    FrozenMap,
    HeaderEntry,
    KeyMap,
    TensorSpec,
    locate,
    open_regular,
    parse_header,
    pipeline_sources,
    quantized_names,
    show,
)

__all__ = [
    "MAX_LISTED",
    "SAFETENSORS_DTYPES",
    "WINDOW_BYTES",
    "CheckpointReader",
    "Headers",
]

#: safetensors dtype codes torchferry reads, with the torch dtype name each one holds (topology's table).
SAFETENSORS_DTYPES: FrozenMap[str, str] = FrozenMap(dict(_HEADER_DTYPES))

#: The most bytes of a file mapped at once while copying (see the Note at the top of this module).
WINDOW_BYTES = 16 * 2**20
#: Stored dtypes a tensor the reader may widen (see `CheckpointReader`) is read from, exactly.
WIDENED_FROM = ("float16", "bfloat16")
#: The most problems one `PlanError` lists, one line each; a last line counts the rest.
MAX_LISTED = 20

_RESAVE = "re-save or re-download the file"


@attrs.frozen(kw_only=True)
class Headers:
    """What a reader's `CheckpointReader._headers` found: its files, each pipeline component's name
    prefix, the checked entries, the problems and unreadable files `validate` reports, and the keys
    a problem removed (each with its problem)."""

    files: tuple[str, ...]
    components: tuple[str, ...] = ()
    entries: FrozenMap[str, HeaderEntry]
    problems: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()
    broken: FrozenMap[str, str] = attrs.field(factory=FrozenMap)


class CheckpointReader(contextlib.AbstractContextManager["CheckpointReader"]):
    """Reads a safetensors checkpoint (one file, a folder of shards, or an ``*.index.json``).

    A diffusers pipeline folder (``model_index.json``, one subfolder per component) is read as one
    checkpoint whose tensors are named from the pipeline root (``transformer.blocks.0.…``).

    Opening reads headers only. ``prefix_map`` maps a prefix of the model's qualified names to the
    prefix the checkpoint uses instead (``{"transformer.": ""}`` for a component checkpoint whose keys
    lack the component path); the longest matching prefix applies. A `topology.KeyMap` also names
    the keys a library saved tensors under and the tensors it makes from others on load (made here
    by the library's converter). Every method taking ``prefix_map`` uses the reader's own for ``None``.

    ``variant`` (``"fp16"``) reads a pipeline folder's files of that weight variant (see
    `topology.read_pipeline_folder`). Loading copies bytes and never converts, with one exception:
    the model tensors named in ``widen`` (model names, before ``prefix_map``) may be stored in float16
    or bfloat16 while the model holds them in float32, and are then widened exactly on the way in,
    as diffusers and transformers load the modules a model class keeps in float32
    (``_keep_in_fp32_modules``).

    Problems found in the headers do not raise here: `validate` reports them together with every
    mismatch against the model, in one `PlanError`. Use it as a context manager, or call `close`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix_map: Mapping[str, str] | None = None,
        variant: str | None = None,
        widen: Collection[str] = (),
    ) -> None:
        self.path = os.fspath(path)
        self.prefix_map: KeyMap = KeyMap.of(prefix_map)  # with a library's renames (`topology.KeyMap`)
        #: Model tensor names held in float32 that may be read from a 16-bit float (see above).
        self.widen: frozenset[str] = frozenset(widen)
        self._handles: dict[str, BinaryIO] = {}
        # Why: each file's header as parsed at open (`_reads_as_parsed`).
        self._parsed: dict[str, object] = {}
        #: ``os.fstat`` of each file when its header was read, for `changed` (a rewrite since then).
        self.stats: dict[str, os.stat_result] = {}
        self._closed = False
        try:
            # Why: file names fixed at open (a chdir later)
            found = self._headers(os.path.join(os.getcwd(), self.path), variant)
        except BaseException:
            self.close()
            raise
        self.files: tuple[str, ...] = found.files
        #: The CRC-32 of each file's header and of every span read from it (see `SpanDigests`).
        self.digests = SpanDigests(self.stats)
        for file in self.files:
            ends = [e.data_start for e in found.entries.values() if e.file == file]
            handle = self._handles.get(file)
            if handle is None or not ends or max(ends) <= 0:
                continue
            same = functools.partial(self._reads_as_parsed, file, handle)
            if (problem := self.digests.header(file, handle.fileno(), max(ends), same)) is not None:
                self.close()
                raise ExecutionError(f"{file} {problem}; do not rewrite a checkpoint while it is opened")
            self.stats[file] = os.fstat(handle.fileno())  # as confirmed: a touch while parsing is no change
        #: For a pipeline folder, each component's name prefix (``"transformer."``); else empty.
        self.components: tuple[str, ...] = found.components
        self.entries: FrozenMap[str, HeaderEntry] = FrozenMap(found.entries)
        #: Problems found in the headers (and index), in file order; `validate` reports them.
        self.problems: tuple[str, ...] = found.problems
        #: Files whose header could not be read (their tensors are unknown).
        self.unreadable: tuple[str, ...] = found.unreadable
        self._broken = dict(found.broken)

    #: The header parser of this format (`GGUFCheckpointReader` has its own).
    _parse = staticmethod(parse_header)

    def _reads_as_parsed(self, file: str, handle: BinaryIO) -> bool:
        """Whether ``file``'s header, parsed again, gives the entries it gave at open."""
        try:  # a buffer of its own: the handle's may still hold the bytes parsed at open
            with open(os.dup(handle.fileno()), "rb") as fresh:
                return bool(self._parse(file, fresh) == self._parsed.get(file))
        except PlanError:
            return False

    def _headers(self, path: str, variant: str | None) -> Headers:
        """Open the checkpoint's files (each into ``_handles`` and ``stats``) and read their headers:
        the one place a reader of another format differs (`runtime.GGUFCheckpointReader`). A handle
        opened here is closed by the constructor when this raises."""
        # A diffusers pipeline folder: names under "<component>.".
        folder = pipeline_sources(path, variant)
        if folder is None and variant is not None:
            raise PlanError(
                f"{self.path}: variant={variant!r} picks the files of a diffusers pipeline folder, and this "
                "is not one (no model_index.json); point checkpoint= at the variant's own file instead"
            )
        files: Sequence[str]
        index: Mapping[str, str] | None
        if folder is not None:
            files, index, prefixes = folder
        else:
            sources = locate(path)
            files, index, prefixes = sources.files, sources.weight_map, {}
        entries: dict[str, HeaderEntry] = {}
        problems: list[str] = []
        broken: dict[str, str] = {}
        unreadable: list[str] = []
        for file in files:
            listed = [k for k, f in (index or {}).items() if f == file]
            try:
                handle = open_regular(file)
            except FileNotFoundError:
                problem = (
                    f"{self.path}: lists {_plural(len(listed), 'tensor')} in {file}, which does not "
                    f"exist; restore the file or fix the index"
                )
                problems.append(problem)
                broken.update(dict.fromkeys(listed, problem))
                continue
            except PlanError as exc:
                problem = f"{exc}; {_RESAVE}"
                problems.append(problem)
                unreadable.append(file)
                broken.update(dict.fromkeys(listed, problem))
                continue
            self._handles[file] = handle
            self.stats[file] = os.fstat(handle.fileno())
            try:
                # The header comes from the descriptor the data is later mapped from (no reopen).
                found = self._parsed[file] = parse_header(file, handle)
                # torchao's names for a wrapper's parts are discovery's (topology/_quantized.py).
                found, index = quantized_names(file, handle, found, index, prefixes.get(file, ""))
                if prefixes:
                    found = tuple(attrs.evolve(e, name=prefixes[file] + e.name) for e in found)
            except PlanError as exc:
                problem = f"{exc}; {_RESAVE}"  # a header problem, with the fix for a damaged file
                problems.append(problem)
                unreadable.append(file)
                broken.update(dict.fromkeys(listed, problem))
                continue
            for entry in found:
                if entry.name in entries:
                    problem = (
                        f"{self.path}: tensor {show(entry.name)} appears in both "
                        f"{entries[entry.name].file} and {file}; keep one copy"
                    )
                    problems.append(problem)
                    broken[entry.name] = problem
                else:
                    entries[entry.name] = entry
        for key, file in (index or {}).items():
            if key in broken or file not in self._handles:
                continue
            actual = entries.get(key)
            if actual is None or actual.file != file:
                where = "that file's header lacks it" if actual is None else f"it is in {actual.file}"
                problem = f"{self.path}: says tensor {show(key)} is in {file}, but {where}; fix the index"
                problems.append(problem)
                broken[key] = problem
        for key in broken:
            entries.pop(key, None)
        return Headers(
            files=tuple(files),
            components=tuple(dict.fromkeys(prefixes.values())),
            entries=FrozenMap(entries),
            problems=tuple(problems),
            unreadable=tuple(unreadable),
            broken=FrozenMap(broken),
        )

    # -- names ---------------------------------------------------------------------------------------

    def key(self, name: str, prefix_map: Mapping[str, str] | None = None) -> str:
        """The checkpoint key a model tensor name maps to (longest matching prefix of the map)."""
        return (self.prefix_map if prefix_map is None else KeyMap.of(prefix_map)).key(name)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    # -- checks --------------------------------------------------------------------------------------

    def _spec_problems(
        self,
        spec: TensorSpec,
        prefix_map: Mapping[str, str] | None,
        claimed: set[str] | None = None,
        unknown: list[str] | None = None,
    ) -> tuple[HeaderEntry | None, list[str]]:
        """The entry that serves ``spec`` (owner name first, then aliases) and any mismatch found.

        A tensor not found while some file's header is unreadable goes to ``unknown`` (see
        `_unknown`), so a damaged file is one problem rather than one per tensor.
        """
        keys = [self.key(n, prefix_map) for n in (spec.name, *spec.aliases)]
        if claimed is not None:
            claimed.update(keys)
        if (made := conversion_problems(self, spec, prefix_map, claimed)) is not None:
            return None, made  # a library makes it from other stored tensors: checked, or refused by name
        present = [self.entries[k] for k in keys if k in self.entries]
        if not present:
            broken = [self._broken[k] for k in keys if k in self._broken]
            if broken:
                return None, broken[:1] if claimed is None else []
            looked = "" if keys[0] == spec.name else f" (looked up as {keys[0]!r})"
            also = f" or any of its aliases {list(spec.aliases)}" if spec.aliases else ""
            if self.unreadable:
                if unknown is None:
                    return None, self._unknown([f"{spec.name!r}{looked}{also}"])
                unknown.append(f"{spec.name!r}{looked}{also}")
                return None, []
            return None, [
                f"{self.path}: tensor {spec.name!r}{looked}{also} is missing; add it to the checkpoint or "
                f"map its name with prefix_map"
            ]
        problems: list[str] = []
        for entry in present:
            if entry.shape != spec.shape:
                problems.append(
                    f"{entry.file}: tensor {show(entry.name)}: shape {_shape_text(entry.shape)} but the "
                    f"model expects {_shape_text(spec.shape)} for {spec.name!r}; this checkpoint is for "
                    f"another model configuration"
                )
            dtype = spec.compute_dtype or spec.dtype  # a tensor stored in another dtype is converted
            if entry.dtype != dtype and not self._widens(spec.name, entry.dtype, dtype):
                problems.append(
                    f"{entry.file}: tensor {show(entry.name)}: dtype {entry.dtype} but the model expects "
                    f"{dtype} for {spec.name!r}; convert the checkpoint (loading copies bytes and "
                    f"never converts dtypes)"
                )
        return present[0], problems

    def _unknown(self, names: list[str]) -> list[str]:
        """One problem for every expected tensor not found in the files whose headers were readable."""
        if not names:
            return []
        files = ", ".join(self.unreadable)
        if len(names) == 1:
            what, it = f"tensor {names[0]} is", "it"
        else:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            what, it = f"{len(names)} expected tensors ({shown}) are", "they"
        return [
            f"{self.path}: {what} in none of the readable files; {it} may be in {files}, whose header "
            "could not be read (see above)"
        ]

    def _fail(self, problems: list[str], extra: Sequence[str] = ()) -> NoReturn:
        """Raise the `PlanError` listing ``problems``, then the ``extra`` checkpoint keys the model
        does not expect, at most `MAX_LISTED` lines in all (a count says how many more there are)."""
        problems = list(dict.fromkeys(problems))  # one problem can concern several tensors
        total = len(problems) + len(extra)
        shown = problems[:MAX_LISTED]
        for k in extra[: MAX_LISTED - len(shown)]:
            shown.append(
                f"{self.entries[k].file}: tensor {k!r} is not expected by the model; remove it, map the "
                "model's names with prefix_map, or pass allow_extra=True"
            )
        lines = "\n".join(f"  - {p}" for p in shown)
        if total > len(shown):
            unexpected = len(extra) - max(0, len(shown) - len(problems))
            more = f"{total - len(shown)} more"
            if unexpected:
                more += f", {unexpected} of them tensors the model does not expect"
            lines += f"\n  - ... and {more}"
        raise PlanError(
            f"checkpoint {self.path} cannot fill the expected tensors; "
            f"{_plural(total, 'problem')} (nothing was read or changed):\n{lines}"
        )

    def validate(
        self,
        expected: Expected,
        prefix_map: Mapping[str, str] | None = None,
        *,
        allow_extra: bool = False,
        skip: tuple[str, ...] = (),
    ) -> None:
        """Raise one `PlanError` listing every way the checkpoint fails to hold ``expected``.

        ``expected`` is a plan or topology (every tensor of the pipeline), a component, a block, or
        tensor specs. Non-persistent buffers are not expected; a tied tensor is found under its owner
        name or any alias and counts once. Header problems of every opened file are reported first,
        then missing tensors and shape or dtype mismatches in model order, then (unless
        ``allow_extra``) checkpoint tensors the model does not expect, sorted, but for those under a
        model name prefix in ``skip`` (components filled from the module instead).
        """
        self._check_open()
        problems = list(self.problems)
        claimed: set[str] = set()
        unknown: list[str] = []
        for spec in _expected_specs(expected):
            problems.extend(self._spec_problems(spec, prefix_map, claimed, unknown)[1])
        problems.extend(self._unknown(unknown))
        if not allow_extra:
            # A pipeline folder's component the pipeline does not hold at all (loaded with vae=None) is
            # not extra: its subfolder is simply not used.
            used = tuple(c for c in self.components if any(k.startswith(c) for k in claimed))
            skipped = tuple(self.key(p, prefix_map) for p in skip)
            extra = sorted(
                k
                for k in set(self.entries) - claimed
                if (not self.components or k.startswith(used)) and not k.startswith(skipped)
            )
        else:
            extra = []
        if problems or extra:
            self._fail(problems, extra)

    # -- reads ---------------------------------------------------------------------------------------

    def read_into(
        self,
        layout: Iterable[tuple[TensorSpec, int]],
        out: torch.Tensor,
        start: int = 0,
        end: int | None = None,
        *,
        prefix_map: Mapping[str, str] | None = None,
    ) -> None:
        """Fill ``out`` with bytes ``[start, end)`` of the flat buffer ``layout`` describes.

        ``layout`` is ``topology.pack(tensors)`` (or ``block.layout``): each tensor with its byte
        offset. ``end`` defaults to the buffer's length and may run past it (a rank's zero-padded
        shard): bytes no tensor covers are zeros. The bytes of a non-persistent buffer (absent from
        checkpoints by definition) are left as they are, for the caller to fill from the module, and
        so are those of a tensor stored in another dtype than the file's (``compute_dtype`` set), for
        the caller to convert.
        ``out`` is a contiguous CPU ``uint8`` tensor of exactly ``end - start`` bytes. Every tensor
        the range touches is checked against the checkpoint first; on any mismatch a `PlanError`
        lists them all and ``out`` is untouched.
        """
        self._check_open()
        placed = list(layout)
        total = max((off + spec.nbytes for spec, off in placed), default=0)
        end = total if end is None else end
        if not 0 <= start <= end:
            raise ExecutionError(f"read_into: [{start}, {end}) is not a byte range; need 0 <= start <= end")
        if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
            raise ExecutionError(
                f"read_into: out must be a contiguous CPU uint8 tensor, got {out.dtype} on {out.device}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}"
            )
        if out.numel() != end - start:
            raise ExecutionError(
                f"read_into: out holds {out.numel()} bytes but the range [{start}, {end}) is {end - start}"
            )
        segments: list[tuple[Source, int, int, int]] = [
            (s.file if s.source is None else s.source, s.src, s.dst, s.length)
            for s in self.spans(placed, start, end, prefix_map)
        ]
        flat = out.view(-1)
        cursor = 0
        for file, src, dst, length in merge_runs(segments):
            if dst > cursor:
                flat[cursor:dst].zero_()
            if isinstance(file, torch.Tensor):
                flat[dst : dst + length].copy_(file[src : src + length])
            elif file is not None:
                self._copy(file, src, flat[dst : dst + length])
            cursor = dst + length
        if cursor < flat.numel():
            flat[cursor:].zero_()

    def spans(
        self,
        layout: Iterable[tuple[TensorSpec, int]],
        start: int,
        end: int,
        prefix_map: Mapping[str, str] | None = None,
    ) -> list[FileSpan]:
        """Where each tensor's bytes within ``[start, end)`` of the flat buffer ``layout`` describes
        are in the files, in buffer order (destination offsets relative to ``start``).

        A non-persistent buffer's span has ``file=None`` (its bytes come from the module), as has a
        tensor stored in another dtype than the checkpoint's (``compute_dtype``: the caller converts
        it). Every tensor the range touches is checked against the checkpoint first; any mismatch is
        one `PlanError` listing them all.
        """
        problems: list[str] = []
        unknown: list[str] = []
        found: list[FileSpan] = []
        for spec, off in sorted(layout, key=lambda p: p[1]):
            lo, hi = max(off, start), min(off + spec.nbytes, end)
            if lo >= hi:
                continue
            if spec.buffer and not spec.persistent:
                found.append(FileSpan(name=spec.name, file=None, src=0, dst=lo - start, length=hi - lo))
                continue
            entry, wrong = self._spec_problems(spec, prefix_map, None, unknown)
            problems.extend(wrong)
            if spec.compute_dtype is not None:  # stored in another dtype: the caller converts it
                found.append(FileSpan(name=spec.name, file=None, src=0, dst=lo - start, length=hi - lo))
            elif entry is not None and not wrong and entry.dtype != spec.dtype:  # widened to float32
                widened = self._widened(entry)
                span = FileSpan(name=spec.name, file=None, src=lo - off, dst=lo - start, length=hi - lo)
                found.append(attrs.evolve(span, source=widened))
            elif entry is None and not wrong and (made := converted(self, spec.name, prefix_map)) is not None:
                found.append(FileSpan(spec.name, None, lo - off, lo - start, hi - lo, bytes_of(made)))
            elif entry is not None and not wrong:
                src = entry.data_start + entry.begin + lo - off
                span = FileSpan(name=spec.name, file=entry.file, src=src, dst=lo - start, length=hi - lo)
                found.append(span)
        problems.extend(self._unknown(unknown))
        if problems:
            self._fail(problems)
        return found

    def read_tensor(self, name: str, *, prefix_map: Mapping[str, str] | None = None) -> torch.Tensor:
        """A new CPU tensor holding the checkpoint's ``name`` (a model name, mapped by ``prefix_map``)."""
        self._check_open()
        key = self.key(name, prefix_map)
        entry = self.entries.get(key)
        if entry is None and (value := converted(self, name, prefix_map)) is not None:
            return value
        if entry is None:
            problem = self._broken.get(key) or (
                f"{self.path}: tensor {name!r}"
                f"{'' if key == name else f' (looked up as {key!r})'} is missing; add it to the "
                f"checkpoint or map its name with prefix_map"
            )
            self._fail([problem])
        if self._widens(name, entry.dtype, "float32"):
            return self._widened(entry).view(torch.float32).view(entry.shape)
        return self._stored(entry)

    def widens(self, name: str, stored: str) -> bool:
        """Whether model tensor ``name``, stored as ``stored``, is read widened to float32."""
        return self._widens(name, stored, "float32")

    def _widens(self, name: str, stored: str, wanted: str) -> bool:
        """Whether model tensor ``name`` stored as ``stored`` is read widened to ``wanted``."""
        return name in self.widen and wanted == "float32" and stored in WIDENED_FROM

    def _widened(self, entry: HeaderEntry) -> torch.Tensor:
        """The bytes of ``entry`` widened to float32 (exact: every 16-bit float is a float32)."""
        return self._stored(entry).to(torch.float32).reshape(-1).view(torch.uint8)

    def _stored(self, entry: HeaderEntry) -> torch.Tensor:
        """A new CPU tensor of ``entry`` as the file stores it."""
        tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        if entry.nbytes:
            self._copy(entry.file, entry.data_start + entry.begin, tensor.reshape(-1).view(torch.uint8))
        return tensor

    def _copy(self, file: str, src: int, dst: torch.Tensor) -> None:
        """Copy ``dst.numel()`` bytes at file offset ``src`` into ``dst``, one mapped window at a time."""
        handle = self._handles[file]
        fd = handle.fileno()
        length = dst.numel()
        pos = 0
        while pos < length:
            n = min(length - pos, WINDOW_BYTES)
            at = src + pos
            base = at - at % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fd, at - base + n, offset=base, access=mmap.ACCESS_COPY) as window:
                if hasattr(window, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                    window.madvise(mmap.MADV_WILLNEED)
                view = torch.frombuffer(window, dtype=torch.uint8, count=n, offset=at - base)
                dst[pos : pos + n].copy_(view)
                del view  # releases the buffer export so the window can be unmapped
            pos += n
        # Why: the bytes are checked after the copy (see [Note: the file's identity and the span digests]).
        now = os.fstat(fd)
        if self.digests.watching:
            change = changed(self.stats[file], now, mtime=False) or self.digests.confirm(
                file, fd, src, length, now=now, digest=lambda: crc32([dst.numpy().data])
            )
        else:  # read once, at open, with no file tier after it: any visible change is refused
            change = changed(self.stats[file], now)
        if change is not None:
            raise ExecutionError(
                f"{file} {change} since it was opened, so bytes [{src}, {src + length}) cannot be read as "
                "its header said; do not rewrite a checkpoint while it is being read, and open it again"
            )

    def descriptor(self, file: str) -> int:
        """The open descriptor of ``file`` (one of `files`), the one its header was read from."""
        self._check_open()
        handle = self._handles.get(file)
        if handle is None:
            raise ExecutionError(f"checkpoint reader for {self.path}: {file} is not one of its open files")
        return handle.fileno()

    # -- lifetime ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutionError(f"checkpoint reader for {self.path} is closed; open a new CheckpointReader")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every file; idempotent."""
        self._closed = True
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.entries)} tensors in {len(self.files)} files"
        return f"CheckpointReader({self.path!r}, {state})"
