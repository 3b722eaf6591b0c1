"""The Kubernetes source: the only package that imports a Kubernetes client (lightkube).

``KubernetesSource`` watches the InferencePool, its InferenceModels and the namespace's Pods and
feeds the datastore the same ``ClusterState`` the pool file does; ``LeaderElector`` holds a Lease
for active-passive HA; ``KubernetesAccessReviewer`` asks the API server whether a bearer token
may read a path of the metrics port (TokenReview, then SubjectAccessReview).
"""

from endpoint_picker.datastore.sources.kubernetes.access import KubernetesAccessReviewer
from endpoint_picker.datastore.sources.kubernetes.leader import LeaderElector, default_identity
from endpoint_picker.datastore.sources.kubernetes.source import (
    KubernetesSource,
    build_client,
    load_kube_config,
)

__all__ = [
    "KubernetesAccessReviewer",
    "KubernetesSource",
    "LeaderElector",
    "build_client",
    "default_identity",
    "load_kube_config",
]
