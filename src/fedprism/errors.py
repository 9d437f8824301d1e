"""Errors a user can act on. Each names the field, the value and what is allowed."""

from __future__ import annotations


class FedPrismError(Exception):
    """Base class for errors caused by user input or missing resources (printed without traceback)."""


class ConfigError(FedPrismError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config key '{key}' = {value!r} is not valid: {allowed}")


class DataError(FedPrismError):
    """A dataset is missing, truncated, corrupt or fails its checksum."""


class PartitionError(FedPrismError, ValueError):
    """A partition request is impossible (too many clients, bad alpha, ...)."""
