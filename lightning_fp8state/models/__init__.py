"""Reference models and data for examples, recipes and benchmarks."""

from .data import MarkovTokens, ResumableLoader, TokenFile, make_dataset
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "MarkovTokens", "ResumableLoader", "TokenFile", "make_dataset"]
