"""Captures: the tensors kernels are scored on.

A capture is a dict with ``q, k, v`` ``(B, S, H, D)`` (cube-major padded, BSHD), ``topk_idx``
``(B, H, NQ, TOPK)`` int32, ``vbs`` ``(NKV,)`` int32, optional metadata (``call``, ``step``,
``block``, ...) and, when a ground truth is bundled, ``o_ref`` ``(B, S, H, D)`` and ``lse_ref``
``(B, H, S)`` fp32 (base-2 log-sum-exp).

Three modules, one job each; this package re-exports their public names, so
``tilegen.captures.load/save/synthesize/score`` are spelled as the contract writes them:

- `tilegen.captures.files`: `load`, `save`, `validate` (both on-disk spellings, checksums,
  damaged files as ValueError naming the path);
- `tilegen.captures.synthesis`: `synthesize`, `synthesize_for`, `for_spec`;
- `tilegen.captures.scoring`: the contract's scoring rule `score`, the gradient rule
  `grad_score` and the quantized rule `quant_score`.
"""

from __future__ import annotations

from tilegen.captures.files import (
    CHECKSUM_KEY,
    load,
    save,
    validate,
)
from tilegen.captures.scoring import (
    COS_MIN,
    GRAD_COS_MIN,
    GRAD_MAX_REL,
    MAX_ABS,
    MEAN_ABS,
    QUANT_COS_MIN,
    QUANT_EMUL_RATIO,
    QUANT_HEAD_COS_MIN,
    QUANT_REL_L1_MAX,
    GradScore,
    QuantScore,
    Score,
    grad_score,
    quant_score,
    score,
)
from tilegen.captures.synthesis import (
    V_BOUND,
    for_spec,
    synthesize,
    synthesize_for,
)

__all__ = [
    "CHECKSUM_KEY",
    "COS_MIN",
    "GRAD_COS_MIN",
    "GRAD_MAX_REL",
    "GradScore",
    "MAX_ABS",
    "MEAN_ABS",
    "QUANT_COS_MIN",
    "QUANT_EMUL_RATIO",
    "QUANT_HEAD_COS_MIN",
    "QUANT_REL_L1_MAX",
    "QuantScore",
    "Score",
    "V_BOUND",
    "for_spec",
    "grad_score",
    "load",
    "quant_score",
    "save",
    "score",
    "synthesize",
    "synthesize_for",
    "validate",
]
