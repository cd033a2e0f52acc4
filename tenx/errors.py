"""Error types. Every message names the file, field or step at fault and what to do about it."""


class TenxError(Exception):
    """Base class for errors tenx reports to the user (the CLI prints them without a traceback)."""


class ConfigError(TenxError):
    """A configuration file or override is invalid."""


class DataError(TenxError):
    """A data source, manifest or shard is missing, malformed or corrupt."""


class CheckpointError(TenxError):
    """A checkpoint is missing, incomplete or fails verification."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint asks for something tenx refuses to load (code, a file outside it): a forgery, not damage."""
