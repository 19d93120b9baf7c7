"""Errors the engine raises on bad input; each names the thing at fault."""


class MoERuntimeError(Exception):
    """Base class of every error this runtime raises on purpose."""


class CheckpointError(MoERuntimeError):
    """A checkpoint directory is missing a file, a tensor, or holds a tensor of the wrong shape."""


class UnsupportedArchitectureError(MoERuntimeError):
    """config.json names an architecture this runtime does not implement."""


class InvalidRequestError(MoERuntimeError, ValueError):
    """A request or sampling parameter is out of range; the message names the parameter."""


class EngineDeadError(MoERuntimeError):
    """A worker process of the engine died; the message names the rank."""
