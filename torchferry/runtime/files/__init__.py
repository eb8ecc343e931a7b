"""Files: reading checkpoints, the reader threads, spilling a pipeline to disk."""

from __future__ import annotations

from torchferry.runtime.files._checkpoint_reader import WIDENED_FROM as WIDENED_FROM

# The names the rest of the runtime uses: it enters this package only here.
from torchferry.runtime.files._checkpoint_reader import CheckpointReader as CheckpointReader
from torchferry.runtime.files._gguf_reader import GGUFCheckpointReader as GGUFCheckpointReader
from torchferry.runtime.files._gguf_reader import model_entries as model_entries
from torchferry.runtime.files._gguf_reader import open_checkpoint as open_checkpoint
from torchferry.runtime.files._reader import BOUNCE_BYTES as BOUNCE_BYTES
from torchferry.runtime.files._reader import BUFFERED_CHUNK_BYTES as BUFFERED_CHUNK_BYTES
from torchferry.runtime.files._reader import DIRECT_ALIGN as DIRECT_ALIGN
from torchferry.runtime.files._reader import READ_THREADS as READ_THREADS
from torchferry.runtime.files._reader import FileReader as FileReader
from torchferry.runtime.files._reader import PackRead as PackRead
from torchferry.runtime.files._reader import Ticket as Ticket
from torchferry.runtime.files._spill import agreed as agreed
from torchferry.runtime.files._spill import check_spill as check_spill
from torchferry.runtime.files._spill import spill as spill
from torchferry.runtime.files._spill import spill_folder as spill_folder
from torchferry.runtime.files._spill_lease import SpillLease as SpillLease
