"""Chapter 11: speculative decoding - drafters, acceptance (greedy and rejection sampling), KV rollback."""

from minirt.spec.acceptance import greedy_accept, rejection_sample
from minirt.spec.draft_model import DRAFT_MODEL, DraftModelProposer
from minirt.spec.ngram import propose_ngram
from minirt.spec.rollback import rollback_block_table

__all__ = ["DRAFT_MODEL", "DraftModelProposer", "greedy_accept", "propose_ngram", "rejection_sample",
           "rollback_block_table"]
