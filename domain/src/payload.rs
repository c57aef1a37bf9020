//! Payload versions of the facts: the newest version of each fact's payload
//! this binary reads, the one it writes, and the steps between them (see
//! [`PayloadVersions`]); and the RFC 3339 times payloads carry.

use serde::Deserialize;

/// The metadata key that carries an event's payload version. Absent, the
/// payload is version 1: every payload was, before versions existed.
pub const PAYLOAD_VERSION: &str = "payload_version";

/// The payload versions of one fact type: the newest this binary reads,
/// the one it writes, and how to turn each version into the next one
/// (`upcasts[i]`: version `i + 1` to `i + 2`) and back (`downcasts[i]`:
/// `i + 2` to `i + 1`).
///
/// A new version is rolled out like a contraction of the schema: one
/// release reads it (and writes the old one, downcast), the next writes it.
/// So during a rolling upgrade no running binary meets a version it cannot
/// read; one that does anyway (a binary older than the release that
/// introduced a version) refuses the event rather than misread it.
pub struct PayloadVersions {
    pub event_type: &'static str,
    pub read: u32,
    pub written: u32,
    pub upcasts: &'static [Upcast],
    pub downcasts: &'static [fn(&mut serde_json::Value)],
}

/// Turns a payload of one version into the next, or says why it cannot.
pub type Upcast = fn(&mut serde_json::Value) -> Result<(), String>;

/// Every fact type whose payload has more than one version; the others are
/// version 1, read and written.
pub const PAYLOAD_VERSIONS: &[PayloadVersions] = &[PayloadVersions {
    event_type: "node.drained",
    read: 2,
    written: 1,
    upcasts: &[drained_v1_to_v2],
    downcasts: &[drained_v2_to_v1],
}];

impl PayloadVersions {
    /// The versions of `event_type` (a current name).
    pub fn of(event_type: &str) -> &'static PayloadVersions {
        static PLAIN: PayloadVersions = PayloadVersions {
            event_type: "",
            read: 1,
            written: 1,
            upcasts: &[],
            downcasts: &[],
        };
        PAYLOAD_VERSIONS
            .iter()
            .find(|v| v.event_type == event_type)
            .unwrap_or(&PLAIN)
    }
}

/// `node.drained` 1 to 2: `deadline_ms` (Unix milliseconds) becomes
/// `deadline` (RFC 3339).
fn drained_v1_to_v2(p: &mut serde_json::Value) -> Result<(), String> {
    let Some(o) = p.as_object_mut() else {
        return Err("not a JSON object".into());
    };
    if let Some(ms) = o.remove("deadline_ms") {
        let ms = ms
            .as_u64()
            .ok_or_else(|| format!("deadline_ms {ms} is not a number of milliseconds"))?;
        o.insert("deadline".into(), rfc3339_ms::format(ms).into());
    }
    Ok(())
}

/// `node.drained` 2 to 1.
fn drained_v2_to_v1(p: &mut serde_json::Value) {
    if let Some(o) = p.as_object_mut() {
        if let Some(ms) = o
            .remove("deadline")
            .and_then(|d| rfc3339_ms::parse(d.as_str()?).ok())
        {
            o.insert("deadline_ms".into(), ms.into());
        }
    }
}

/// An event's payload version, from its metadata (1 when it has none).
pub fn payload_version(metadata: &str) -> Result<u32, String> {
    // Most metadata has no version: spare it a parse.
    if !metadata.contains(PAYLOAD_VERSION) {
        return Ok(1);
    }
    #[derive(Deserialize)]
    struct Meta {
        payload_version: Option<u32>,
    }
    match serde_json::from_str::<Meta>(metadata) {
        Ok(Meta {
            payload_version: Some(v),
        }) if v >= 1 => Ok(v),
        Ok(Meta {
            payload_version: None,
        }) => Ok(1),
        Ok(_) => Err("payload_version 0 in the metadata; versions start at 1".into()),
        Err(e) => Err(format!("metadata's payload_version: {e}")),
    }
}

/// Unix milliseconds as RFC 3339 times (UTC, milliseconds) in payloads.
pub(crate) mod rfc3339_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::{Duration, UNIX_EPOCH};

    pub fn format(ms: u64) -> String {
        humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
    }

    pub fn parse(s: &str) -> Result<u64, String> {
        let t = humantime::parse_rfc3339_weak(s).map_err(|e| format!("{s:?}: {e}"))?;
        t.duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .map_err(|_| format!("{s:?} is before 1970"))
    }

    pub fn serialize<S: Serializer>(ms: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match ms {
            Some(ms) => s.serialize_str(&format(*ms)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| parse(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fact::{Fact, FACT_TYPES};

    #[test]
    fn older_payload_versions_are_upcast_and_newer_ones_refused() {
        let drained = Fact::NodeDrained {
            node: "n1".into(),
            reason: "rma".into(),
            deadline_ms: Some(1_700_000_000_123),
            fault: None,
        };
        // Version 1 (no version in the metadata): Unix milliseconds.
        let v1 = r#"{"node":"n1","reason":"rma","deadline_ms":1700000000123}"#;
        assert_eq!(
            Fact::parse("node.drained", v1, "{}").unwrap(),
            Some(drained.clone())
        );
        assert_eq!(
            Fact::parse("NodeDrained", v1, r#"{"operator":"ana"}"#).unwrap(),
            Some(drained.clone())
        );
        // Version 2: an RFC 3339 time.
        let v2 = r#"{"node":"n1","reason":"rma","deadline":"2023-11-14T22:13:20.123Z"}"#;
        let meta2 = r#"{"operator":"ana","payload_version":2}"#;
        assert_eq!(
            Fact::parse("node.drained", v2, meta2).unwrap(),
            Some(drained.clone())
        );
        // Read as version 2, a version 1 payload would lose its deadline:
        // the version in the metadata is what tells them apart.
        assert_eq!(
            Fact::parse("node.drained", v1, meta2).unwrap(),
            Some(Fact::NodeDrained {
                node: "n1".into(),
                reason: "rma".into(),
                deadline_ms: None,
                fault: None,
            })
        );
        // A version newer than this binary reads is refused, never misread.
        let err = Fact::parse("node.drained", v2, r#"{"payload_version":3}"#).unwrap_err();
        assert!(err.contains("newer than this binary reads (2)"), "{err}");
        let err =
            Fact::parse("node.left", r#"{"node":"n1"}"#, r#"{"payload_version":2}"#).unwrap_err();
        assert!(err.contains("upgrade strata"), "{err}");
        for bad in [r#"{"payload_version":0}"#, r#"{"payload_version":"2"}"#] {
            assert!(
                Fact::parse("node.left", r#"{"node":"n1"}"#, bad).is_err(),
                "{bad}"
            );
        }
        // This release writes version 1 (the one every older binary reads),
        // and reads it back unchanged.
        let e = drained.to_event();
        assert!(e.metadata.is_none());
        assert!(
            e.payload.get().contains("\"deadline_ms\":1700000000123"),
            "{}",
            e.payload.get()
        );
        assert_eq!(
            Fact::parse(&e.event_type, e.payload.get(), "{}").unwrap(),
            Some(drained)
        );
        // Without a deadline both versions are the same payload.
        let now = Fact::NodeDrained {
            node: "n1".into(),
            reason: String::new(),
            deadline_ms: None,
            fault: None,
        };
        assert_eq!(now.to_event().payload.get(), r#"{"node":"n1","reason":""}"#);
    }

    #[test]
    fn every_versioned_type_can_be_upcast_from_version_1_and_downcast_to_what_it_writes() {
        for v in PAYLOAD_VERSIONS {
            assert!(FACT_TYPES.contains(&v.event_type), "{}", v.event_type);
            assert!(v.written >= 1 && v.written <= v.read, "{}", v.event_type);
            assert_eq!(v.upcasts.len() as u32, v.read - 1, "{}", v.event_type);
            assert_eq!(v.downcasts.len() as u32, v.read - 1, "{}", v.event_type);
        }
        assert_eq!(PayloadVersions::of("reservation.placed").read, 1);
    }
}
