"""Quantization recipes as plug-ins (see :mod:`.base`): one module per recipe family, each
registering its classes. Adding a recipe is a module here (plus its reference op, its kernel
and its ``configs/quant`` YAML): this package imports every module it holds."""

from __future__ import annotations

import importlib
import pkgutil

from .base import GemmLayouts, Operand, Recipe
from .delayed import Bf16, Fp8Delayed  # first: fp8_delayed leads recipe_names()
from .registry import RECIPE_CLASSES, check_recipe, recipe_class, recipe_for, recipe_names, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "RECIPE_CLASSES",
    "Bf16",
    "Fp8Delayed",
    "GemmLayouts",
    "Operand",
    "Recipe",
    "check_recipe",
    "recipe_class",
    "recipe_for",
    "recipe_names",
    "register",
]
