"""The example's checkpointed state: model, optimizer, re-run machine and step as one Stateful."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from rerun import RerunStateMachine


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

    def _model_and_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """torch's ``get_state_dict``, reused while it still describes the live tensors.

        It costs about 3 ms here (FQN mapping), most of a local save made at every step. Its
        dicts reference the live parameters and optimizer states, which training updates in
        place, so they stay valid until a tensor is replaced (optimizer state created or
        loaded, a parameter re-assigned): the identity check below notices that and rebuilds.
        Hyperparameters (plain floats, e.g. a scheduled lr) are copied fresh every time.
        """
        live = (
            *((id(t), _ptr(t)) for t in self.model.parameters()),
            *((id(t), _ptr(t)) for t in self.model.buffers()),
            *(
                (id(v), _ptr(v))
                for st in self.opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            ),
        )
        if self._cached is None or self._cached[0] != live:
            self._cached = (live, *get_state_dict(self.model, self.opt))
        _, model_sd, optim_sd = self._cached
        for cached, group in zip(optim_sd["param_groups"], self.opt.param_groups, strict=True):
            cached.update((k, v) for k, v in group.items() if k != "params")
        return model_sd, optim_sd

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
