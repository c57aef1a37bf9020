//! The event contract: every event type Strata writes, the stream it goes
//! to and its payload's fields, declared by the crate that writes it (each
//! crate's `EVENTS`). `strata events types` renders them, `docs/events.md`
//! is that rendering, and [`conforms`] checks a stored event against its
//! declaration, so the reference can be tested against what the code
//! really writes.
//!
//! Every type is `noun.verb_past`: lower-case words with `_`, one dot.

/// One event type.
#[derive(Debug, Clone, Copy)]
pub struct EventSpec {
    /// `noun.verb_past`, e.g. `reservation.placed`.
    pub event_type: &'static str,
    /// The stream it is appended to: a prefix and a placeholder,
    /// `pool/<pool>`.
    pub stream: &'static str,
    /// Which role or command writes it.
    pub written_by: &'static str,
    /// What it means, in a sentence or two.
    pub about: &'static str,
    /// The payload's fields, in the order they are documented.
    pub fields: &'static [Field],
    /// Names it was written under before, read as this one.
    pub formerly: &'static [&'static str],
}

/// One payload field.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub name: &'static str,
    pub ty: Ty,
    /// Absent from some payloads (a default applies).
    pub optional: bool,
    pub about: &'static str,
}

/// A field's JSON type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    String,
    Integer,
    Boolean,
    /// An array; what it holds is in the field's description.
    Array,
    Object,
    /// Any JSON value (a node's command output, say).
    Any,
    /// An RFC 3339 time as a string.
    Time,
}

impl Ty {
    pub fn as_str(self) -> &'static str {
        match self {
            Ty::String => "string",
            Ty::Integer => "integer",
            Ty::Boolean => "boolean",
            Ty::Array => "array",
            Ty::Object => "object",
            Ty::Any => "any",
            Ty::Time => "time (RFC 3339)",
        }
    }

    fn admits(self, v: &serde_json::Value) -> bool {
        use serde_json::Value as V;
        match self {
            Ty::String | Ty::Time => matches!(v, V::String(_)),
            Ty::Integer => v.is_i64() || v.is_u64(),
            Ty::Boolean => v.is_boolean(),
            Ty::Array => v.is_array(),
            Ty::Object => v.is_object(),
            Ty::Any => true,
        }
    }
}

/// A required field.
pub const fn req(name: &'static str, ty: Ty, about: &'static str) -> Field {
    Field {
        name,
        ty,
        optional: false,
        about,
    }
}

/// A field some payloads leave out.
pub const fn opt(name: &'static str, ty: Ty, about: &'static str) -> Field {
    Field {
        name,
        ty,
        optional: true,
        about,
    }
}

/// Whether `t` follows `noun.verb_past`: two parts, lower-case ASCII
/// letters and `_`, the second holding an English past participle (`-ed`,
/// or one of the irregular ones Strata uses): `inventory_reported`,
/// `marked_unreachable`.
pub fn well_named(t: &str) -> bool {
    let Some((noun, verb)) = t.split_once('.') else {
        return false;
    };
    let word = |w: &str| {
        !w.is_empty()
            && !w.starts_with('_')
            && !w.ends_with('_')
            && w.chars().all(|c| c.is_ascii_lowercase() || c == '_')
    };
    const IRREGULAR: &[&str] = &["set", "reset", "left", "lost", "run", "sent", "withheld"];
    word(noun)
        && word(verb)
        && verb
            .split('_')
            .any(|w| w.ends_with("ed") || IRREGULAR.contains(&w))
}

/// Checks one stored event against the catalog: its type is declared (under
/// its name or a former one), its stream has the declared prefix, and its
/// payload is an object holding every required field, no undeclared one,
/// each of its declared type.
pub fn conforms(
    catalog: &[EventSpec],
    event_type: &str,
    stream: &str,
    payload: &serde_json::Value,
) -> Result<(), String> {
    let spec = catalog
        .iter()
        .find(|s| s.event_type == event_type || s.formerly.contains(&event_type))
        .ok_or_else(|| format!("{event_type} (on {stream}) is not in the event reference"))?;
    let prefix = spec.stream.split('<').next().unwrap_or_default();
    if !stream.starts_with(prefix) {
        return Err(format!(
            "{event_type} on {stream}: the reference says it goes to {}",
            spec.stream
        ));
    }
    let obj = payload
        .as_object()
        .ok_or_else(|| format!("{event_type} on {stream}: the payload is not an object"))?;
    for f in spec.fields {
        match obj.get(f.name) {
            None if !f.optional => {
                return Err(format!(
                    "{event_type} on {stream}: required field {} missing from {payload}",
                    f.name
                ))
            }
            Some(v) if !(f.ty.admits(v) || (f.optional && v.is_null())) => {
                return Err(format!(
                    "{event_type} on {stream}: field {} is {v}, not {}",
                    f.name,
                    f.ty.as_str()
                ))
            }
            _ => {}
        }
    }
    if let Some(k) = obj
        .keys()
        .find(|k| !spec.fields.iter().any(|f| f.name == *k))
    {
        return Err(format!(
            "{event_type} on {stream}: field {k} is not in the reference ({payload})"
        ));
    }
    Ok(())
}

/// The reference page: one section per event type, grouped by noun, in
/// Markdown.
pub fn markdown(catalog: &[EventSpec]) -> String {
    let mut specs: Vec<&EventSpec> = catalog.iter().collect();
    specs.sort_by_key(|s| s.event_type);
    let mut out = String::new();
    out.push_str(
        "# Events\n\n\
         <!-- Generated by `strata events types --markdown` from the catalogs in the code \
         (each crate's `EVENTS`); a test fails when this file differs. Do not edit by hand. -->\n\n\
         Every state change in Strata is one event appended to a stream. This page lists every \
         event type Strata writes, the stream it goes to, who writes it and its payload's \
         fields: the contract sink consumers, replay and auditors read. Types are \
         `noun.verb_past`. An event's metadata may hold `payload_version` (absent: 1) when a \
         payload changed shape; readers upcast older versions.\n\n\
         A field marked optional may be absent (or null); its default is in its description. \
         Consumers should ignore fields they do not know: a later release may add some.\n\n",
    );
    out.push_str("| type | stream | written by |\n| --- | --- | --- |\n");
    for s in &specs {
        out.push_str(&format!(
            "| [`{}`](#{}) | `{}` | {} |\n",
            s.event_type,
            s.event_type.replace('.', ""),
            s.stream,
            s.written_by
        ));
    }
    let mut noun = "";
    for s in &specs {
        let this = s.event_type.split('.').next().unwrap_or_default();
        if this != noun {
            noun = this;
            out.push_str(&format!("\n## {noun}\n"));
        }
        out.push_str(&format!(
            "\n### {}\n\nStream `{}`; written by {}.\n\n{}\n",
            s.event_type, s.stream, s.written_by, s.about
        ));
        if !s.formerly.is_empty() {
            let names: Vec<String> = s.formerly.iter().map(|n| format!("`{n}`")).collect();
            out.push_str(&format!(
                "\nWritten as {} before; read as `{}`.\n",
                names.join(", "),
                s.event_type
            ));
        }
        if s.fields.is_empty() {
            out.push_str("\nPayload: `{}`.\n");
        } else {
            out.push_str("\n| field | type | |\n| --- | --- | --- |\n");
            for f in s.fields {
                out.push_str(&format!(
                    "| `{}` | {}{} | {} |\n",
                    f.name,
                    f.ty.as_str(),
                    if f.optional { ", optional" } else { "" },
                    f.about.replace('|', "\\|")
                ));
            }
        }
    }
    out
}

/// The catalog as JSON: one object per type.
pub fn json(catalog: &[EventSpec]) -> Vec<serde_json::Value> {
    let mut specs: Vec<&EventSpec> = catalog.iter().collect();
    specs.sort_by_key(|s| s.event_type);
    specs
        .iter()
        .map(|s| {
            serde_json::json!({
                "type": s.event_type,
                "stream": s.stream,
                "written_by": s.written_by,
                "about": s.about,
                "formerly": s.formerly,
                "fields": s.fields.iter().map(|f| serde_json::json!({
                    "name": f.name,
                    "type": f.ty.as_str(),
                    "optional": f.optional,
                    "about": f.about,
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CATALOG: &[EventSpec] = &[EventSpec {
        event_type: "pool.created",
        stream: "pool/<pool>",
        written_by: "operators",
        about: "A pool.",
        fields: &[opt("description", Ty::String, "Free text.")],
        formerly: &["PoolCreated"],
    }];

    #[test]
    fn names_follow_noun_verb_past() {
        for good in [
            "pool.created",
            "node.inventory_reported",
            "grant.set",
            "node.left",
        ] {
            assert!(well_named(good), "{good}");
        }
        for bad in [
            "node.status",
            "audit.query",
            "PoolCreated",
            "a.b.c_ed",
            "sink.alert",
            "x",
        ] {
            assert!(!well_named(bad), "{bad}");
        }
    }

    #[test]
    fn stored_events_are_checked_against_their_declaration() {
        let ok = serde_json::json!({"description": "x"});
        assert!(conforms(CATALOG, "pool.created", "pool/p", &ok).is_ok());
        assert!(conforms(CATALOG, "PoolCreated", "pool/p", &serde_json::json!({})).is_ok());
        let cases = [
            (
                "pool.made",
                "pool/p",
                ok.clone(),
                "not in the event reference",
            ),
            ("pool.created", "node/p", ok.clone(), "goes to pool/<pool>"),
            (
                "pool.created",
                "pool/p",
                serde_json::json!([]),
                "not an object",
            ),
            (
                "pool.created",
                "pool/p",
                serde_json::json!({"description": 3}),
                "not string",
            ),
            (
                "pool.created",
                "pool/p",
                serde_json::json!({"extra": 1}),
                "field extra",
            ),
        ];
        for (t, s, p, says) in cases {
            let e = conforms(CATALOG, t, s, &p).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn the_page_has_a_section_and_a_field_table_per_type() {
        let page = markdown(CATALOG);
        assert!(page.contains("### pool.created"));
        assert!(page.contains("| `description` | string, optional | Free text. |"));
        assert!(page.contains("Written as `PoolCreated` before"));
    }
}
