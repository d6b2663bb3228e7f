"""Every error type of the package (imports nothing from the package).

The input errors are ``ValueError`` subclasses and name the field and the offending value:
  * :class:`StepError`: a step, block table or rank coordinate that cannot be served safely
    (checked once per step in the metadata builder, :mod:`cp_attention.metadata.checks`);
  * :class:`AttentionLayerError`: a forward call whose tensors do not match the metadata, the
    layer or each other (checked once per call, :mod:`cp_attention.impl.checks`);
  * :class:`OpsInputError`: arguments of an attention primitive that do not fit together
    (:mod:`cp_attention.ops.checks`).
:class:`StepMismatchError` (a ``RuntimeError``) reports ranks that planned different steps;
:class:`KernelFallbackError` (a ``RuntimeError``) a kernel op handed a call it does not take
while ``CP_ATTENTION_STRICT_OPS`` forbids the fallback to the reference ops.
"""
from __future__ import annotations


class StepError(ValueError):
    """A step, block table or rank coordinate that cannot be served safely."""


class AttentionLayerError(ValueError):
    """A forward call that cannot be served (bad buffers, shapes or unsupported options)."""


class OpsInputError(ValueError):
    """Arguments of an attention primitive that do not fit together."""


class StepMismatchError(RuntimeError):
    """Ranks of one group hold different steps."""


class KernelFallbackError(RuntimeError):
    """A kernel op cannot take a call and ``CP_ATTENTION_STRICT_OPS`` forbids its fallback."""
