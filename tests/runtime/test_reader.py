"""The file tier's reader: packs read by preadv (buffered and O_DIRECT) equal the host store's fill,
shards read only their bytes, and every way a file can fail is an ExecutionError naming it."""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchferry import topology
from torchferry._errors import ExecutionError, PlanError
from torchferry.policies import READ_BOUNCE_BYTES
from torchferry.runtime.files._checkpoint_reader import CheckpointReader
from torchferry.runtime.files._reader import BUFFERED_CHUNK_BYTES, CHUNK_BYTES, FileReader, PackRead
from torchferry.runtime.store._fill import group_specs, pack_layout, read_pack
from torchferry.testing import toy
from torchferry.topology import TensorSpec
from torchferry.topology import pack as pack_specs


@pytest.fixture
def toy_checkpoint(tmp_path: Path) -> tuple[toy.ToyPipeline, Path]:
    pipe = toy.build(3)
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(pipe, path)
    return pipe, path


def _specs(pipe: toy.ToyPipeline) -> dict[str, list[TensorSpec]]:
    plan = topology.resolve(topology.discover(pipe), topology.OffloadConfig(strategy="layerwise"))
    return group_specs(plan)


def _live(pipe: toy.ToyPipeline, specs: list[TensorSpec]) -> list[torch.Tensor | None]:
    return [topology.find_attr(pipe, s.name) for s in specs]


def _module_bytes(specs: list[TensorSpec], live: list[torch.Tensor | None], pieces: tuple) -> dict:  # type: ignore[type-arg]
    order = {s.name: t for s, t in zip(specs, live, strict=True)}
    return {
        spec.name: piece.arranged(order[spec.name].detach())  # type: ignore[union-attr]
        for (spec, _), piece in zip(pack_specs(specs), pieces, strict=True)
        if spec.buffer and not spec.persistent
    }


def _read(reader: FileReader, pipe: toy.ToyPipeline, name: str, span: tuple[int, int] | None = None) -> tuple:  # type: ignore[type-arg]
    specs = _specs(pipe)[name]
    live = _live(pipe, specs)
    pieces, _nbytes = pack_layout(specs, live)
    layout = pack_specs(specs)
    extra = _module_bytes(specs, live, pieces)
    read = reader.plan(name, layout=layout, pieces=pieces, span=span, module_bytes=extra)
    out = torch.full((read.nbytes,), 0xAB, dtype=torch.uint8)
    reader.submit(read, out).wait()
    want = torch.zeros(read.nbytes, dtype=torch.uint8)
    read_pack(reader.checkpoint, specs, pieces, live, span, host=want)
    return read, out, want, pieces, layout


@pytest.mark.parametrize(("direct", "bounce"), [(False, None), (True, None), (True, 3 * 4096)])
def test_pack_reads_equal_the_host_fill(
    toy_checkpoint: tuple[toy.ToyPipeline, Path], direct: bool, bounce: int | None
) -> None:
    """Every pack read by the file reader (buffered or O_DIRECT) holds the same tensor bytes as the
    host store's own fill: the transposed weight and the non-persistent buffer included; bounce
    buffers smaller than a pack (a small model's file tier sizes them to its packs) read it in chunks."""
    pipe, path = toy_checkpoint
    with CheckpointReader(path) as checkpoint:
        sized = {} if bounce is None else {"bounce_bytes": bounce, "bounces": 1}  # one: reads take turns
        reader = FileReader(checkpoint, direct=checkpoint.files if direct else (), **sized)
        try:
            assert set(reader.modes.values()) == ({"direct"} if direct else {"buffered"})
            for name in _specs(pipe):
                read, out, want, pieces, _ = _read(reader, pipe, name)
                for piece in pieces:
                    assert torch.equal(piece.view(out), piece.view(want)), (name, piece)
                if bounce is not None:
                    assert all(c.length <= bounce - 2 * 4096 for c in read.chunks)
            held = READ_BOUNCE_BYTES if bounce is None else bounce
            assert reader.bounce_bytes == (held if direct else 0)
        finally:
            reader.close()


def test_one_preadv_per_contiguous_run(toy_checkpoint: tuple[toy.ToyPipeline, Path]) -> None:
    """Each run of a block's tensors back to back in the file is one chunk, one system call scattering
    them into their places; the transposed weight is read with its run and rearranged in place."""
    pipe, path = toy_checkpoint
    with CheckpointReader(path) as checkpoint:
        reader = FileReader(checkpoint)
        try:
            read, *_ = _read(reader, pipe, "transformer.blocks.2")
            fixups = [f.name for f in read.fixups]
            assert fixups == ["transformer.blocks.2.out.weight"]
            assert all(f.in_place for f in read.fixups)
            runs = len(read.chunks)
            before = reader.syscalls
            _read(reader, pipe, "transformer.blocks.2")
            assert reader.syscalls - before == runs
            # As many runs as groups of the block's row-major tensors lying back to back in the file.
            ranges = sorted(
                (e.data_start + e.begin, e.data_start + e.end)
                for n, e in checkpoint.entries.items()
                if n.startswith("transformer.blocks.2.")
            )
            groups = 1 + sum(1 for a, b in itertools.pairwise(ranges) if b[0] != a[1])
            assert runs == groups
        finally:
            reader.close()


def test_large_tensor_splits_into_chunks(tmp_path: Path) -> None:
    """A tensor larger than a chunk is read in several chunks (direct: bounded by the bounce buffer),
    across the threads, and lands intact; a shard reads only its bytes."""
    big = torch.arange(5 * (CHUNK_BYTES // 4) + 123, dtype=torch.float32)
    small = torch.arange(1000, dtype=torch.float16)
    path = tmp_path / "big.safetensors"
    save_file({"a.big": big, "a.small": small}, str(path))
    specs = [
        TensorSpec(name="a.big", shape=tuple(big.shape), dtype="float32"),
        TensorSpec(name="a.small", shape=tuple(small.shape), dtype="float16"),
    ]
    layout = pack_specs(specs)
    pieces, nbytes = pack_layout(specs, [big, small])
    with CheckpointReader(path) as checkpoint:
        for direct in (True, False):
            reader = FileReader(checkpoint, direct=checkpoint.files if direct else ())
            try:
                read = reader.plan("a", layout=layout, pieces=pieces, span=None, module_bytes={})
                limit = CHUNK_BYTES if direct else BUFFERED_CHUNK_BYTES
                assert len(read.chunks) == -(-read.file_bytes // limit)
                out = torch.empty(nbytes, dtype=torch.uint8)
                reader.submit(read, out).wait()
                assert torch.equal(pieces[0].view(out), big) and torch.equal(pieces[1].view(out), small)
                start, end = nbytes // 3, 2 * nbytes // 3
                shard = reader.plan("a", layout=layout, pieces=pieces, span=(start, end), module_bytes={})
                assert shard.nbytes == end - start and shard.file_bytes == end - start
                part = torch.empty(shard.nbytes, dtype=torch.uint8)
                reader.submit(shard, part).wait()
                assert torch.equal(part, out[start:end])
            finally:
                reader.close()


def test_sharded_spans_equal_the_host_fill(toy_checkpoint: tuple[toy.ToyPipeline, Path]) -> None:
    """This rank's span of a block (cutting through the transposed weight) equals the host fill."""
    pipe, path = toy_checkpoint
    name = "transformer.blocks.1"
    specs = _specs(pipe)[name]
    nbytes = pack_layout(specs, _live(pipe, specs))[1]
    with CheckpointReader(path) as checkpoint:
        reader = FileReader(checkpoint)
        try:
            for span in [(0, nbytes // 2), (nbytes // 2, nbytes), (nbytes // 3, nbytes + 100)]:
                _, out, want, _, layout = _read(reader, pipe, name, span)
                covered = torch.zeros(span[1] - span[0], dtype=torch.bool)
                for spec, off in layout:
                    lo, hi = max(off, span[0]), min(off + spec.nbytes, span[1])
                    if lo < hi:
                        covered[lo - span[0] : hi - span[0]] = True
                assert torch.equal(out[covered], want[covered])
        finally:
            reader.close()


def _block_read(reader: FileReader, pipe: toy.ToyPipeline) -> tuple[PackRead, torch.Tensor]:
    specs = _specs(pipe)["transformer.blocks.0"]
    live = _live(pipe, specs)
    pieces, nbytes = pack_layout(specs, live)
    read = reader.plan(
        "transformer.blocks.0",
        layout=pack_specs(specs),
        pieces=pieces,
        span=None,
        module_bytes=_module_bytes(specs, live, pieces),
    )
    return read, torch.empty(nbytes, dtype=torch.uint8)


@pytest.mark.parametrize("direct", [False, True])
def test_truncated_file_names_file_and_tensor(
    toy_checkpoint: tuple[toy.ToyPipeline, Path], direct: bool
) -> None:
    """A file truncated while the session reads it: ExecutionError naming the pack, the file, the bytes
    and the tensors; the reader stays usable for other files and closes."""
    pipe, path = toy_checkpoint
    with CheckpointReader(path) as checkpoint:
        reader = FileReader(checkpoint, direct=checkpoint.files if direct else ())
        try:
            read, out = _block_read(reader, pipe)
            os.truncate(path, read.chunks[0].offset + 10)
            with pytest.raises(ExecutionError) as info:
                reader.submit(read, out).wait()
            text = str(info.value)
            assert text.startswith("reading transformer.blocks.0 from its checkpoint failed at bytes [")
            assert f"of {path} (tensor transformer.blocks.0." in text
            assert "truncated" in text and "nothing was lost" in text
        finally:
            reader.close()


def test_replaced_and_rewritten_files(toy_checkpoint: tuple[toy.ToyPipeline, Path], tmp_path: Path) -> None:
    """A file replaced by a copy of itself (a new inode under its name, the same bytes) reads on; one
    replaced by a copy that differs in a byte read before, or rewritten in place there, is refused at
    the next read, not read half old and half new."""
    pipe, path = toy_checkpoint
    with CheckpointReader(path) as checkpoint:
        reader = FileReader(checkpoint)
        try:
            read, out = _block_read(reader, pipe)
            reader.submit(read, out).wait()
            first = out.clone()
            copy = tmp_path / "copy.safetensors"
            data = bytearray(path.read_bytes())
            copy.write_bytes(data)
            os.replace(copy, path)
            reader.submit(read, out).wait()
            # compared twice: the file now at the name, and the one opened (unlinked: its change time moved)
            assert torch.equal(out, first) and reader.digests.settled == 2
            data[read.chunks[0].offset] ^= 1
            copy.write_bytes(data)
            os.replace(copy, path)
            with pytest.raises(
                ExecutionError, match=re.escape("the file was replaced on disk (another file")
            ):
                reader.submit(read, out).wait()
        finally:
            reader.close()
    data[read.chunks[0].offset] ^= 1
    path.write_bytes(data)
    with CheckpointReader(path) as checkpoint:
        reader = FileReader(checkpoint)
        try:
            read, out = _block_read(reader, pipe)
            reader.submit(read, out).wait()
            with open(path, "r+b") as f:  # the same size, new bytes, a new modification time
                f.seek(read.chunks[0].offset)
                f.write(b"\0\0\0\0")
            os.utime(path, ns=(1, 1))
            with pytest.raises(ExecutionError, match=re.escape("the file was rewritten in place")):
                reader.submit(read, out).wait()
        finally:
            reader.close()


@pytest.mark.parametrize(("direct", "span"), [(False, None), (True, None), (False, (32000, 43584))])
def test_a_moved_change_time_is_settled_by_the_span_digests(
    toy_checkpoint: tuple[toy.ToyPipeline, Path], direct: bool, span: tuple[int, int] | None
) -> None:
    """A digest is taken at each span's first read and not again while the file's identity stays; a
    chmod undone moves its inode change time, and the next read compares every span read so far once
    (one settling) and reads on; one byte rewritten with the modification time set back is then
    refused (buffered, O_DIRECT and a shard's part of a transposed weight, read whole aside)."""
    pipe, path = toy_checkpoint
    name = "transformer.blocks.1"
    with CheckpointReader(path) as checkpoint:
        reader = FileReader(checkpoint, direct=checkpoint.files if direct else ())
        try:
            read, out, *_ = _read(reader, pipe, name, span)  # and the host fill's read of the same pack
            spans = len(read.chunks) + sum(f.file is not None for f in read.fixups)
            assert span is None or any(f.file is not None for f in read.fixups)
            computed = reader.digests.computed
            assert spans and computed >= spans
            reader.submit(read, out).wait()
            assert reader.digests.computed == computed  # the steady read computes none
            first = out.clone()
            time.sleep(0.05)  # past the file system's timestamp granularity
            path.chmod(0)
            path.chmod(0o644)
            reader.submit(read, out).wait()
            assert torch.equal(out, first) and reader.digests.settled == 1
            reader.submit(read, out).wait()
            assert reader.digests.settled == 1  # the new change time adopted
            assert reader.digests.computed == computed
            chunk = read.chunks[0]
            before = os.stat(path)
            with open(path, "r+b") as f:
                f.seek(chunk.offset)
                f.write(bytes([f.read(1)[0] ^ 1]))
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            with pytest.raises(ExecutionError, match=re.escape("modification time set back")):
                reader.submit(read, out).wait()
        finally:
            reader.close()


def test_io_error_is_an_execution_error(toy_checkpoint: tuple[toy.ToyPipeline, Path]) -> None:
    """A read whose system call fails (here: its descriptor was closed under it) is an ExecutionError
    with the operating system's reason; a closed reader refuses new reads."""
    pipe, path = toy_checkpoint
    checkpoint = CheckpointReader(path)
    reader = FileReader(checkpoint)
    read, out = _block_read(reader, pipe)
    checkpoint.close()  # closes the descriptors the reader reads from
    with pytest.raises(ExecutionError, match=r"the read failed: .* \(errno \d+\)|the file"):
        reader.submit(read, out).wait()
    reader.close()
    with pytest.raises(ExecutionError, match=r"reader of .* is closed"):
        reader.submit(read, out)


def test_misaligned_tensor_cannot_be_viewed(tmp_path: Path) -> None:
    """A tensor at an offset that is not a multiple of its element size cannot back a file-tier view:
    PlanError naming the tensor and the remedies."""
    path = tmp_path / "odd.safetensors"
    header = json.dumps(
        {
            "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(19))
    with CheckpointReader(path) as checkpoint:
        entry = checkpoint.entries["b"]
        reader = FileReader(checkpoint)
        try:
            pieces, _ = pack_layout([TensorSpec(name="b", shape=(4,), dtype="float32")], [torch.zeros(4)])
            start = entry.data_start + entry.begin
            assert start % 4 == 3
            with pytest.raises(PlanError, match=re.escape("tensor 'b' starts at byte")):
                reader.views.view(entry.file, start, pieces[0], "b")
        finally:
            reader.close()
