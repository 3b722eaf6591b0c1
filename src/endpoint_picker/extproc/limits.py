"""The process-wide admission limits (``BodyBudget``, ``StreamSlots``) now live in ``session``,
with what else both ext_proc servers share; this name stays for the imports that use it."""

from __future__ import annotations

from endpoint_picker.extproc.session import BUDGET_FULL, BodyBudget, StreamSlots

__all__ = ["BUDGET_FULL", "BodyBudget", "StreamSlots"]
