"""The documented path of the block-size policies (README: Python API, `policy=`): the policy
lives in `mlx_dflash.auto.policy`; this module only re-exports what it names."""

from .auto.policy import (
    AUTO,
    DEFAULT_BLOCK_SIZE,
    DFLASH,
    LOOKUP_BLOCK,
    AcceptanceModel,
    AutoBlockSize,
    BlockSizePolicy,
    CostModel,
    FixedBlockSize,
    Source,
    candidate_sizes,
    generic_cost,
    make_policy,
    parse_block_size,
    reproducible,
    verify_cost,
)

__all__ = ["AUTO", "DEFAULT_BLOCK_SIZE", "DFLASH", "LOOKUP_BLOCK", "AcceptanceModel", "AutoBlockSize",
           "BlockSizePolicy", "CostModel", "FixedBlockSize", "Source", "candidate_sizes", "generic_cost",
           "make_policy", "parse_block_size", "reproducible", "verify_cost"]
