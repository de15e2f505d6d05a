"""Reference models and data for examples, recipes and benchmarks."""

from .data import DATA_SOURCES, MarkovTokens, ResumableLoader, TokenFile, make_dataset
from .gpt import GPT, GPTConfig

__all__ = ["DATA_SOURCES", "GPT", "GPTConfig", "MarkovTokens", "ResumableLoader", "TokenFile", "make_dataset"]
