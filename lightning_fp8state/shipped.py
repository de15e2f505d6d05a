"""Where the folders shipped beside the code are: ``csrc/``, ``configs/`` and ``recipes/``.

They live at the repository root. An installed package (plain ``pip install``, a wheel,
``pip install --target``) carries them inside itself, as ``lightning_fp8state/<name>/``
(``pyproject.toml`` maps them there); a source checkout, editable installs included, has
them beside the package, at the root.
"""

from __future__ import annotations

from pathlib import Path

from .config import require_choice

__all__ = ["SHIPPED", "shipped_dir"]

SHIPPED = ("csrc", "configs", "recipes")
_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """The ``name`` folder (one of :data:`SHIPPED`) that this copy of the package uses.

    Raises:
        ConfigError: ``name`` is not a shipped folder.
        FileNotFoundError: neither the installed copy nor the source checkout has it.
    """
    require_choice("name", name, SHIPPED, why="a folder shipped with the package")
    installed = _PACKAGE / name
    if installed.is_dir():
        return installed
    root = _PACKAGE.parent
    # a source checkout: the folder at the root of the repository this package sits in
    if (root / name).is_dir() and (root / "pyproject.toml").is_file():
        return root / name
    raise FileNotFoundError(
        f"lightning_fp8state: the {name}/ folder is missing: looked in {installed} (an installed "
        f"package) and {root / name} (a source checkout); reinstall the package"
    )
