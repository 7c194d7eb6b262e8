"""Serving: the step API host engines embed, and BatchEngine, the reference host built from it.

* :mod:`vlmspec.serving.steps`: :class:`SpecDecoder` (``start`` / ``propose`` / ``plan`` /
  ``accept``), :class:`SpecRequest`, :class:`VerifyPlan`, :class:`Acceptance`.
* :mod:`vlmspec.serving.engine`: :class:`BatchEngine` (``add_request`` / ``step`` / ``abort`` /
  ``generate_many``), continuous batching over a ragged target batch: the one host of the
  round (``SpecEngine`` is it with one row).
* :mod:`vlmspec.serving.requests`: a request's creation, prefill and context limits.
"""

from vlmspec.serving.engine import BatchEngine, StepOutput
from vlmspec.serving.steps import Acceptance, SpecDecoder, SpecRequest, VerifyPlan

__all__ = ["Acceptance", "BatchEngine", "SpecDecoder", "SpecRequest", "StepOutput", "VerifyPlan"]
