//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a matching status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, …
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self { param: Some(param.to_string()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    /// 400 about the request as a whole (malformed JSON, invalid UTF-8).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("The model `{model}` does not exist"))
        }
    }

    pub fn context_exceeded(message: impl Into<String>, param: &str) -> Self {
        Self::invalid(param, message).with_code("context_length_exceeded")
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Incorrect or missing API key (send `Authorization: Bearer KEY`)",
        )
        .with_code("invalid_api_key")
    }

    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body is larger than {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("Unknown endpoint `{path}`"))
            .with_code("unknown_url")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "Method not allowed for this endpoint")
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).with_code("server_overloaded")
    }

    /// 503 while the model loads; the client may retry.
    pub fn loading() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "The model is loading; retry shortly")
            .with_code("model_loading")
    }

    pub fn shutting_down() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "The server is shutting down")
            .with_code("server_shutting_down")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "The body must be JSON (Content-Type: application/json)",
        )
    }

    /// The JSON object (also sent as an SSE event when a stream fails midway).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, self.body().to_string()).into_response();
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}
