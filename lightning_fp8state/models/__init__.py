"""Reference models and data for examples, recipes and benchmarks."""

from .data import MarkovTokens, TokenFile, make_dataset
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "MarkovTokens", "TokenFile", "make_dataset"]
