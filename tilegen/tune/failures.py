"""Failure classes of a tuning trial: an exception (or a dead worker) mapped to compile_error,
out_of_resources, fail_correctness, timeout, illegal_memory_access or runtime_error."""

from __future__ import annotations

import traceback

#: Failure classes of a trial (the DB's trial statuses, less "pass" and "pruned").
FAILURE_CLASSES: tuple[str, ...] = (
    "compile_error",
    "out_of_resources",
    "fail_correctness",
    "timeout",
    "illegal_memory_access",
    "runtime_error",
)


# Substrings (lower case) of error messages, by class. Type checks come first (see classify).
# (Not bare "device-side assert": torch appends "to enable device-side assertions" to every
# CUDA error.)
_IMA_MARKERS = ("illegal memory access", "illegal address", "misaligned address",
                "unspecified launch failure", "device-side assert triggered",
                "memory access fault", "illegal instruction", "invalid address space",
                "global/shared address space", "hiperrorillegaladdress",
                "cudaerrorillegaladdress", "cudaerrorinvalidaddressspace")

_OOR_MARKERS = ("out of resource", "out of memory", "outofresources",
                "too many resources requested", "cudaerrorlaunchoutofresources")

_COMPILE_MARKERS = ("ptxas", "passmanager", "compilationerror", "mlir", "llvm error",
                    "failed to compile", "lld:", "hsaco")
# After one of these the CUDA/HIP context may be unusable: the worker restarts.
_CONTEXT_MARKERS = ("cuda error", "hip error", "triton error [cuda]", "triton error [hip]",
                    "acceleratorerror", "cublas_status", "cudnn_status")

_MAX_TEXT = 8000


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _qualname(exc: BaseException) -> str:
    t = type(exc)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _clip(text: str, limit: int = _MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


def classify(exc: BaseException) -> tuple[str, str, str]:
    """Map an exception raised by a trial to ``(failure class, exception type, message)``.

    Types first, then messages (CUDA errors reach Python as RuntimeError/AcceleratorError with
    the driver's text):

    - ``timeout``: TimeoutError;
    - ``out_of_resources``: Triton's OutOfResources (shared memory / registers over the
      limit), torch.OutOfMemoryError, or such a message;
    - ``illegal_memory_access``: an illegal/misaligned address, a launch failure, a
      device-side assert (the context is lost with it);
    - ``compile_error``: Triton's CompilationError / CompileTimeAssertionFailure / PTXASError,
      the interpreter's InterpreterError around a semantic error (a ValueError such as
      "arange's range must be a power of 2"), or an MLIR/LLVM/ptxas failure message;
    - ``runtime_error``: anything else.
    """
    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    text = "\n".join(f"{_qualname(e)}: {e}" for e in chain)
    low = text.lower()
    message = _clip(text + "\n\n" + "".join(traceback.format_exception(exc))[-4000:])
    kind = _qualname(exc)
    if any(isinstance(e, TimeoutError) for e in chain):
        return "timeout", kind, message
    if names & {"OutOfResources", "OutOfMemoryError"}:
        return "out_of_resources", kind, message
    if any(m in low for m in _IMA_MARKERS):
        return "illegal_memory_access", kind, message
    if names & {"CompilationError", "CompileTimeAssertionFailure", "PTXASError"}:
        return "compile_error", kind, message
    if "InterpreterError" in names and any(
            isinstance(e, ValueError | TypeError | AssertionError | NotImplementedError)
            for e in chain):
        return "compile_error", kind, message
    if any(m in low for m in _OOR_MARKERS):
        return "out_of_resources", kind, message
    if any(m in low for m in _COMPILE_MARKERS):
        return "compile_error", kind, message
    return "runtime_error", kind, message


def poisons_context(status: str, text: str | None) -> bool:
    """True when the worker's CUDA/HIP context may be unusable after this failure."""
    low = (text or "").lower()
    return status == "illegal_memory_access" or any(m in low for m in _CONTEXT_MARKERS)
