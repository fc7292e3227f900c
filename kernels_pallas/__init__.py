"""Pallas kernels (Triton lowering, backend-neutral) beside pure-jnp references; ``ops`` picks one per call."""

from kernels_pallas.copy_blocks import copy_blocks, copy_blocks_reference
from kernels_pallas.fill_round import fill_round, fill_round_reference
from kernels_pallas.fill_rows import fill_rows, fill_rows_reference
from kernels_pallas.gather_rows import gather_rows, gather_rows_reference
from kernels_pallas.hot_gather import hot_gather, hot_gather_reference
from kernels_pallas.indexer_topk import (
    indexer_scores,
    indexer_scores_reference,
    topk_positions,
    topk_positions_reference,
)

__all__ = [
    "copy_blocks",
    "copy_blocks_reference",
    "fill_round",
    "fill_round_reference",
    "fill_rows",
    "fill_rows_reference",
    "gather_rows",
    "gather_rows_reference",
    "hot_gather",
    "hot_gather_reference",
    "indexer_scores",
    "indexer_scores_reference",
    "topk_positions",
    "topk_positions_reference",
]
