"""`ParallelLayout`: the parallel layout a pipeline already runs under, and the shard group it implies."""

from __future__ import annotations

import attrs

from torchferry.topology._fields import bool_field, int_field, positive

__all__ = ["ParallelLayout"]


@attrs.frozen(kw_only=True, cache_hash=True)
class ParallelLayout:
    """The parallel layout the pipeline already runs under; the weight-shard group derives from it."""

    data_parallel_size: int = attrs.field(default=1, validator=positive)
    sequence_parallel_size: int = attrs.field(default=1, validator=positive)
    tensor_parallel_size: int = attrs.field(default=1, validator=positive)
    use_hsdp: bool = attrs.field(default=False, validator=bool_field)
    hsdp_shard_size: int = attrs.field(default=-1, validator=int_field)
    hsdp_replicate_size: int = attrs.field(default=1, validator=positive)

    @property
    def shard_group_size(self) -> int:
        """Ranks that share one copy of the weights: DP; HSDP shard x replicate; else SP; never TP."""
        size = self.data_parallel_size
        if self.use_hsdp and self.hsdp_shard_size > 0:
            size = self.hsdp_shard_size * self.hsdp_replicate_size
        if size <= 1 and self.sequence_parallel_size > 1:
            size = self.sequence_parallel_size
        return size
