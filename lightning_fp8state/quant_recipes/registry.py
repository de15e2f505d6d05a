"""The recipe registry, beside the recipes it lists: a recipe module registers its class with
:func:`register`, and the name becomes a valid ``quant.recipe``. ``QuantConfig`` (below this
package) checks its keys' own values only; whether a recipe of that name exists and allows
``quant.mode`` is checked here, when a recipe is built (:func:`recipe_for`) or a config is
checked ahead of a run (:func:`check_recipe`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import MODES, QuantConfig, require_choice, set_recipe_formats
from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import Recipe

__all__ = ["RECIPE_CLASSES", "check_recipe", "recipe_class", "recipe_for", "recipe_names", "register"]

# name -> class, in registration order (fp8_delayed first: the package imports it first)
RECIPE_CLASSES: dict[str, type[Recipe]] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: make ``cls`` the recipe of ``quant.recipe=cls.name`` (and its
    ``formats`` what ``quant.forward_format`` / ``backward_format`` ``auto`` resolve to)."""
    unknown = sorted(set(cls.modes) - set(MODES))
    if unknown:
        raise ConfigError(f"recipe {cls.name!r}: modes {unknown} are not allowed: expected a subset of {list(MODES)}")
    RECIPE_CLASSES[cls.name] = cls
    set_recipe_formats(cls.name, *cls.formats)  # what quant.*_format=auto means under it
    return cls


def recipe_names() -> tuple[str, ...]:
    """The registered recipe names (``fp8_delayed`` first)."""
    return tuple(RECIPE_CLASSES)


def recipe_class(name: str) -> type[Recipe]:
    """The class registered as ``name`` (``ConfigError`` naming ``recipe`` and the choices)."""
    require_choice("recipe", name, recipe_names())
    return RECIPE_CLASSES[name]


def check_recipe(config: QuantConfig) -> type[Recipe]:
    """Check ``config.recipe`` names a registered recipe that allows ``config.mode``; its class."""
    cls = recipe_class(config.recipe)
    if config.mode not in cls.modes:
        raise ConfigError(
            f"mode={config.mode!r} is not allowed with recipe={config.recipe!r}: expected one of "
            f"{list(cls.modes)} (the naive modes reproduce the defects of delayed scaling, whose state "
            "this recipe does not hold)"
        )
    return cls


def recipe_for(config: QuantConfig) -> Recipe:
    """The recipe ``config.recipe`` names, bound to ``config`` (checked by :func:`check_recipe`)."""
    return check_recipe(config)(config)
