"""Serving: the step API host engines embed, and BatchEngine, the reference host built from it.

* :mod:`vlmspec.serving.steps`: :class:`SpecDecoder` (``start`` / ``propose`` / ``plan`` /
  ``accept``), :class:`SpecRequest`, :class:`VerifyPlan`, :class:`Acceptance`.
* :mod:`vlmspec.serving.engine`: :class:`BatchEngine` (``add_request`` / ``step`` / ``abort`` /
  ``generate_many``), continuous batching over a ragged target batch.
"""

from vlmspec.serving.steps import Acceptance, SpecDecoder, SpecRequest, VerifyPlan

__all__ = ["Acceptance", "BatchEngine", "SpecDecoder", "SpecRequest", "StepOutput", "VerifyPlan"]


def __getattr__(name: str):
    # BatchEngine imports vlmspec.engine, which imports the step API from this package: load it on first use.
    if name in ("BatchEngine", "StepOutput"):
        from vlmspec.serving import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'vlmspec.serving' has no attribute {name!r}")
