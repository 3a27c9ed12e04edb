"""Every exception the engine raises on purpose lives here."""


class XMCError(Exception):
    """Base class of the engine's own errors."""


class DatasetFormatError(XMCError, ValueError):
    """A data file is malformed: the message names the file, the line and the offending token."""


class FetchError(XMCError, OSError):
    """A download failed: unreachable server, HTTP error, checksum mismatch or bad archive."""


class ConfigError(XMCError, ValueError):
    """A configuration (file, dict or CLI argument) is invalid: unknown key, bad value or type."""


class DeviceSpecError(XMCError, ValueError):
    """A device specification string such as ``"cpu,cpu@0.5"`` cannot be parsed or satisfied."""


class BackendUnavailableError(XMCError, RuntimeError):
    """A backend was requested that this machine cannot provide (e.g. CUDA without a GPU)."""


class CheckpointError(XMCError, ValueError):
    """A checkpoint or model folder is missing, truncated, corrupted or of the wrong version."""


class MemoryPlanError(XMCError, RuntimeError):
    """A run does not fit on its devices; the message gives a setting that fits."""


class DivergenceError(XMCError, RuntimeError):
    """Every replica produced non-finite parameters or loss; training cannot continue."""


class DeviceFailure(XMCError, RuntimeError):
    """A device worker failed (raised, or was made to fail by fault injection)."""


class InjectedFault(XMCError, RuntimeError):
    """Raised in a device worker by fault injection (``XMC_FAULT``, :mod:`xmc_engine.faults`)."""


class TrainingInterrupted(XMCError):
    """Training stopped on SIGINT / SIGTERM after writing a checkpoint; ``signum`` is the signal
    and ``returncode`` the conventional exit status (``128 + signum``: 130, 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = int(signum)
        self.returncode = 128 + int(signum)


class DistributedError(XMCError, RuntimeError):
    """A multi-node run cannot go on: MPI missing, a node failed, or a collective timed out."""


class DataMismatchError(XMCError, ValueError):
    """Inputs that must agree do not: a test set, or the data given to a saved model, has another
    number of features or labels; the message names both files and both counts."""


class RunFolderBusy(XMCError, RuntimeError):
    """The run folder is held by another live run (its lock file names the pid and the host)."""


class SaveError(XMCError, OSError):
    """A result could not be written (disk full, no permission); nothing half-written is left, and
    the message says where the last good copy is."""
