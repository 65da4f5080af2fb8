"""The ``RestartConfig`` of an unmodified script, read from ``INPROCESS_RESTART_CONFIG``.

An unmodified script has no ``@restartable(...)`` to carry options, so they come as one JSON
object of ``RestartConfig`` fields in the environment (the launcher passes its environment to
every rank), e.g. ``INPROCESS_RESTART_CONFIG='{"active_world_size": 2, "soft_timeout": 30}'``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import ConfigError

CONFIG_ENV = "INPROCESS_RESTART_CONFIG"
_EXAMPLE = '\'{"active_world_size": 2, "soft_timeout": 30}\''


def script_config(environ: Mapping[str, str]) -> RestartConfig:
    """The config in ``environ`` (defaults when unset); ``ConfigError`` names the variable, the
    value and the fix."""
    raw = environ.get(CONFIG_ENV, "").strip()
    if not raw:
        return RestartConfig()
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{CONFIG_ENV} ({raw!r}) is not JSON ({exc}): give an object of RestartConfig "
            f"fields, e.g. {CONFIG_ENV}={_EXAMPLE}"
        ) from None
    if not isinstance(fields, dict):
        raise ConfigError(
            f"{CONFIG_ENV} ({raw!r}) is not a JSON object: give an object of RestartConfig "
            f"fields, e.g. {CONFIG_ENV}={_EXAMPLE}"
        )
    if fields.get("init_process_group", True) is not True:
        raise ConfigError(
            f"{CONFIG_ENV}: init_process_group ({fields['init_process_group']!r}) must stay "
            "true for an unmodified script: its own init_process_group call gets the group the "
            "framework creates each iteration (remove the key)"
        )
    try:
        return RestartConfig(**fields)
    except TypeError as exc:
        raise ConfigError(
            f"{CONFIG_ENV}: {exc}: the keys are the fields of restartable.inprocess.RestartConfig"
        ) from None
