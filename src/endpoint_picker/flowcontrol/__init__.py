"""Flow control: admission under saturation, by priority band, fairness id and deadline.

Off unless the EndpointPickerConfig lists the ``flowControl`` feature gate; see
``controller.py`` for the dispatch order and the outcomes, ``config.py`` for the section.
"""

from endpoint_picker.flowcontrol.config import (
    FEATURE_GATE,
    BandConfig,
    FairnessPolicy,
    FlowControlConfig,
    OrderingPolicy,
    parse_feature_gates,
    parse_flow_control,
)
from endpoint_picker.flowcontrol.controller import DEFAULT_FLOW, FlowController, FlowObserver

__all__ = [
    "DEFAULT_FLOW",
    "FEATURE_GATE",
    "BandConfig",
    "FairnessPolicy",
    "FlowControlConfig",
    "FlowController",
    "FlowObserver",
    "OrderingPolicy",
    "parse_feature_gates",
    "parse_flow_control",
]
