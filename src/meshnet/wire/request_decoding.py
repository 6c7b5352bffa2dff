"""gRPC requests whose bytes do not parse as their message: INVALID_ARGUMENT, like every other bad input.

grpcio parses a request with the method's deserializer before any handler runs, and when that raises it
answers INTERNAL ("Exception deserializing request!") and logs a traceback: a client's garbage would read
as the server's fault. :class:`RequestDecodingInterceptor` gives every method a deserializer that keeps
the failure instead, and the handler then refuses the call with INVALID_ARGUMENT naming the method and
the message type.
"""

from __future__ import annotations

from typing import Callable

import grpc


class _Undecodable:
    """What a request that did not parse becomes: the parser's complaint."""

    def __init__(self, error: str) -> None:
        self.error = error


def _keeping_failures(deserializer: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def decode(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any parser failure is the client's bad bytes
            return _Undecodable(f"{type(e).__name__}: {e}")
    return decode


class RequestDecodingInterceptor(grpc.ServerInterceptor):
    """Refuse a request (or a message of a request stream) that does not parse, with INVALID_ARGUMENT:
    "<method>: the request is not a valid <message type> (<parser's error>)". Other calls pass unchanged."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        message_class = getattr(handler.request_deserializer, "__self__", None)  # Msg.FromString's class
        kind = message_class.DESCRIPTOR.full_name if hasattr(message_class, "DESCRIPTOR") else "message"

        def refuse(request, context) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method}: the request is not a valid {kind} ({request.error})")

        def unary(behavior):
            def run(request, context):
                if isinstance(request, _Undecodable):
                    refuse(request, context)
                return behavior(request, context)
            return run

        def streaming(behavior):
            def checked(requests, context):
                for request in requests:
                    if isinstance(request, _Undecodable):
                        refuse(request, context)
                    yield request
            return lambda requests, context: behavior(checked(requests, context), context)

        decode = _keeping_failures(handler.request_deserializer)
        out = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), decode, out)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(unary(handler.unary_stream), decode, out)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(streaming(handler.stream_unary), decode, out)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), decode, out)
