"""One error tree for the whole app. Messages name the check and the values."""

import contextlib
import errno
from collections.abc import Iterator


class DFlashError(Exception):
    """Base of every error this package raises on purpose."""

    code = "dflash_error"


class CheckpointError(DFlashError):
    """A drafter or target directory is missing, partial, corrupt or of an unknown kind."""

    code = "bad_checkpoint"


class IncompatiblePairError(DFlashError):
    """A drafter cannot run with this target; `reasons` lists every failed check."""

    code = "incompatible_pair"

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("drafter does not fit target: " + "; ".join(self.reasons))


class ModelNotFoundError(DFlashError):
    """A model name resolves to nothing local, and the hub cannot be reached or has no such repo."""

    code = "model_not_found"


class PromptTooLongError(DFlashError):
    """The prompt (plus the tokens asked for) does not fit the target's context; the counts,
    where known, let an API word it as its official clients parse it."""

    code = "context_length_exceeded"

    def __init__(self, message: str, prompt_tokens: int | None = None,
                 max_tokens: int | None = None, max_context: int | None = None):
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context


class EngineUnavailableError(DFlashError):
    """An engine's package is not installed or cannot run on this machine."""

    code = "engine_unavailable"


class InvalidRequestError(DFlashError):
    """A request's parameters are out of range or inconsistent."""

    code = "invalid_request"


class MaxBatchError(InvalidRequestError):
    """`--max-batch` is below 1 or more generations than memory holds: refused at start."""


class GenerationCancelled(DFlashError):
    """The consumer stopped the generation (disconnect, Esc)."""

    code = "cancelled"


class StorageError(DFlashError):
    """A file this program keeps cannot be written (a read-only or full disk); what was there
    before is left as it was."""

    code = "storage_unavailable"


UNWRITABLE_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """A read-only or full disk's OSError inside as a StorageError: `what` failed, and how to
    mend it; other OSErrors pass as they are."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in UNWRITABLE_ERRNOS:
            raise
        raise StorageError(f"{what} ({exc.strerror or exc}): free some space there, or set "
                           f"DFLASH_LOCAL_HOME to a folder that can be written") from None


class ModelTooLargeError(DFlashError):
    """A pair cannot fit the memory the engine may use here: refused before any weight is read."""

    code = "model_too_large"


class SettingsError(DFlashError):
    """A settings dataclass holds a value out of its range: refused where it is made."""

    code = "bad_settings"


def check_fields(settings, rules: dict[str, tuple]) -> None:
    """SettingsError naming the first field of `settings` whose value fails its rule
    (`rules`: field -> (predicate, what the value must be))."""
    for name, (holds, must_be) in rules.items():
        value = getattr(settings, name)
        try:
            holds_here = bool(holds(value))
        except TypeError:  # a value of another type altogether
            holds_here = False
        if not holds_here:
            raise SettingsError(f"{type(settings).__name__}.{name} must be {must_be}, got {value!r}")
