"""tilegen: a code generator and autotuner for block-sparse attention kernels in video DiTs.

    import tilegen
    op = tilegen.load(tilegen.Spec())
    o, lse = op(q, k, v, topk_idx, vbs)
"""

__version__ = "0.1.0"

from tilegen.config import KernelConfig  # noqa: E402
from tilegen.spec import Spec  # noqa: E402


def load(spec: "Spec | None" = None, config: "KernelConfig | None" = None, **kwargs):  # noqa: ANN201
    """The kernel for `spec` on the current device; see `tilegen.ops.load` for the keywords
    (`target`, `backend`) and the returned op types."""
    from tilegen.ops import load as _load

    return _load(spec, config, **kwargs)


#: submodules reachable as attributes after a bare ``import tilegen`` (the contract writes
#: ``tilegen.ops.video_sparse_attention``), imported on first use: torch only when asked for
_LAZY_SUBMODULES = ("ops", "sparsity", "layout", "captures", "quant", "vsa", "encodings")


def __getattr__(name: str):  # noqa: ANN202
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"tilegen.{name}")
    raise AttributeError(f"module 'tilegen' has no attribute {name!r}")


__all__ = ["KernelConfig", "Spec", "__version__", "load"]
