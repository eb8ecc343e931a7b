"""Known public models: shipped tensor specs match the measured figures of every component exactly."""

from __future__ import annotations

import re
from typing import NamedTuple

import pytest

from torchferry import PlanError
from torchferry.topology import _known
from torchferry.topology._known import (
    KNOWN_ALIASES,
    KNOWN_MODELS,
    Resolution,
    known_model,
    known_topology,
)
from torchferry.topology._model import Component, Declaration, TensorSpec


class B(NamedTuple):
    """A measured block attribute: count, bf16 bytes per block (min, max), all blocks, loaded max."""

    attr: str
    count: int
    bf16_min: int
    bf16_max: int
    bf16_all: int
    loaded_max: int


class M(NamedTuple):
    """One component's measured figures (meta-device build, diffusers 0.42.1, transformers 5.24.0).

    ``loaded`` is what ``from_pretrained(torch_dtype=bf16)`` holds (Wan keeps some params in fp32);
    ``buffers`` is (count, fp32 bytes, bf16 bytes) of persistent buffers.
    """

    params: int
    tensors: int
    tied: int
    fp32_kept: int
    bf16: int
    loaded: int
    rest_params: int
    rest_bf16: int
    rest_loaded: int
    buffers: tuple[int, int, int]
    nonpersistent: int
    blocks: tuple[B, ...]


# Copied from the measurements in model_configs.json (models/model_configs.md), one row per component.
MEASURED: dict[tuple[str, str], M] = {
    ("wan2.1-t2v-14b", "transformer"): M(params=14_288_491_584, tensors=1095, tied=0, fp32_kept=29_184_000,
        bf16=28_576_983_168, loaded=28_635_351_168,
        rest_params=232_719_424, rest_bf16=465_438_848, rest_loaded=520_530_048,
        buffers=(0, 0, 0), nonpersistent=1_048_576,
        blocks=(
            B("blocks", 40, 702_788_608, 702_788_608, 28_111_544_320, 702_870_528),
        ),
    ),
    ("wan2.1-t2v-14b", "text_encoder"): M(params=5_680_910_336, tensors=242, tied=1, fp32_kept=0,
        bf16=11_361_820_672, loaded=11_361_820_672,
        rest_params=1_050_152_960, rest_bf16=2_100_305_920, rest_loaded=2_100_305_920,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_896_448, 385_896_448, 9_261_514_752, 385_896_448),
        ),
    ),
    ("wan2.1-t2v-14b", "vae"): M(params=126_892_531, tensors=194, tied=0, fp32_kept=0,
        bf16=253_785_062, loaded=253_785_062,
        rest_params=126_892_531, rest_bf16=253_785_062, rest_loaded=253_785_062,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("wan2.2-t2v-a14b", "transformer"): M(params=14_288_491_584, tensors=1095, tied=0, fp32_kept=29_184_000,
        bf16=28_576_983_168, loaded=28_635_351_168,
        rest_params=232_719_424, rest_bf16=465_438_848, rest_loaded=520_530_048,
        buffers=(0, 0, 0), nonpersistent=1_048_576,
        blocks=(
            B("blocks", 40, 702_788_608, 702_788_608, 28_111_544_320, 702_870_528),
        ),
    ),
    ("wan2.2-t2v-a14b", "transformer_2"): M(params=14_288_491_584, tensors=1095, tied=0, fp32_kept=29_184_000,
        bf16=28_576_983_168, loaded=28_635_351_168,
        rest_params=232_719_424, rest_bf16=465_438_848, rest_loaded=520_530_048,
        buffers=(0, 0, 0), nonpersistent=1_048_576,
        blocks=(
            B("blocks", 40, 702_788_608, 702_788_608, 28_111_544_320, 702_870_528),
        ),
    ),
    ("wan2.2-t2v-a14b", "text_encoder"): M(params=5_680_910_336, tensors=242, tied=1, fp32_kept=0,
        bf16=11_361_820_672, loaded=11_361_820_672,
        rest_params=1_050_152_960, rest_bf16=2_100_305_920, rest_loaded=2_100_305_920,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_896_448, 385_896_448, 9_261_514_752, 385_896_448),
        ),
    ),
    ("wan2.2-t2v-a14b", "vae"): M(params=126_892_531, tensors=194, tied=0, fp32_kept=0,
        bf16=253_785_062, loaded=253_785_062,
        rest_params=126_892_531, rest_bf16=253_785_062, rest_loaded=253_785_062,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("wan2.1-t2v-1.3b", "transformer"): M(params=1_418_996_800, tensors=825, tied=0, fp32_kept=3_127_296,
        bf16=2_837_993_600, loaded=2_844_248_192,
        rest_params=25_775_680, rest_bf16=51_551_360, rest_loaded=57_068_672,
        buffers=(0, 0, 0), nonpersistent=1_048_576,
        blocks=(
            B("blocks", 30, 92_881_408, 92_881_408, 2_786_442_240, 92_905_984),
        ),
    ),
    ("wan2.1-t2v-1.3b", "text_encoder"): M(params=5_680_910_336, tensors=242, tied=1, fp32_kept=0,
        bf16=11_361_820_672, loaded=11_361_820_672,
        rest_params=1_050_152_960, rest_bf16=2_100_305_920, rest_loaded=2_100_305_920,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_896_448, 385_896_448, 9_261_514_752, 385_896_448),
        ),
    ),
    ("wan2.1-t2v-1.3b", "vae"): M(params=126_892_531, tensors=194, tied=0, fp32_kept=0,
        bf16=253_785_062, loaded=253_785_062,
        rest_params=126_892_531, rest_bf16=253_785_062, rest_loaded=253_785_062,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("wan2.2-ti2v-5b", "transformer"): M(params=4_999_787_712, tensors=825, tied=0, fp32_kept=10_973_184,
        bf16=9_999_575_424, loaded=10_021_521_792,
        rest_params=90_086_592, rest_bf16=180_173_184, rest_loaded=200_644_992,
        buffers=(0, 0, 0), nonpersistent=1_048_576,
        blocks=(
            B("blocks", 30, 327_313_408, 327_313_408, 9_819_402_240, 327_362_560),
        ),
    ),
    ("wan2.2-ti2v-5b", "text_encoder"): M(params=5_680_910_336, tensors=242, tied=1, fp32_kept=0,
        bf16=11_361_820_672, loaded=11_361_820_672,
        rest_params=1_050_152_960, rest_bf16=2_100_305_920, rest_loaded=2_100_305_920,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_896_448, 385_896_448, 9_261_514_752, 385_896_448),
        ),
    ),
    ("wan2.2-ti2v-5b", "vae"): M(params=704_688_668, tensors=196, tied=0, fp32_kept=0,
        bf16=1_409_377_336, loaded=1_409_377_336,
        rest_params=704_688_668, rest_bf16=1_409_377_336, rest_loaded=1_409_377_336,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("flux.1-dev", "transformer"): M(params=11_901_408_320, tensors=1160, tied=0, fp32_kept=0,
        bf16=23_802_816_640, loaded=23_802_816_640,
        rest_params=64_124_992, rest_bf16=128_249_984, rest_loaded=128_249_984,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("transformer_blocks", 19, 679_662_592, 679_662_592, 12_913_589_248, 679_662_592),
            B("single_transformer_blocks", 38, 283_183_616, 283_183_616, 10_760_977_408, 283_183_616),
        ),
    ),
    ("flux.1-dev", "text_encoder"): M(params=123_060_480, tensors=196, tied=0, fp32_kept=0,
        bf16=246_120_960, loaded=246_120_960,
        rest_params=38_006_016, rest_bf16=76_012_032, rest_loaded=76_012_032,
        buffers=(0, 0, 0), nonpersistent=616,
        blocks=(
            B("encoder.layers", 12, 14_175_744, 14_175_744, 170_108_928, 14_175_744),
        ),
    ),
    ("flux.1-dev", "text_encoder_2"): M(params=4_762_310_656, tensors=219, tied=1, fp32_kept=0,
        bf16=9_524_621_312, loaded=9_524_621_312,
        rest_params=131_600_384, rest_bf16=263_200_768, rest_loaded=263_200_768,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_892_352, 385_896_448, 9_261_420_544, 385_896_448),
        ),
    ),
    ("flux.1-dev", "vae"): M(params=83_819_683, tensors=244, tied=0, fp32_kept=0,
        bf16=167_639_366, loaded=167_639_366,
        rest_params=83_819_683, rest_bf16=167_639_366, rest_loaded=167_639_366,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("qwen-image", "transformer"): M(params=20_430_401_088, tensors=1933, tied=0, fp32_kept=0,
        bf16=40_860_802_176, loaded=40_860_802_176,
        rest_params=40_523_328, rest_bf16=81_046_656, rest_loaded=81_046_656,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("transformer_blocks", 60, 679_662_592, 679_662_592, 40_779_755_520, 679_662_592),
        ),
    ),
    ("qwen-image", "text_encoder"): M(params=8_292_166_656, tensors=729, tied=0, fp32_kept=0,
        bf16=16_584_333_312, loaded=16_584_333_312,
        rest_params=1_136_078_080, rest_bf16=2_272_156_160, rest_loaded=2_272_156_160,
        buffers=(0, 0, 0), nonpersistent=672,
        blocks=(
            B("model.language_model.layers", 28, 466_115_584, 466_115_584, 13_051_236_352, 466_115_584),
            B("model.visual.blocks", 32, 39_404_400, 39_404_400, 1_260_940_800, 39_404_400),
        ),
    ),
    ("qwen-image", "vae"): M(params=126_892_531, tensors=194, tied=0, fp32_kept=0,
        bf16=253_785_062, loaded=253_785_062,
        rest_params=126_892_531, rest_bf16=253_785_062, rest_loaded=253_785_062,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("hunyuanvideo", "transformer"): M(params=12_821_012_544, tensors=1264, tied=0, fp32_kept=0,
        bf16=25_642_025_088, loaded=25_642_025_088,
        rest_params=360_714_304, rest_bf16=721_428_608, rest_loaded=721_428_608,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("transformer_blocks", 20, 679_662_592, 679_662_592, 13_593_251_840, 679_662_592),
            B("single_transformer_blocks", 40, 283_183_616, 283_183_616, 11_327_344_640, 283_183_616),
        ),
    ),
    ("hunyuanvideo", "text_encoder"): M(params=7_505_186_816, tensors=290, tied=0, fp32_kept=0,
        bf16=15_010_373_632, loaded=15_010_373_632,
        rest_params=525_602_816, rest_bf16=1_051_205_632, rest_loaded=1_051_205_632,
        buffers=(0, 0, 0), nonpersistent=512,
        blocks=(
            B("layers", 32, 436_224_000, 436_224_000, 13_959_168_000, 436_224_000),
        ),
    ),
    ("hunyuanvideo", "text_encoder_2"): M(params=123_060_480, tensors=196, tied=0, fp32_kept=0,
        bf16=246_120_960, loaded=246_120_960,
        rest_params=38_006_016, rest_bf16=76_012_032, rest_loaded=76_012_032,
        buffers=(0, 0, 0), nonpersistent=616,
        blocks=(
            B("encoder.layers", 12, 14_175_744, 14_175_744, 170_108_928, 14_175_744),
        ),
    ),
    ("hunyuanvideo", "vae"): M(params=246_478_803, tensors=248, tied=0, fp32_kept=0,
        bf16=492_957_606, loaded=492_957_606,
        rest_params=246_478_803, rest_bf16=492_957_606, rest_loaded=492_957_606,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("sd3.5-large", "transformer"): M(params=8_056_627_520, tensors=1226, tied=0, fp32_kept=0,
        bf16=16_113_255_040, loaded=16_113_255_040,
        rest_params=39_554_112, rest_bf16=79_108_224, rest_loaded=79_108_224,
        buffers=(1, 358_612_992, 179_306_496), nonpersistent=0,
        blocks=(
            B("transformer_blocks", 38, 272_170_496, 425_999_360, 16_034_146_816, 425_999_360),
        ),
    ),
    ("sd3.5-large", "text_encoder"): M(params=123_650_304, tensors=197, tied=0, fp32_kept=0,
        bf16=247_300_608, loaded=247_300_608,
        rest_params=38_595_840, rest_bf16=77_191_680, rest_loaded=77_191_680,
        buffers=(0, 0, 0), nonpersistent=616,
        blocks=(
            B("text_model.encoder.layers", 12, 14_175_744, 14_175_744, 170_108_928, 14_175_744),
        ),
    ),
    ("sd3.5-large", "text_encoder_2"): M(params=694_659_840, tensors=517, tied=0, fp32_kept=0,
        bf16=1_389_319_680, loaded=1_389_319_680,
        rest_params=64_981_760, rest_bf16=129_963_520, rest_loaded=129_963_520,
        buffers=(0, 0, 0), nonpersistent=616,
        blocks=(
            B("text_model.encoder.layers", 32, 39_354_880, 39_354_880, 1_259_356_160, 39_354_880),
        ),
    ),
    ("sd3.5-large", "text_encoder_3"): M(params=4_762_310_656, tensors=219, tied=1, fp32_kept=0,
        bf16=9_524_621_312, loaded=9_524_621_312,
        rest_params=131_600_384, rest_bf16=263_200_768, rest_loaded=263_200_768,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_892_352, 385_896_448, 9_261_420_544, 385_896_448),
        ),
    ),
    ("sd3.5-large", "vae"): M(params=83_819_683, tensors=244, tied=0, fp32_kept=0,
        bf16=167_639_366, loaded=167_639_366,
        rest_params=83_819_683, rest_bf16=167_639_366, rest_loaded=167_639_366,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(),
    ),
    ("ltx-video-2b", "transformer"): M(params=1_923_385_472, tensors=715, tied=0, fp32_kept=0,
        bf16=3_846_770_944, loaded=3_846_770_944,
        rest_params=43_018_368, rest_bf16=86_036_736, rest_loaded=86_036_736,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("transformer_blocks", 28, 134_311_936, 134_311_936, 3_760_734_208, 134_311_936),
        ),
    ),
    ("ltx-video-2b", "text_encoder"): M(params=4_762_310_656, tensors=219, tied=1, fp32_kept=0,
        bf16=9_524_621_312, loaded=9_524_621_312,
        rest_params=131_600_384, rest_bf16=263_200_768, rest_loaded=263_200_768,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("encoder.block", 24, 385_892_352, 385_896_448, 9_261_420_544, 385_896_448),
        ),
    ),
    ("ltx-video-2b", "vae"): M(params=419_193_649, tensors=188, tied=0, fp32_kept=0,
        bf16=838_387_298, loaded=838_387_298,
        rest_params=419_193_649, rest_bf16=838_387_298, rest_loaded=838_387_298,
        buffers=(2, 1_024, 512), nonpersistent=0,
        blocks=(),
    ),
    ("ltx-video-2b", "vae@0.9.1"): M(params=934_976_434, tensors=292, tied=0, fp32_kept=0,
        bf16=1_869_952_868, loaded=1_869_952_868,
        rest_params=934_976_434, rest_bf16=1_869_952_868, rest_loaded=1_869_952_868,
        buffers=(2, 1_024, 512), nonpersistent=0,
        blocks=(),
    ),
    ("ltx-video-2b", "vae@0.9.5"): M(params=1_246_913_522, tensors=224, tied=0, fp32_kept=0,
        bf16=2_493_827_044, loaded=2_493_827_044,
        rest_params=1_246_913_522, rest_bf16=2_493_827_044, rest_loaded=2_493_827_044,
        buffers=(2, 1_024, 512), nonpersistent=0,
        blocks=(),
    ),
    ("ltx-video-13b-0.9.7", "transformer"): M(params=13_042_569_344, tensors=1215, tied=0, fp32_kept=0,
        bf16=26_085_138_688, loaded=26_085_138_688,
        rest_params=153_145_472, rest_bf16=306_290_944, rest_loaded=306_290_944,
        buffers=(0, 0, 0), nonpersistent=0,
        blocks=(
            B("transformer_blocks", 48, 537_059_328, 537_059_328, 25_778_847_744, 537_059_328),
        ),
    ),
}

# Components another id reuses: ltx-video-13b-0.9.7 ships with the 2B's T5 and the 0.9.5 VAE.
BORROWED = {
    ("ltx-video-13b-0.9.7", "text_encoder"): ("ltx-video-2b", "text_encoder"),
    ("ltx-video-13b-0.9.7", "vae"): ("ltx-video-2b", "vae@0.9.5"),
}

CASES = [(m, c.path) for m in KNOWN_MODELS for c in known_topology(m).components]


def _expected(model_id: str, path: str) -> M:
    return MEASURED[BORROWED.get((model_id, path), (model_id, path))]


def _params(component: Component) -> list[TensorSpec]:
    return [t for t in component.all_tensors() if not t.buffer]


def _numel(tensors: list[TensorSpec]) -> int:
    return sum(t.numel for t in tensors)


def test_every_measured_component_is_known() -> None:
    """Every id and component of the measurements has a shipped topology, and nothing more."""
    measured = {key for key in MEASURED if "@" not in key[1]} | set(BORROWED)
    assert set(CASES) == measured
    assert set(KNOWN_MODELS) == {m for m, _ in MEASURED}


@pytest.mark.parametrize(("model_id", "path"), CASES)
def test_component_bytes_match_measurements(model_id: str, path: str) -> None:
    """Parameters count, tensor count, bf16 bytes and as-loaded bytes equal the measured figures."""
    want = _expected(model_id, path)
    comp = known_topology(model_id).component(path)
    params = _params(comp)
    assert _numel(params) == want.params
    assert len(params) == want.tensors
    assert sum(len(t.aliases) for t in params) == want.tied
    assert _numel(params) * 2 == want.bf16
    assert sum(t.nbytes for t in params) == want.loaded
    assert _numel([t for t in params if t.dtype == "float32"]) == want.fp32_kept
    assert {t.dtype for t in params} <= {"bfloat16", "float32"}


@pytest.mark.parametrize(("model_id", "path"), CASES)
def test_blocks_match_measurements(model_id: str, path: str) -> None:
    """Block attributes, counts, per-block bytes (bf16 and as loaded) and the remainder match."""
    want = _expected(model_id, path)
    comp = known_topology(model_id).component(path)
    got_attrs = tuple(a for s in comp.stacks for a in s.attrs)
    assert got_attrs == tuple(b.attr for b in want.blocks)
    for b in want.blocks:
        blocks = [blk for blk in comp.blocks if blk.path.startswith(f"{path}.{b.attr}.")]
        assert [blk.path for blk in blocks] == [f"{path}.{b.attr}.{i}" for i in range(b.count)]
        bf16 = [_numel(list(blk.tensors)) * 2 for blk in blocks]
        assert (min(bf16), max(bf16), sum(bf16)) == (b.bf16_min, b.bf16_max, b.bf16_all)
        assert max(sum(t.nbytes for t in blk.tensors) for blk in blocks) == b.loaded_max
    assert _numel([t for t in comp.tensors if not t.buffer]) == want.rest_params
    assert sum(t.numel * 2 for t in comp.tensors if not t.buffer) == want.rest_bf16
    assert sum(t.nbytes for t in comp.tensors if not t.buffer) == want.rest_loaded


@pytest.mark.parametrize(("model_id", "path"), CASES)
def test_buffers_match_measurements(model_id: str, path: str) -> None:
    """Persistent buffers load in bf16 (fp32 as saved) and non-persistent ones keep their own dtype."""
    want = _expected(model_id, path)
    comp = known_topology(model_id).component(path)
    persistent = [t for t in comp.all_tensors() if t.buffer and t.persistent]
    transient = [t for t in comp.all_tensors() if t.buffer and not t.persistent]
    count, fp32_bytes, bf16_bytes = want.buffers
    assert len(persistent) == count
    assert sum(t.numel * 4 for t in persistent) == fp32_bytes
    assert sum(t.nbytes for t in persistent) == bf16_bytes
    assert sum(t.nbytes for t in transient) == want.nonpersistent
    # comp.nbytes also counts the padding that aligns each tensor of a flat buffer (topology.pack)
    assert sum(t.nbytes for t in comp.all_tensors()) == want.loaded + bf16_bytes + want.nonpersistent
    assert 0 <= comp.nbytes - sum(t.nbytes for t in comp.all_tensors()) < 256 * len(list(comp.all_tensors()))


def test_sd35_positional_table_is_a_persistent_bf16_buffer() -> None:
    """SD3.5-Large carries its 36864 x 2432 positional table as one persistent bf16 buffer."""
    comp = known_topology("sd3.5-large").component("transformer")
    (table,) = [t for t in comp.tensors if t.buffer]
    assert table == TensorSpec(
        name="transformer.pos_embed.pos_embed", shape=(1, 36864, 2432), dtype="bfloat16", buffer=True
    )
    assert table.nbytes == 179_306_496


def test_wan_keeps_its_fp32_modules_in_fp32() -> None:
    """Wan's scale-shift tables, norm2 and time embedder load in fp32; its rope tables are transient."""
    comp = known_topology("wan2.1-t2v-14b").component("transformer")
    fp32 = {t.name for t in comp.all_tensors() if t.dtype == "float32" and not t.buffer}
    assert "transformer.blocks.7.scale_shift_table" in fp32
    assert "transformer.blocks.7.norm2.weight" in fp32
    assert "transformer.condition_embedder.time_embedder.linear_1.weight" in fp32
    assert "transformer.blocks.7.attn1.to_q.weight" not in fp32
    rope = [t for t in comp.tensors if t.buffer]
    assert [(t.name, t.shape, t.dtype, t.persistent) for t in rope] == [
        ("transformer.rope.freqs_cos", (1024, 128), "float32", False),
        ("transformer.rope.freqs_sin", (1024, 128), "float32", False),
    ]


def test_tied_embedding_is_one_tensor_with_an_alias() -> None:
    """T5's shared embedding is owned once and its encoder binding is an alias of it."""
    topo = known_topology("flux.1-dev")
    owners = topo.owners()
    assert owners == {"text_encoder_2.encoder.embed_tokens.weight": "text_encoder_2.shared.weight"}
    names = [t.name for c in topo.components for t in c.all_tensors()]
    assert len(names) == len(set(names))


def test_ltx_aliases_swap_the_vae_release() -> None:
    """The LTX 0.9.1 and 0.9.5 aliases keep the 2B DiT and T5 and bring their own VAE."""
    assert dict(KNOWN_ALIASES) == {"ltx-video-2b-0.9.1": "ltx-video-2b", "ltx-video-2b-0.9.5": "ltx-video-2b"}
    base = known_topology("ltx-video-2b")
    for alias, variant in (("ltx-video-2b-0.9.1", "vae@0.9.1"), ("ltx-video-2b-0.9.5", "vae@0.9.5")):
        topo = known_topology(alias)
        assert topo.source == f"known:{alias}"
        assert topo.components[:2] == base.components[:2]
        vae = topo.component("vae")
        want = MEASURED[("ltx-video-2b", variant)]
        assert _numel(_params(vae)) == want.params
        assert sum(t.nbytes for t in vae.all_tensors()) == want.loaded + want.buffers[2]


@pytest.mark.parametrize("model_id", KNOWN_MODELS)
def test_topology_shape_and_declaration(model_id: str) -> None:
    """Components are named as in diffusers, DiT blocks form one ring, and the declaration matches."""
    topo = known_topology(model_id)
    assert topo.source == f"known:{model_id}"
    assert topo.declares_components
    kinds = [c.kind for c in topo.components]
    assert kinds == sorted(kinds, key=("dit", "encoder", "vae").index)
    dits = topo.of_kind("dit")
    encoders = topo.of_kind("encoder")
    for dit in dits:
        assert len(dit.stacks) == 1
    assert topo.declaration == Declaration(
        block_attrs={d.path: d.stacks[0].attrs for d in dits},
        resident_dit_paths=[d.path for d in dits],
        encoder_component_types={e.path: "text_encoder" for e in encoders},
        encoder_block_attrs={e.path: tuple(a for s in e.stacks for a in s.attrs) for e in encoders},
        encoder_dlo_weight_replication=[e.path for e in encoders],
    )


def test_flux_ring_runs_double_then_single_blocks() -> None:
    """Flux's 19 double-stream blocks come before its 38 single-stream blocks in one ring."""
    (stack,) = known_topology("flux.1-dev").component("transformer").stacks
    assert stack.attrs == ("transformer_blocks", "single_transformer_blocks")
    paths = [b.path for b in stack.blocks]
    assert paths[18:20] == ["transformer.transformer_blocks.18", "transformer.single_transformer_blocks.0"]
    assert len(paths) == 57


def test_topology_is_hashable_and_cached() -> None:
    """A known topology hashes, equals a fresh rebuild, and is the same object on a second call."""
    first = known_topology("qwen-image")
    assert known_topology("Qwen-Image") is first
    _known._topology.cache_clear()
    _known._document.cache_clear()
    rebuilt = known_topology("qwen-image")
    assert rebuilt is not first
    assert rebuilt == first
    assert hash(rebuilt) == hash(first)
    assert len({first, rebuilt}) == 1


def test_unknown_id_lists_the_known_ones() -> None:
    """An unknown id is a PlanError naming every known id and alias and what else to pass."""
    msg = (
        "unknown model id 'flux.2-dev': torchferry knows wan2.1-t2v-14b, wan2.2-t2v-a14b, wan2.1-t2v-1.3b, "
        "wan2.2-ti2v-5b, flux.1-dev, qwen-image, hunyuanvideo, sd3.5-large, ltx-video-2b, "
        "ltx-video-13b-0.9.7; aliases: ltx-video-2b-0.9.1 (ltx-video-2b), ltx-video-2b-0.9.5 "
        "(ltx-video-2b). Pass one of these ids or their hub ids (black-forest-labs/FLUX.1-dev; torchferry "
        "plan --list shows them), a diffusers pipeline folder, or a safetensors file, folder or *.index.json."
    )
    with pytest.raises(PlanError, match=re.escape(msg)):
        known_topology("flux.2-dev")
    with pytest.raises(PlanError, match=re.escape(msg)):
        known_model("flux.2-dev")


@pytest.mark.parametrize("model_id", KNOWN_MODELS)
def test_model_facts_agree_with_the_tensors(model_id: str) -> None:
    """Hidden size, FFN width and block count of the facts are those of the shipped DiT tensors."""
    model = known_model(model_id)
    topo = known_topology(model_id)
    assert model.id == model_id
    assert model.pipeline_class == topo.pipeline_class
    assert [(c.path, c.kind, c.class_name) for c in model.components] == [
        (c.path, c.kind, c.class_name) for c in topo.components
    ]
    assert model.hidden_size == model.num_heads * model.head_dim
    for path in model.dit_paths:
        dit = topo.component(path)
        assert len(dit.blocks) == model.num_blocks
        for block in dit.blocks:
            assert (model.ffn_dim, model.hidden_size) in {t.shape for t in block.tensors}
    flops = model.block_flops()
    assert len(flops) == model.num_blocks
    assert model.step_flops() == sum(flops) * model.batch_per_forward * model.forwards_per_step


@pytest.mark.parametrize(
    ("model_id", "resolution", "tokens"),
    [
        ("wan2.1-t2v-14b", "1280x720x81f", 75_600),
        ("wan2.1-t2v-1.3b", "832x480x81f", 32_760),
        ("wan2.2-ti2v-5b", "1280x704x121f", 27_280),
        ("flux.1-dev", "1024x1024", 4_096),
        ("qwen-image", "1024x1024", 4_096),
        ("hunyuanvideo", "1280x720x129f", 118_800),
        ("sd3.5-large", "1024x1024", 4_096),
        ("ltx-video-2b", "704x512x161f", 7_392),
    ],
)
def test_default_resolution_and_tokens(model_id: str, resolution: str, tokens: int) -> None:
    """Each model states its default resolution and the latent tokens a DiT forward sees there."""
    model = known_model(model_id)
    assert str(model.resolution) == resolution
    assert model.tokens() == tokens


def test_joint_block_flops_formula() -> None:
    """Flux blocks cost 24(N+L)D² + 4(N+L)²D FLOPs; a smaller resolution costs fewer."""
    model = known_model("flux.1-dev")
    n, text, d = 4096 + 512, 512, 3072
    assert text == model.text_tokens
    assert model.block_flops() == (24 * n * d * d + 4 * n * n * d,) * 57
    half = model.block_flops(Resolution(height=512, width=512))
    assert half[0] == 24 * 1536 * d * d + 4 * 1536 * 1536 * d


def test_cross_block_flops_formula() -> None:
    """A Wan block costs self-attention, cross-attention and FFN products over N latent and L text tokens."""
    model = known_model("wan2.1-t2v-1.3b")
    n, text, d, f = 32_760, 512, 1536, 8960
    one = 12 * n * d * d + 4 * text * d * d + 4 * n * d * f + 4 * n * n * d + 4 * n * text * d
    assert model.block_flops() == (one,) * 30
    assert model.step_flops() == 2 * 30 * one


def test_sd35_last_block_is_cheaper() -> None:
    """SD3.5's context-pre-only last block skips the text stream's output and FFN, batched CFG doubles it."""
    model = known_model("sd3.5-large")
    flops = model.block_flops()
    assert len(set(flops[:-1])) == 1
    assert flops[-1] < flops[0]
    assert model.batch_per_forward == 2


def test_wan22_experts_switch_at_the_boundary() -> None:
    """Wan2.2 A14B runs transformer at timesteps >= 875 and transformer_2 below; others use one DiT."""
    model = known_model("wan2.2-t2v-a14b")
    assert model.boundary_ratio == 0.875
    assert (model.high_noise_dit, model.low_noise_dit) == ("transformer", "transformer_2")
    assert model.dit_for_timestep(999.0) == "transformer"
    assert model.dit_for_timestep(875.0) == "transformer"
    assert model.dit_for_timestep(874.9) == "transformer_2"
    assert known_model("flux.1-dev").dit_for_timestep(100.0) == "transformer"


def test_resolution_rejects_non_positive_sizes() -> None:
    """A resolution with a zero side is a ValueError naming the field; a valid one prints WxHxFf."""
    with pytest.raises(ValueError, match=re.escape("height must be a positive integer, got 0")):
        Resolution(height=0, width=64)
    assert str(Resolution(height=2, width=3, frames=5)) == "3x2x5f"


def test_shipped_data_is_small() -> None:
    """The shipped tensor specs stay well under 2 MB in total."""
    from importlib import resources

    folder = resources.files("torchferry.topology").joinpath("known")
    sizes = [len(folder.joinpath(f"{m}.json.gz").read_bytes()) for m in KNOWN_MODELS]
    assert sum(sizes) < 200_000
