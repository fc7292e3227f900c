"""Pallas kernels (Triton lowering, backend-neutral) beside pure-jnp references."""

from kernels_pallas.gather_rows import gather_rows, gather_rows_reference
from kernels_pallas.indexer_topk import (
    indexer_scores,
    indexer_scores_reference,
    topk_positions,
    topk_positions_reference,
)

__all__ = [
    "gather_rows",
    "gather_rows_reference",
    "indexer_scores",
    "indexer_scores_reference",
    "topk_positions",
    "topk_positions_reference",
]
