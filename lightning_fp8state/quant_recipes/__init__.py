"""Quantization recipes as plug-ins (see :mod:`.base`): one module per recipe family, each
registering its classes. Adding a recipe is a module here (plus its reference op, its kernel
and its ``configs/quant`` YAML): this package imports every module it holds."""

from __future__ import annotations

import importlib
import pkgutil

from .base import RECIPE_CLASSES, Recipe, recipe_for, register
from .delayed import Bf16, Fp8Delayed  # first: fp8_delayed leads recipe_names()

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["RECIPE_CLASSES", "Bf16", "Fp8Delayed", "Recipe", "recipe_for", "register"]
