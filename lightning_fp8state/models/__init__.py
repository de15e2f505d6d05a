"""Reference models and data for examples, recipes and benchmarks."""

from .data import DATA_SOURCES, MarkovTokens, ResumableLoader, TokenFile, make_dataset
from .gpt import GPT, GPTConfig
from .hf_fuse import fuse_decoder_projections, unfuse_decoder_projections
from .hf_llama import llama_config_from_hf, load_hf_llama, read_hf_llama_config
from .llama import Llama, LlamaConfig

__all__ = [
    "DATA_SOURCES",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MarkovTokens",
    "ResumableLoader",
    "TokenFile",
    "fuse_decoder_projections",
    "llama_config_from_hf",
    "load_hf_llama",
    "make_dataset",
    "read_hf_llama_config",
    "unfuse_decoder_projections",
]
