"""GGUF files and the config.json beside them that lie about themselves: a configuration that is a
JSON array or nested 100,000 deep, a block count far above the file's, a tensor of the wrong rank;
each refused in torchferry's words before anything is built or read, by `from_single_file` and by
`torchferry plan` alike (one line, status 2)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import torchferry
from torchferry.topology import GGUFEntry, infer_gguf_model

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")

import gguf_files  # noqa: E402 (needs the gguf package)
from test_gguf_infer import ONE_BLOCK_WAN  # noqa: E402

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-block Wan file under its original names, alone in its folder."""
    where = tmp_path_factory.mktemp("gguf-lies") / "wan.gguf"
    gguf_files.write(where, gguf_files.wan(), original=True)
    return where


def _beside(file: Path, where: Path, text: str) -> Path:
    """A copy of ``file`` in the folder ``where`` with ``text`` as the config.json beside it."""
    where.mkdir()
    shutil.copy(file, where / "wan.gguf")
    (where / "config.json").write_text(text)
    return where / "wan.gguf"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[1, 2]", "holds an array, not a JSON object of settings"),
        ("7", "holds a number, not a JSON object of settings"),
        (DEEP, "cannot be read (it nests arrays and objects deeper than 64 levels)"),
        (
            '{"a": ' * 70 + "1" + "}" * 70,
            "cannot be read (it nests arrays and objects deeper than 64 levels)",
        ),
    ],
    ids=["array", "scalar", "deep", "deep-but-parsed"],
)
def test_a_config_that_is_no_json_object_is_refused_naming_it(
    file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    """A config.json that is an array, a number or nested deeper than 64 levels (100,000 deep, or 70
    and parsed): from_single_file(config=folder) and `torchferry plan` beside the file both refuse it
    naming the file, never diffusers' OSError nor a RecursionError."""
    from torchferry.cli import main

    given = tmp_path / "config"
    given.mkdir()
    (given / "config.json").write_text(text)
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(f"{given / 'config.json'}: the configuration given {said}; pass the model's folder"),
    ):
        torchferry.from_single_file(diffusers.WanTransformer3DModel, file, config=given, device="cpu")
    path = _beside(file, tmp_path / "plan", text)
    assert main(["plan", str(path), "--device-memory", "8MiB"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"torchferry plan: error: {path.parent / 'config.json'}: the config.json beside wan.gguf {said}; put "
        "the model's config.json (from its diffusers folder, e.g. transformer/config.json) beside it, or "
        "remove it to infer the class and configuration from the file"
    ]


@pytest.mark.parametrize("count", [10**9, 1e9, float("nan")], ids=["int", "float", "nan"])
def test_a_block_count_above_the_files_is_refused_before_building(
    file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], count: float
) -> None:
    """num_layers of a billion (an int or a float) or NaN beside a 3-block file is refused by its field
    and the file's count before the model is built (which would take hours), in the API's and the
    command line's words."""
    import json

    from torchferry.cli import main

    config = {"_class_name": "WanTransformer3DModel", **gguf_files.WAN_GGUF, "num_layers": count}
    config["patch_size"] = list(config["patch_size"])
    problem = (
        f"does not fill the WanTransformer3DModel its configuration builds (nothing was built or read): "
        f"config field num_layers gives {count!r} blocks, and the file's longest numbered list, blocks, "
        "holds 3\n"
    )
    with pytest.raises(torchferry.PlanError, match=re.escape(f"{file} {problem}pass config= ")):
        torchferry.from_single_file(diffusers.WanTransformer3DModel, file, config=config, device="cpu")
    path = _beside(file, tmp_path / "plan", json.dumps(config))
    assert main(["plan", str(path), "--device-memory", "8MiB"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"torchferry plan: error: {path} {problem[:-1]}; put the config.json of the model")


def _header(shapes: dict[str, tuple[int, ...]]) -> list[GGUFEntry]:
    return [
        GGUFEntry(
            name=n, dtype="float16", shape=s, begin=0, end=0, file="x.gguf", quant_type="F16", logical_shape=s
        )
        for n, s in shapes.items()
    ]


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("text_embedding.0.weight", (256,), "2 dimensions were expected (a linear layer's weight)"),
        ("blocks.0.ffn.0.weight", (256, 256, 2), "2 dimensions were expected (a linear layer's weight)"),
        ("head.head.weight", (16, 256, 1), "2 dimensions were expected (a linear layer's weight)"),
        ("time_embedding.0.weight", (), "2 dimensions were expected (a linear layer's weight)"),
    ],
)
def test_a_tensor_of_the_wrong_rank_is_named_with_its_shape(
    name: str, shape: tuple[int, ...], expected: str
) -> None:
    """A 1-D text embedding, a 3-D feed-forward or head weight, a 0-D time embedding: inference names
    the tensor, its shape and the rank expected (never "tuple index out of range", never a good
    tensor blamed)."""
    said = f"(tensor {name!r} has shape {list(shape)}, and {expected})"
    with pytest.raises(torchferry.PlanError, match=re.escape(said)):
        infer_gguf_model("x.gguf", _header({**ONE_BLOCK_WAN, name: shape}))
