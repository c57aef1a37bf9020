//! Billing weights: what an hour of each GPU class counts for in usage
//! reports (`usage.weights_set` on `usage/weights`, the whole table each
//! time, so the latest event is the table in force). A class without a
//! weight counts 1. Reports apply the weights in force when they run; the
//! GPU-hours themselves never change. The CLI (`strata usage weights`) and
//! the client API come through here.

use crate::error::RequestError;
use crate::valid_class;
use events::catalog::{req, EventSpec, Ty};
use events::db::Sql;
use events::{Appender, ExpectedVersion, NewEvent};
use std::collections::BTreeMap;

/// The stream the weights live on.
pub const WEIGHTS_STREAM: &str = "usage/weights";
/// The event that sets them.
pub const WEIGHTS_SET: &str = "usage.weights_set";
/// The most a class may weigh.
pub const MAX_WEIGHT: f64 = 1000.0;

/// The event reference's entry for the weights.
pub const EVENTS: &[EventSpec] = &[EventSpec {
    event_type: WEIGHTS_SET,
    stream: "usage/weights",
    written_by: "operators (`strata usage weights`)",
    about: "The billing weights in force from now: what an hour of each GPU class counts for in usage reports' billed hours (a class without one counts 1). The whole table; it replaces the one before.",
    fields: &[req(
        "weights",
        Ty::Object,
        "GPU class to weight, a number from 0 to 1000 (e.g. `{\"H100-80GB\": 2, \"H100-80GB/1g.10gb\": 0.25}`).",
    )],
    formerly: &[],
}];

/// Billing weights by GPU class.
pub type Weights = BTreeMap<String, f64>;

/// Checks a weights table.
pub fn validate(weights: &Weights) -> Result<(), String> {
    for (class, w) in weights {
        valid_class(class)?;
        if !w.is_finite() || *w < 0.0 || *w > MAX_WEIGHT {
            return Err(format!(
                "weight of {class} must be a number from 0 to {MAX_WEIGHT}, got {w}"
            ));
        }
    }
    Ok(())
}

/// The weights in force (empty when none were ever set).
pub async fn weights(client: &impl Sql) -> Result<Weights, RequestError> {
    let row = client
        .opt(
            "SELECT payload::text FROM strata.events
              WHERE stream = $1 ORDER BY version DESC LIMIT 1",
            &[&WEIGHTS_STREAM],
        )
        .await?;
    Ok(row
        .and_then(|r| {
            let v: serde_json::Value = serde_json::from_str(&r.get::<_, String>(0)).ok()?;
            serde_json::from_value(v.get("weights")?.clone()).ok()
        })
        .unwrap_or_default())
}

/// Sets the whole weights table (`metadata`: who asked).
pub async fn set_weights(
    appender: &Appender,
    weights: &Weights,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestError> {
    validate(weights).map_err(RequestError::Refused)?;
    let mut event = NewEvent::new(WEIGHTS_SET, &serde_json::json!({ "weights": weights }));
    if let Some(m) = metadata {
        event = event.with_metadata(m);
    }
    appender
        .append(WEIGHTS_STREAM, ExpectedVersion::Any, vec![event])
        .await?;
    Ok(())
}

/// What `CLASS=WEIGHT` arguments do to `now`: each sets its class, and a
/// weight of `-` removes it (it counts 1 again).
pub fn edit(now: &Weights, args: &[String]) -> Result<Weights, String> {
    let mut out = now.clone();
    for a in args {
        let (class, w) = a
            .split_once('=')
            .ok_or_else(|| format!("{a:?}: use CLASS=WEIGHT (or CLASS=- to remove it)"))?;
        if w == "-" {
            out.remove(class);
            continue;
        }
        let w: f64 = w
            .parse()
            .map_err(|_| format!("{a:?}: the weight must be a number"))?;
        out.insert(class.to_string(), w);
    }
    validate(&out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_edited_and_checked() {
        let w = edit(
            &Weights::new(),
            &["H100-80GB=2".into(), "H100-80GB/1g.10gb=0.25".into()],
        )
        .unwrap();
        assert_eq!(w["H100-80GB"], 2.0);
        let w = edit(&w, &["H100-80GB=-".into()]).unwrap();
        assert!(!w.contains_key("H100-80GB"));
        assert!(edit(&w, &["H100=-1".into()]).is_err());
        assert!(edit(&w, &["H100=NaN".into()]).is_err());
        assert!(edit(&w, &["H100".into()]).is_err());
        assert!(edit(&w, &["bad class=1".into()]).is_err());
    }
}
