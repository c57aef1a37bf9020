//! A command's result, as the node reports it to its gateway and records it
//! in its command log.

use serde::{Deserialize, Serialize};

/// A command's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub ok: bool,
    pub detail: String,
    pub output: serde_json::Value,
}

impl Outcome {
    /// A failure, with why.
    pub fn failed(detail: impl Into<String>) -> Outcome {
        Outcome {
            ok: false,
            detail: detail.into(),
            output: serde_json::Value::Null,
        }
    }
}
