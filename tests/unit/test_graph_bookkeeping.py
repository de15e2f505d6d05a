"""The host side of CUDA-graph replays (no GPU needed): the ledger counts a replayed event
like its captured template, refuses to count one event twice, and GraphedStep refuses
inputs it cannot capture with a message naming the argument."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import make_stack, run_events


def test_ledger_replay_counts_the_template_once_per_event():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(n=2, d=16))
    run_events(state, model, [torch.randn(8, 16) for _ in range(2)])
    template = state.ledger.event((1, 0))
    owners = list(template)
    assert owners and all(r.commits == 1 for r in template.values())
    before = {o: state.ledger.commits(o) for o in owners}
    state.ledger.replay((2, 0), template)
    for o in owners:
        assert state.ledger.commits(o) == before[o] + 1
        assert state.ledger.commits(o, (2, 0)) == 1
        assert state.ledger.observations(o, (2, 0)) == template[o].observations
    with pytest.raises(f8s.StateTransitionError, match="already counted"):
        state.ledger.replay((2, 0), template)
    assert state.ledger.ok


def test_graphed_step_refuses_what_it_cannot_capture():
    state = f8s.Fp8State(f8s.QuantConfig())
    with pytest.raises(
        f8s.ConfigError, match=r"state=<object object at .*> is not allowed: expected an Fp8State or None"
    ):
        f8s.GraphedStep(object(), lambda: None)
    if not torch.cuda.is_available():
        with pytest.raises(f8s.ConfigError, match="needs a CUDA device"):
            f8s.GraphedStep(state, lambda x: x, torch.zeros(2))
        return
    with pytest.raises(f8s.ConfigError, match=r"warmup=0 is not allowed"):
        f8s.GraphedStep(state, lambda x: x, torch.zeros(2, device="cuda"), warmup=0)
    with pytest.raises(f8s.ConfigError, match=r"sample_inputs\[0\]: expected a CUDA tensor"):
        f8s.GraphedStep(state, lambda x: x, torch.zeros(2))


def test_graphed_step_and_the_cli_refuse_a_recipe_with_a_graph_problem(monkeypatch, tmp_path, capsys):
    """A recipe that declares a graph problem (none of the shipped ones does since fp8_rowwise's
    op wrappers load the kernels: its graphed run is bitwise its eager run on the H200) is
    refused by GraphedStep and by ``trainer.cuda_graphs=true``, by key, with its reason."""
    from lightning_fp8state.cli.main import main
    from lightning_fp8state.quant_recipes.rowwise import Fp8Rowwise

    state = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_rowwise", backward_format="e4m3"))
    state_ok = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_current"))
    monkeypatch.setattr(Fp8Rowwise, "graph_problem", lambda self: "recipe='fp8_rowwise': a reason")
    with pytest.raises(f8s.ConfigError, match=r"GraphedStep: recipe='fp8_rowwise': a reason"):
        f8s.GraphedStep(state, lambda x: x, torch.zeros(2))
    with pytest.raises(f8s.ConfigError) as other:  # fp8_current passes the recipe check (then: no CUDA here)
        f8s.GraphedStep(state_ok, lambda x: x, torch.zeros(2))
    assert "recipe=" not in str(other.value)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "quant.recipe=fp8_rowwise", "trainer.cuda_graphs=true", "trainer.accelerator=gpu"])
    err = capsys.readouterr().err
    assert code == 2 and "trainer.cuda_graphs=true with quant.recipe='fp8_rowwise' is not allowed" in err, err
    assert "a reason" in err and not (tmp_path / "runs").exists()
