"""FedAvg-FT and FedProx-FT: FedAvg / FedProx whose global model is fine-tuned on each client.

The baselines of pFedSOP (Sen & Mohan, 2025, arXiv:2506.07159, §V-B2): "the global model (of
FedAvg or FedProx) is fine-tuned using local data before being used as the initial model for
local training".

Each sampled client fine-tunes the received global model x with ``finetune_steps`` steps of the
run's optimiser (fresh state) on its task loss, giving x_n^FT, its personalised model; FedAvg's
(FedProx's) E local steps then start from x_n^FT, and the client sends Δ_n = x − θ_n^E, the
change from the model it received (fine-tuning included). The server is FedAvg's.

Choices where the paper is silent:

* The fine-tuning minimises the task loss alone, for FedProx-FT too (the proximal pull of the
  local steps is anchored at the received x as in FedProx); the paper's one local epoch gives
  the default length (None: the run's local steps / epochs, ``ctx.steps_for``).
* Evaluation (``evaluate="finetune"``, the default): the protocol of §V-B2 fine-tunes the
  *current* global model on each client's data and tests that. At every evaluation each
  evaluated client fine-tunes x with the same ``finetune_steps`` steps (fresh optimiser state,
  minibatches from its evaluation stream, so its training draws are untouched) and is tested
  with the result; nothing is kept. ``evaluate="last"`` is a lookup instead: the x_n^FT of the
  client's last participation (state ``ft``), which at low participation can be many rounds
  old (the global model for a client never sampled); cheaper, not the paper's protocol.
* ``finetune_steps=0`` is FedAvg / FedProx exactly (nothing stored, same draws; tested).
"""

from __future__ import annotations

from typing import Annotated

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.algorithms.fedprox import FedProx
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states


class _FineTune:
    """Fine-tune the received model, then the parent's local steps from it (see module)."""

    finetune_steps: int | None
    evaluate: str

    def _check(self, finetune_steps: int | None, evaluate: str) -> None:
        if evaluate not in ("finetune", "last"):
            raise ValueError(f"evaluate={evaluate!r}: expected 'finetune' or 'last'")
        self.finetune_steps, self.evaluate = finetune_steps, evaluate
        self.eval_with_data = evaluate == "finetune" and finetune_steps != 0

    def _steps(self, ctx: Context, cohort: Cohort) -> int:
        return ctx.cohort_steps(cohort) if self.finetune_steps is None else self.finetune_steps

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Fine-tune x → x^FT (kept as ``ft``), E local steps from x^FT; send x − θ^E."""
        assert isinstance(model_in, torch.Tensor)
        steps = self._steps(ctx, cohort)
        if steps == 0:
            return super().client_update(ctx, model_in, states, cohort)  # type: ignore[misc]
        ft = ctx.train(model_in, cohort, steps=steps)
        opt = ctx.optimizer
        local = ctx.train(
            ft.params,
            cohort,
            objective=self.objective(ctx, model_in.detach()),  # type: ignore[attr-defined]
            opt_states=opt.load(states),
        )
        new_states = unstack_states(states, opt, local.opt_state, ft=ft.params)
        metrics = {"train_loss": local.loss, "finetune_loss": ft.loss}
        return CohortResult(model_in - local.params, new_states, metrics)

    def eval_models(
        self, ctx: Context, server: State, states: list[State], cohort: Cohort
    ) -> torch.Tensor:
        """The current global model fine-tuned on each client's data (§V-B2's protocol)."""
        x = server["x"].repeat(len(cohort), 1)
        return ctx.train(x, cohort, steps=self._steps(ctx, cohort)).params

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """``evaluate="last"``: the fine-tuned model of each client's last round (else x).

        The global model expanded where none of ``clients`` has fine-tuned yet (one host read
        of the mask: a shared vector is evaluated as one plain pass).
        """
        x = server["x"]
        has = states.present.get("ft")
        if "ft" not in states or (has is not None and not bool(has.any())):
            return x.expand(len(clients), *x.shape)
        ft = states.stack("ft")
        return ft if has is None else torch.where(has[:, None], ft, x.to(ft))


class FedAvgFT(_FineTune, FedAvg):
    """FedAvg-FT. Persists per client: ``ft`` (x^FT of its last round) and ``opt.*``.

    Args:
        finetune_steps: fine-tuning steps per round (None: the run's local steps / epochs,
            the paper's one epoch; 0: FedAvg).
        server_lr: as FedAvg.
        weighting: as FedAvg.
        evaluate: "finetune" (the current global model fine-tuned on the client's data,
            §V-B2) or "last" (the fine-tuned model of its last participation).
    """

    def __init__(
        self,
        finetune_steps: Annotated[int, Range(ge=0, note="0: FedAvg")] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
        evaluate: str = "finetune",
    ) -> None:
        super().__init__(server_lr, weighting)
        self._check(finetune_steps, evaluate)


class FedProxFT(_FineTune, FedProx):
    """FedProx-FT. Persists per client: ``ft`` (x^FT of its last round) and ``opt.*``.

    Args:
        mu: proximal strength μ ≥ 0 of the local steps (as FedProx).
        finetune_steps: as FedAvgFT (0: FedProx).
        server_lr: as FedAvg.
        weighting: as FedAvg.
        evaluate: as FedAvgFT.
    """

    def __init__(
        self,
        mu: NonNegative = 0.01,
        finetune_steps: Annotated[int, Range(ge=0, note="0: FedProx")] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
        evaluate: str = "finetune",
    ) -> None:
        super().__init__(mu, server_lr, weighting)
        self._check(finetune_steps, evaluate)
