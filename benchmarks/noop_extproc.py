"""The throughput floor: a grpc.aio ext_proc that does no work beyond the protocol's minimum.

Full duplex: silent on request headers, then a headers response naming the next endpoint
(round robin, no parsing) and the body streamed back; response chunks echoed at once.
Run: .venv/bin/python benchmarks/noop_extproc.py --port 9102 --endpoints 127.0.0.2:8000,...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2


class NoopStream:
    """One stream's answers, message by message (what the EPP's ``RequestStream`` does, minus
    the parsing, the scheduling and the bookkeeping)."""

    queued = False  # never waits in flow control
    finished = False  # Envoy ends the stream
    request_id = ""

    def __init__(self, targets: Iterator[str]) -> None:
        self._targets = targets
        self._body = bytearray()

    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_body":
            self._body += message.request_body.body
            if not message.request_body.end_of_stream:
                return []
            target = next(self._targets)
            metadata = struct_pb2.Struct()
            metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": target}})
            return [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(
                        response=pb.CommonResponse(
                            clear_route_cache=True,
                            header_mutation=pb.HeaderMutation(
                                set_headers=[
                                    base_pb2.HeaderValueOption(
                                        header=base_pb2.HeaderValue(
                                            key="x-gateway-destination-endpoint",
                                            raw_value=target.encode(),
                                        )
                                    )
                                ]
                            ),
                        )
                    ),
                    dynamic_metadata=metadata,
                ),
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(
                        response=pb.CommonResponse(
                            body_mutation=pb.BodyMutation(
                                streamed_response=pb.StreamedBodyResponse(
                                    body=bytes(self._body), end_of_stream=True
                                )
                            )
                        )
                    )
                ),
            ]
        if kind == "response_headers":
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if kind == "response_body":
            chunk = message.response_body
            return [
                pb.ProcessingResponse(
                    response_body=pb.BodyResponse(
                        response=pb.CommonResponse(
                            body_mutation=pb.BodyMutation(
                                streamed_response=pb.StreamedBodyResponse(
                                    body=chunk.body, end_of_stream=chunk.end_of_stream
                                )
                            )
                        )
                    )
                )
            ]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def close(self) -> None:
        pass


class Noop(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, endpoints: list[str]) -> None:
        self._targets = itertools.cycle(endpoints)

    def new_stream(self) -> NoopStream:
        return NoopStream(self._targets)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: object
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = self.new_stream()
        async for message in request_iterator:
            for response in stream.handle(message):
                yield response


async def serve(port: int, endpoints: list[str]) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(endpoints), server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set(
        "envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()
    asyncio.run(serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
