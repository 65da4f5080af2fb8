"""The example's checkpointed state: model, optimizer, re-run machine and step as one Stateful."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from restartable.rerun import RerunStateMachine


class TrainState(Stateful):
    """Everything a restart restores: model, optimizer, re-run machine, step."""

    def __init__(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer, rsm: RerunStateMachine, rank: int
    ):
        self.model, self.opt, self.rsm = model, opt, rsm
        # The re-run machine's state differs per rank: a rank-specific key keeps torch_dist's
        # de-duplication of identical keys from saving rank 0's copy for everyone.
        self.rerun_key = f"rerun_rank{rank}"
        self.step = 0
        # The last step's loss (a tensor while training; a float once restored): a run restored
        # at its final step trains no step, yet reports the loss it had reached.
        self.loss: torch.Tensor | float = float("nan")
        self._cached: tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]] | None = None
        self._buffers: list[torch.Tensor] = []  # the model's buffers when the cache was built

    def _model_and_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """torch's ``get_state_dict``, reused while it still describes the live tensors.

        It costs about 3 ms here (FQN mapping), most of a local save made at every step. Its
        dicts reference the live parameters and optimizer states, which training updates in
        place, so they stay valid until a tensor is replaced (optimizer state created or
        loaded, a parameter's data swapped): the check of ``_live`` notices that and rebuilds.
        Hyperparameters (plain floats, e.g. a scheduled lr) are copied fresh every time.
        """
        live = self._live()
        if self._cached is None or self._cached[0] != live:
            self._buffers = list(self.model.buffers())
            self._cached = (self._live(), *get_state_dict(self.model, self.opt))
        _, model_sd, optim_sd = self._cached
        for cached, group in zip(optim_sd["param_groups"], self.opt.param_groups, strict=True):
            cached.update((k, v) for k, v in group.items() if k != "params")
        return model_sd, optim_sd

    def _live(self) -> tuple[Any, ...]:
        """What the cached dicts depend on: the optimizer's parameters (identity and data), its
        state tensors (identity) and the model's buffers (data). Read from the optimizer's own
        lists, not ``model.parameters()``: a walk of the module tree costs 0.1 ms a call here.
        A buffer attribute re-assigned to a new tensor after the cache was built is not seen:
        call ``load_state_dict`` or set ``_cached = None`` after such a change."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        states = [v for st in self.opt.state.values() for v in st.values()]
        return (*map(id, params), *map(_ptr, params), *map(id, states), *map(_ptr, self._buffers))

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._model_and_optim()
        return {
            "model": model_sd,
            "optim": optim_sd,
            self.rerun_key: self.rsm.state_dict(),
            "step": self.step,
            "loss": float(self.loss),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._cached = None
        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.rsm.load_state_dict(sd[self.rerun_key])
        self.step = int(sd["step"])
        self.loss = float(sd.get("loss", float("nan")))


def _ptr(t: torch.Tensor) -> int:
    """Where a tensor's data lives; a DTensor (FSDP2, TP) has it in its local shard."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return int(t.to_local().data_ptr())
    return int(t.data_ptr())
