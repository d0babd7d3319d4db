"""The daemon's stable error codes as HTTP: a status, and OpenAI's error object.

OpenAI clients read `{"error": {"message", "type", "code"}}`; `code` is the daemon's own
stable code (docs/protocol.md) or one of the few that only HTTP has (below), so a client of
either front end sees the same names.
"""

from __future__ import annotations

from npud.protocol import ApiError, ErrorCode

# codes that only the HTTP front end uses (docs/http.md)
UNAUTHORIZED = "unauthorized"  # TCP with a bearer token configured, and a missing or wrong one
METHOD_NOT_ALLOWED = "method_not_allowed"
REQUEST_TOO_LARGE = "request_too_large"  # a body over limits.max_line_bytes
REQUEST_TIMEOUT = "request_timeout"  # a request that did not arrive within server.line_timeout_s

STATUS = {
    ErrorCode.BAD_REQUEST: 400, ErrorCode.LINE_TOO_LONG: 413, ErrorCode.UNKNOWN_METHOD: 404,
    ErrorCode.NOT_FOUND: 404, ErrorCode.FORBIDDEN: 403, ErrorCode.OVERLOADED: 429,
    ErrorCode.PROMPT_TOO_LONG: 400, ErrorCode.FIM_UNSUPPORTED: 400,
    ErrorCode.DEVICE_QUARANTINED: 503, ErrorCode.MODEL_ERROR: 500,
    ErrorCode.UNSUPPORTED: 400, ErrorCode.STORE_FULL: 507, ErrorCode.STORE_READONLY: 503,
    ErrorCode.STORE_ERROR: 503, ErrorCode.SHUTTING_DOWN: 503, ErrorCode.INTERNAL_ERROR: 500,
    UNAUTHORIZED: 401, METHOD_NOT_ALLOWED: 405, REQUEST_TOO_LARGE: 413, REQUEST_TIMEOUT: 408,
    ErrorCode.MODEL_IN_USE: 409,
}

# OpenAI's error types, by status
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error", 409: "conflict_error",
         413: "invalid_request_error", 429: "rate_limit_error"}


def status_of(code: str) -> int:
    """The HTTP status of a daemon error code (500 for a code this table does not know)."""
    return STATUS.get(code, 500)


def error_body(exc: ApiError) -> dict:
    """OpenAI's error object for `exc`."""
    status = status_of(exc.code)
    return {"error": {"message": exc.message, "type": TYPES.get(status, "server_error"), "code": exc.code}}
