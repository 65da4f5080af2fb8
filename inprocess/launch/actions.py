"""What ends a round on every node (``Action``, written once in the control store by whichever
launcher decides: ``JobControl.request``), and the proposal after the in-process path of a
round stopped (``restart_or_end``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from restartable.inprocess.launch.autoresume import EXIT_APPLICATION, EXIT_REQUEUE


@dataclass(frozen=True)
class Action:
    """What ends a round on every node: ``kind`` "restart" (round k+1 follows) or "end"."""

    kind: str
    status: int
    reason: str

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "status": self.status, "reason": self.reason})

    @classmethod
    def from_json(cls, text: str) -> Action:
        d = json.loads(text)
        return cls(kind=d["kind"], status=int(d["status"]), reason=d["reason"])


def restart_or_end(k: int, *, max_restarts: int, reason: str, origin: str = "") -> Action:
    """The proposal after the in-process path of round ``k`` stopped: restart while the budget
    (``--max-restarts``) lasts, else end the job asking for a requeue. A stop of ``origin``
    "application" (the same exception at the same place every time: a bug) ends the job with
    ``EXIT_APPLICATION`` at once: a restart or a requeue would only run into it again."""
    if origin == "application":
        return Action(
            "end",
            EXIT_APPLICATION,
            f"{reason}; an application fault (the same exception at the same place each "
            "time): not restarted and not requeued, fix the code and resubmit",
        )
    if k < max_restarts:
        return Action("restart", 0, reason)
    return Action(
        "end",
        EXIT_REQUEUE,
        f"{reason}; in-job restarts exhausted ({k} of --max-restarts {max_restarts})",
    )
