"""DynTree core: tree-based speculative decoding (drafting, lossless verification, tree
attention, offloading). Importing this package builds no model and touches no network."""

from .config import ConfigError, DecodeConfig
from .trace import PhaseTimings, StepTrace, TokenProvenance
from .tree import TokenTree

__all__ = [
    "ConfigError",
    "DecodeConfig",
    "PhaseTimings",
    "SpeculativeDecoder",
    "StepTrace",
    "TokenProvenance",
    "TokenTree",
]


def __getattr__(name: str):
    if name == "SpeculativeDecoder":
        from .decode.engine import SpeculativeDecoder

        return SpeculativeDecoder
    raise AttributeError(name)
