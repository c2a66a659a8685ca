//! Errors in OpenAI's JSON shape, with the matching HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrite_core::engine::EngineError;
use serde_json::json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
}

impl ApiError {
    /// A `type` field (of a content part, a format, a tool choice) that is missing or names
    /// something not served; `known` lists what is.
    pub fn unknown_type(what: &str, t: Option<&str>, known: &str) -> Self {
        Self::bad_request(match t {
            Some(t) => format!("{what} of type `{t}` are not supported (only {known})"),
            None => format!("{what} need a string `type` ({known})"),
        })
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "BadRequestError",
            param: None,
        }
    }

    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "NotFoundError",
            param: None,
        }
    }

    pub fn method_not_allowed(method: &axum::http::Method) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("method {method} is not allowed on this route"),
            kind: "MethodNotAllowedError",
            param: None,
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid or missing API key".into(),
            kind: "AuthenticationError",
            param: None,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "ServiceUnavailableError",
            param: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "InternalServerError",
            param: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            e if e.is_client_error() => ApiError::bad_request(e.to_string()),
            EngineError::Dead => ApiError::unavailable(e.to_string()),
            e => ApiError::internal(e.to_string()),
        }
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        ApiError::bad_request(format!("{e:#}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Full queue or shutting down: worth retrying shortly (elsewhere, when draining).
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, 1.into());
        }
        r
    }
}
