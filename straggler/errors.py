"""The exceptions of the ``straggler`` package: one base class, and bad configuration."""

from __future__ import annotations


class StragglerError(Exception):
    """Base class of every error the ``straggler`` package raises on purpose."""


class ConfigError(StragglerError, ValueError):
    """A detector option is invalid; the message names the field, the value and the fix."""


class SectionError(StragglerError, RuntimeError):
    """A section was misused: entered while already open (nested in itself), or misnamed."""
