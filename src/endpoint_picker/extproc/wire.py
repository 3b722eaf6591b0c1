"""Every wire key of the EPP protocol in one place (seed 003)."""

# The header and metadata key carrying the picked endpoint(s): "ip:port[,ip:port...]".
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
# Any client-sent header with this prefix is removed: clients never choose the upstream.
DESTINATION_HEADER_PREFIX = "x-gateway-destination-endpoint"
# The dynamic-metadata namespace the picked endpoint is written under.
LB_NAMESPACE = "envoy.lb"
# The filter-metadata namespace and key of the subset hint Envoy may send.
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# The response-phase metadata key naming the endpoint that actually served the request.
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"

# Set by the shipped Envoy configs (local_reply_config) on the 503 Envoy answers when it could
# not connect to the endpoint the EPP picked: the EPP's passive health signal.
UPSTREAM_FAILURE_HEADER = "x-gateway-upstream-failure"

# The largest gRPC message either ext_proc stack accepts or sends: request bodies arrive in
# chunks, but keep room for large single messages.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

REQUEST_ID_HEADER = "x-request-id"
CONTENT_LENGTH = "content-length"
CONTENT_TYPE = "content-type"

# Envoy's limit on one streamed body mutation is 64 KiB; stay clear of it.
MAX_STREAMED_CHUNK = 62_000

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
