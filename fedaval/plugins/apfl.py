"""APFL (Deng, Kamani and Mahdavi, 2020, "Adaptive Personalized Federated
Learning"): each client mixes a local model with the global one.

Client i keeps, beside the shared model ``w_i`` (trained on its data and
averaged by FedAvg as usual), a personal model ``v_i`` and a mixing weight
``alpha_i``. Its personalised model is the mixture of *parameters*

    ``v_bar_i = alpha_i * v_i + (1 - alpha_i) * w_i``        (Deng et al. 2020, Eq. 3)

and at every local step (Algorithm 1), from the same point as ``w_i``'s own step:

    ``v_i     <- v_i     - eta * grad_v f_i(v_bar_i) = v_i - eta * alpha_i * g``
    ``alpha_i <- alpha_i - eta_alpha * <v_i - w_i, g>``     (Eq. 9), ``g = grad f_i(v_bar_i)``

``alpha_i`` is kept in [0, 1]. The mixture predicts for the client's own
evaluation (A_loc); the global model is FedAvg's.

Readings chosen:

* ``v_i`` starts as the client's model at its first round (the global
  initialisation); it and ``alpha_i`` live for the whole run, across tasks.
* The personal step runs inside ``fedaval_client_loss`` (one per minibatch,
  with its own gradient computed on the personal variables only, ``w_i``
  detached), so ``w_i``'s step is exactly FedAvg's; the personal loss is
  returned as the detached term ``apfl_personal`` so that it is logged (it
  adds no gradient to ``w_i``).
* ``eta`` is the round's learning rate (``--lr``, on ``--lr-schedule``);
  ``eta_alpha`` is ``alpha_lr`` (default: the same).
  The step is taken there, not in ``fedaval_client_step``, because
  Algorithm 1 takes both steps from the same point: after the optimizer
  step ``w_i`` has already moved.
* BatchNorm running statistics of the mixture are the personal model's own.
* Evaluation swaps the mixture into the client's model for the duration of
  the client's evaluation (a ``wrapper=True`` ``fedaval_client_evaluate``)
  and restores ``w_i`` afterwards.
* ``v_i`` and ``alpha_i`` live in ``client.stash``; the round metric
  ``apfl_mean_alpha`` is the mean ``alpha_i`` of the clients sampled that round.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedaval import hookimpl
from fedaval.options import option, refuse_unread, unit_interval
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

PERSONAL = StashKey[tuple]("apfl.personal")  # (parameters, buffers) of v_i
ALPHA = StashKey[float | torch.Tensor]("apfl.alpha")  # the option's float, then a 0-dim float64 tensor


def mix(v, w, alpha):
    """``alpha * v + (1 - alpha) * w``, key by key (Deng et al. 2020, Eq. 3)."""
    return {key: alpha * v[key] + (1 - alpha) * w[key] for key in v}


def alpha_gradient(v, w, grad):
    """``d f(v_bar) / d alpha = sum_j <v_j - w_j, grad_j>`` where ``grad`` is
    ``grad f`` at the mixture (Deng et al. 2020, Eq. 9)."""
    return sum(float(((v[k] - w[k]) * grad[k]).sum()) for k in v)


def personal_step(model, v_params, v_buffers, alpha, x, y, loss_fn, lr, alpha_lr, adaptive=True):
    """One APFL step on the personal variables of a client whose shared model
    is ``model``: the loss of the mixture of parameters on ``(x, y)``, then
    ``v <- v - lr * grad_v``, ``alpha <- clip(alpha - alpha_lr * grad_alpha, 0, 1)``.

    ``v_params`` (leaf tensors) are updated in place and ``v_buffers`` by the
    forward pass; ``model``'s own weights are neither read for gradient nor
    changed. ``alpha`` is a float or a 0-dim tensor. Returns ``(loss, new
    alpha)``, the new alpha a 0-dim float64 tensor on the model's device
    (the same float64 arithmetic as Python floats): nothing in the step waits
    for the GPU. With alpha on the CPU, autograd copied its gradient back to
    the host once per parameter tensor of every minibatch (124 waits a step
    for ResNet-18)."""
    w = {name: p.detach() for name, p in model.named_parameters()}
    alpha = torch.as_tensor(alpha, dtype=torch.float64, device=next(iter(w.values())).device)
    a = alpha.float().requires_grad_(adaptive)
    mixed = {name: a * v_params[name] + (1 - a) * w[name] for name in w}
    loss = loss_fn(functional_call(model, {**mixed, **v_buffers}, (x,)), y)
    inputs = [v_params[name] for name in w] + ([a] if adaptive else [])
    grads = torch.autograd.grad(loss, inputs)
    with torch.no_grad():
        for name, g in zip(w, grads):
            v_params[name].sub_(lr * g)
    if adaptive:
        alpha = (alpha - alpha_lr * grads[-1].double()).clamp(0.0, 1.0)
    return loss.detach(), alpha


class APFL(Plugin):
    """APFL: a personal model per client, mixed with the global model by a learnt alpha."""

    name = "apfl"
    description = "APFL: per-client model v mixed with the global w as alpha*v + (1-alpha)*w, alpha learnt"

    @dataclasses.dataclass
    class Options:
        alpha: float = option(0.5, "initial mixing weight of the personal model", unit_interval)
        adaptive: bool = option(True, "learn alpha by gradient (False: keep it fixed)")
        alpha_lr: float | None = option(
            None, "step size of alpha (None: the run's --lr)", lambda v: None if v is None or v > 0 else "must be > 0"
        )

    @hookimpl
    def fedaval_setup(self, run):
        from fedaval.training import require_sgd

        require_sgd(run.config, "apfl", "Algorithm 1 takes the personal and the global step as SGD steps of --lr")
        refuse_unread("apfl", self.options, [(("alpha_lr",), not self.options.adaptive, "adaptive=false")])

    def _personal(self, client):
        if PERSONAL not in client.stash:
            params = {n: p.detach().clone().requires_grad_(True) for n, p in client.model.named_parameters()}
            buffers = {n: b.detach().clone() for n, b in client.model.named_buffers()}
            client.stash[PERSONAL] = (params, buffers)
            client.stash[ALPHA] = self.options.alpha
        return client.stash[PERSONAL]

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        params, buffers = self._personal(client)
        from fedaval.training import round_lr

        lr = round_lr(run.config, run.round, run.total_rounds)  # the round's (--lr-schedule)
        loss, client.stash[ALPHA] = personal_step(
            client.model,
            params,
            buffers,
            client.stash[ALPHA],
            batch.x,
            batch.y,
            F.cross_entropy,
            lr=lr,
            alpha_lr=self.options.alpha_lr or lr,
            adaptive=self.options.adaptive,
        )
        return {"apfl_personal": loss}

    def personalised_state(self, client) -> dict:
        """The mixture's state_dict for ``client`` (its shared model if it has no personal one yet)."""
        state = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
        if PERSONAL not in client.stash:
            return state
        params, buffers = client.stash[PERSONAL]
        w = {name: state[name] for name in params}
        state.update({k: t.detach() for k, t in mix(params, w, float(client.stash[ALPHA])).items()})
        state.update({k: b.detach().clone() for k, b in buffers.items()})
        return state

    @hookimpl(wrapper=True)
    def fedaval_client_evaluate(self, run, client):
        """The mixture in the client's model while it is evaluated, then ``w`` back."""
        model = client.model
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.personalised_state(client))
        try:
            return (yield)
        finally:
            model.load_state_dict(saved)

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        alphas = [float(run.clients[k].stash[ALPHA]) for k in run.schedule[round - 1] if ALPHA in run.clients[k].stash]
        if not alphas:
            return None
        return {"apfl_mean_alpha": sum(alphas) / len(alphas)}
