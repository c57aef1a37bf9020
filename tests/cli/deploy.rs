//! What `deploy/` ships: the alerting rules pass `promtool check rules` and
//! their unit tests (`promtool test rules`), and every metric the rules and
//! the Grafana dashboard name is one the code registers, so neither rots
//! when a metric is renamed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn promtool(dir: &Path, args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (Debian's prometheus package) runs");
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every `strata_...` word in `text`.
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("strata_") {
        let word: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        // `strata_` inside a longer word (`x_strata_y`) is not a name.
        let before = rest[..i].chars().next_back();
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.insert(word.clone());
        }
        rest = &rest[i + word.len().max(1)..];
    }
    out
}

/// The metric names the code registers: every `"strata_..."` string in the
/// crates' sources.
fn registered() -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if !["target", "tests", ".git", "bench", "deploy"].contains(&name.as_str()) {
                    walk(&p, out);
                }
            } else if name.ends_with(".rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for part in text.split("\"strata_").skip(1) {
                    let word: String = part
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    out.insert(format!("strata_{word}"));
                }
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(&root(), &mut out);
    out
}

#[test]
fn the_shipped_alerts_and_dashboard_check_and_name_only_real_metrics() {
    let rules = root().join("deploy/prometheus");
    promtool(&rules, &["check", "rules", "strata-alerts.yml"]);
    promtool(&rules, &["test", "rules", "strata-alerts.test.yml"]);

    let dashboard =
        std::fs::read_to_string(root().join("deploy/grafana/strata-region.json")).unwrap();
    let d: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let panels = d["panels"].as_array().unwrap();
    let graphs: Vec<_> = panels.iter().filter(|p| p["type"] != "row").collect();
    assert!(graphs.len() >= 20, "{} panels", graphs.len());
    for p in &graphs {
        assert!(
            p["targets"].as_array().is_some_and(|t| !t.is_empty()),
            "panel {} has no query",
            p["title"]
        );
    }

    let code = registered();
    assert!(code.contains("strata_append_events_total"), "{code:?}");
    let alerts = std::fs::read_to_string(rules.join("strata-alerts.yml")).unwrap();
    let used: BTreeSet<String> = names(&alerts)
        .into_iter()
        .chain(names(&dashboard))
        .collect();
    assert!(used.len() >= 30, "{used:?}");
    for name in used {
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|b| code.contains(*b))
            .unwrap_or(&name);
        assert!(
            code.contains(base),
            "deploy/ names {name}, which no code registers"
        );
    }
}

/// `docs/events.md` is what `strata events types --markdown` prints from
/// the code's catalogs, and every type there is `noun.verb_past`.
#[test]
fn the_event_reference_is_generated_from_the_code_and_named_alike() {
    let page = super::ok(&["events", "types", "--markdown"]);
    let file = root().join("docs/events.md");
    let stored = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        stored == page,
        "docs/events.md differs from the code's event catalogs: regenerate it with \
         `cargo run -- events types --markdown > docs/events.md`"
    );
    let types = super::lines(&super::ok(&["events", "types", "--json"]));
    assert!(types.len() >= 45, "{} types", types.len());
    for t in &types {
        let name = t["type"].as_str().unwrap();
        assert!(
            events::catalog::well_named(name),
            "{name} is not noun.verb_past"
        );
        assert!(
            page.contains(&format!("### {name}\n")),
            "{name} has a section"
        );
        for f in t["fields"].as_array().unwrap() {
            assert!(
                !f["about"].as_str().unwrap().is_empty(),
                "{name}.{} is described",
                f["name"]
            );
        }
    }
}

/// `strata events check` finds what the reference does not declare: an
/// unknown type, a known type on the wrong stream or with a field missing.
#[test]
fn events_check_reports_events_the_reference_does_not_declare() {
    let url = super::database();
    assert!(
        super::events_conform(&url, &[]).is_empty(),
        "a fresh log is empty"
    );
    for (stream, t, data) in [
        ("pool/p", "pool.created", "{}"),
        ("x/1", "thing.happened", "{}"),
        ("node/n1", "pool.created", "{}"),
        ("pool/p", "reservation.placed", "{\"reservation\":\"r1\"}"),
    ] {
        super::ok(&super::append_args(&url, stream, t, data, &[]));
    }
    let out = super::strata(&["events", "check", "--json", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["checked"], 4);
    assert_eq!(report["unknown_types"]["thing.happened"], 1);
    let problems = report["problems"].to_string();
    assert!(problems.contains("goes to pool/<pool>"), "{problems}");
    assert!(
        problems.contains("required field allocations missing"),
        "{problems}"
    );
    assert_eq!(
        report["problems"].as_array().unwrap().len(),
        2,
        "{problems}"
    );
    let out = super::strata(&["events", "check", "--allow-unknown", "--database-url", &url]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the two bad payloads still fail"
    );
}
