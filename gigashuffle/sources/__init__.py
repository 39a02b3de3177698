"""The data sources: per-sample sources as chunks (``Chunked``) and shard files with elastic checkpoints (``Sharded``).

``from gigashuffle.sources import ...`` is the import users write; the modules: ``chunked`` (:class:`Chunked` over
Hugging Face ``datasets``, webdataset or any iterable of dicts), ``shards`` (:class:`Sharded` and the ``.npy`` and
``.pt`` readers), ``shardcursor`` (its position, which merges and re-splits over any number of writers),
``parquetshards`` and ``tarshards`` (the parquet and webdataset tar readers), ``sourcechecks`` (what a source is,
looked up without importing its package) and ``stacking`` (samples into a chunk, and ``FixedLength`` for
variable-length fields).
"""

from gigashuffle.sources.chunked import Chunked, chunks, missing_state_methods, reshard_of
from gigashuffle.sources.parquetshards import ParquetReader
from gigashuffle.sources.shards import NpyReader, PtReader, Sharded
from gigashuffle.sources.stacking import Chunk, FixedLength
from gigashuffle.sources.tarshards import TarReader

__all__ = [
    "Chunk", "Chunked", "FixedLength", "NpyReader", "ParquetReader", "PtReader", "Sharded", "TarReader", "chunks",
    "reshard_of",
]  # fmt: skip
__all__ += ["missing_state_methods"]  # for the loader: why a dataset cannot be checkpointed
