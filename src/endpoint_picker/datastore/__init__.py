"""The live pool and the sources that feed it."""

from endpoint_picker.datastore.objects import (
    ClusterState,
    InferenceModel,
    InferenceObjective,
    InferencePool,
    Pod,
)
from endpoint_picker.datastore.pool import PoolState
from endpoint_picker.datastore.store import Datastore

__all__ = [
    "ClusterState",
    "Datastore",
    "InferenceModel",
    "InferenceObjective",
    "InferencePool",
    "Pod",
    "PoolState",
]
