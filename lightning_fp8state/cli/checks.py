"""The checks the CLI makes before a run starts, each refusal a ConfigError naming the key.

What the configuration schema cannot say alone: a number that is not finite, a strategy that
cannot run ``trainer.compile`` or ``trainer.cuda_graphs`` (the strategy contract says, through
:func:`~lightning_fp8state.cli.schema.strategy_facts`), a GPU run on a machine without (enough)
GPUs, and ``telemetry.wandb=online`` without W&B credentials. :func:`require_runnable` makes them
all, in this order, before anything is created (a new run) or changed (a resume).
"""

from __future__ import annotations

import math
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..quant_recipes import RECIPE_CLASSES as QUANT_RECIPE_CLASSES
from ..quant_recipes import Recipe as QuantRecipe
from ..quant_recipes import recipe_for as quant_recipe_for
from .config import quant_config
from .schema import strategy_facts

__all__ = [
    "CUDA_GRAPHS_ACCELERATORS",
    "require_accelerator",
    "require_compile_strategy",
    "require_cuda_graphs_setup",
    "require_finite",
    "require_runnable",
    "require_wandb_credentials",
]

CUDA_GRAPHS_ACCELERATORS = ("gpu", "cuda")


def require_runnable(cfg: DictConfig, recipe: str | None, *, rank: int) -> None:
    """Every check below, for the run of ``cfg`` (from the run recipe ``recipe``, None for a
    resume or the default); the W&B credentials on rank 0 only (the rank that starts the W&B run)."""
    require_finite(cfg)
    require_compile_strategy(cfg)
    require_cuda_graphs_setup(cfg)
    require_accelerator(cfg, recipe)
    if rank == 0:
        require_wandb_credentials(cfg)


def require_finite(cfg: DictConfig) -> None:
    """Refuse a NaN or infinite number anywhere in the configuration (``trainer.lr=nan``)."""

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is not allowed: expected a finite number")

    walk(OmegaConf.to_container(cfg, resolve=True), "")


def _names(fact) -> list[str]:
    """The strategy names for which ``fact(contract class)`` holds (for messages)."""
    from .schema import strategy_choices

    return [name for name, cls in strategy_choices().items() if fact(cls)]


def require_compile_strategy(cfg: DictConfig) -> None:
    """trainer.compile with the strategies it has run with only (the contract's ``compiles_blocks``)."""
    if cfg.trainer.compile and not strategy_facts(cfg.strategy).compiles_blocks:
        raise ConfigError(
            f"trainer.compile=true with strategy.name={cfg.strategy.name!r} is not allowed: expected a strategy "
            f"in {_names(lambda c: c.compiles_blocks)}, or trainer.compile=false"
        )


def require_cuda_graphs_setup(cfg: DictConfig) -> None:
    """trainer.cuda_graphs: on GPUs, under a strategy whose contract has graphs (``"step"``: the
    whole step, one GPU, no accumulation; ``"blocks"``: per-block graphs), no recompute audit, none
    of DeepSpeed's activation-checkpointing features, a quant recipe that graphs; each refusal
    names the key to change and why."""
    if not cfg.trainer.cuda_graphs:
        return
    for key, ok, found, allowed, why in _cuda_graphs_needs(cfg):
        if not ok:
            raise ConfigError(
                f"trainer.cuda_graphs=true with {key}={found} is not allowed: expected {key}={allowed} ({why}), "
                "or trainer.cuda_graphs=false"
            )


def _cuda_graphs_needs(cfg: DictConfig) -> list[tuple[str, bool, str, str, str]]:
    """What ``trainer.cuda_graphs=true`` needs, in the order it is checked: (key, whether this
    configuration has it, the value found, what is allowed, why)."""
    t, s = cfg.trainer, cfg.strategy
    graphs = strategy_facts(s).cuda_graphs  # "step": the whole step (GraphedTrainingStep); "blocks": GraphedBlocks
    whole_step = graphs == "step"
    one_graph = f"1 under strategy.name={s.name!r}"
    why_step = "the whole step is one graph on one GPU that writes its gradients afresh each step"
    why_blocks = "per-block graphs recompute through torch's checkpoint inside the graph"
    needs = [
        (
            "trainer.accelerator",
            t.accelerator in CUDA_GRAPHS_ACCELERATORS,
            f"{t.accelerator!r}",
            "'gpu'",
            "graphs are CUDA's",
        ),
        (
            "strategy.name",
            graphs is not None,
            f"{s.name!r}",
            f"one of {_names(lambda c: c.cuda_graphs is not None)}",
            "graphs run under these strategies only",
        ),
        (
            "trainer.devices",
            not whole_step or (t.devices == 1 and t.num_nodes == 1),
            f"{t.devices} x {t.num_nodes} node(s)",
            one_graph,
            why_step,
        ),
        (
            "trainer.accumulate_grad_batches",
            not whole_step or t.accumulate_grad_batches == 1,
            str(t.accumulate_grad_batches),
            one_graph,
            why_step,
        ),
        (
            "telemetry.audit",
            not cfg.telemetry.audit,
            "true",
            "false",
            "the audit runs Python on every quantized call, which a replay does not",
        ),
        ("trainer.compile", whole_step or not t.compile, "true", "false under a data-parallel strategy", why_blocks),
    ]
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        needs.append((f"strategy.{key}", not s[key], "true", "false", f"{why_blocks}, not DeepSpeed's"))
    return needs + _quant_recipe_needs(cfg)


def _quant_recipe_needs(cfg: DictConfig) -> list[tuple[str, bool, str, str, str]]:
    """The quant recipe (``quant.recipe``) under graphs: one whose calls run Python that a replay
    would not (its ``graph_problem``) is refused, naming the quant recipes that graph."""
    problem = quant_recipe_for(quant_config(cfg)).graph_problem()
    if problem is None:
        return []
    graphable = [name for name, cls in QUANT_RECIPE_CLASSES.items() if cls.graph_problem is QuantRecipe.graph_problem]
    return [("quant.recipe", False, repr(cfg.quant.recipe), f"one of {graphable}", problem)]


def require_accelerator(cfg: DictConfig, recipe: str | None) -> None:
    """Refuse a GPU configuration on a machine without (enough) GPUs, before anything is created
    (``recipe``: the run recipe's name or path as given, for the message)."""
    t = cfg.trainer
    needs_cuda = strategy_facts(cfg.strategy).cuda_required()
    if not (t.accelerator in ("gpu", "cuda") or needs_cuda):
        return
    what = f"recipe {recipe!r}" if recipe else f"recipe {cfg.name!r}"
    need = f"strategy.name={cfg.strategy.name}" if needs_cuda else f"trainer.accelerator={t.accelerator!r}"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ConfigError(
            f"{what}: {need} needs a CUDA GPU, and none is visible here (torch.cuda.is_available() is False). "
            "Run it on a GPU machine, or train the CPU recipe: fp8state train tiny_gpt_cpu"
        )
    if t.accelerator in ("gpu", "cuda") and t.num_nodes == 1 and t.devices > have:
        raise ConfigError(
            f"{what}: trainer.devices={t.devices} but {have} GPU(s) are visible here: "
            f"pass trainer.devices={have} or run on a machine with {t.devices}"
        )


def require_wandb_credentials(cfg: DictConfig) -> None:
    """``telemetry.wandb=online`` needs an API key for the server W&B will use; without one W&B
    asks on a terminal (or fails) after the run has started. W&B decides both itself, here
    without any network call: the server from ``WANDB_BASE_URL`` or its settings file (``wandb
    login --host``), the key from ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, a netrc
    entry for that server (``host:port``; ``api.wandb.ai`` for W&B's cloud under any of its
    addresses) or its settings. A key W&B would reject (too short, two sources at once) is
    refused here too. A wandb without this lookup (``wandb.sdk.lib.wbauth``, older releases)
    leaves the answer to ``wandb.init``, whose failure is one line as well (``_start_wandb`` in ``cli/train.py``).
    """
    if cfg.telemetry.wandb != "online":
        return
    import wandb  # noqa: PLC0415

    try:
        from wandb.sdk import wandb_setup  # noqa: PLC0415
        from wandb.sdk.lib import wbauth  # noqa: PLC0415
    except ImportError:
        return
    setup = wandb_setup.singleton()
    # W&B reads its settings from the environment once per process: settings loaded only for this
    # check are dropped after it, so that wandb.init reads them afresh (WANDB_SILENT is set later)
    loaded_here = getattr(setup, "settings_if_loaded", False) is None
    try:
        host = setup.settings.base_url
        found = wbauth.authenticate_session(host=host, source="fp8state", prompt=False, update_session=False)
    except TypeError:  # an authenticate_session of another signature: wandb.init answers
        return
    except (wandb.errors.Error, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"telemetry.wandb='online': W&B cannot use its credentials or server setting ({reason}); fix them or "
            "run `wandb login`, or pass telemetry.wandb=offline (`wandb sync` uploads the run later)"
        ) from None
    finally:
        if loaded_here:
            wandb.teardown()
    if found is None:
        raise ConfigError(
            f"telemetry.wandb='online' needs a W&B API key for {host}, and W&B finds none (no WANDB_API_KEY, no "
            f"netrc entry for {urlparse(host).netloc}): run `wandb login` or set WANDB_API_KEY, or pass "
            "telemetry.wandb=offline (the run is kept under RUN_DIR/wandb; `wandb sync` uploads it later)"
        )
