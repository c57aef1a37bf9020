//! HTML of the console's own: escaping (every value that came from the log
//! or a request passes through [`esc`]), the frame around every page, times
//! a browser shows in its own zone (UTC on hover), and small charts drawn as
//! SVG. Pages carry no inline script or style (the Content-Security-Policy
//! forbids them): data a script needs rides in `data-` attributes.

use crate::auth::Who;
use crate::form::encode;
use std::fmt::Write;

/// `s` escaped for text and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A time the browser shows in the viewer's zone, UTC on hover.
pub fn time(ms: u64) -> String {
    let utc = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
    );
    format!(r#"<time datetime="{utc}" title="{utc}">{utc}</time>"#)
}

/// A duration as people say it (`3m 12s`).
pub fn ago(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// Links to the console's pages.
pub fn pool_link(pool: &str) -> String {
    format!(r#"<a href="/pools/{}">{}</a>"#, encode(pool), esc(pool))
}
pub fn node_link(node: &str) -> String {
    format!(r#"<a href="/nodes/{}">{}</a>"#, encode(node), esc(node))
}
pub fn reservation_link(id: &str) -> String {
    format!(r#"<a href="/reservations/{}">{}</a>"#, encode(id), esc(id))
}

/// What a page is: its title, its body, and what its live updates follow.
pub struct Page {
    pub title: String,
    pub body: String,
    /// Stream prefixes whose events change the page (empty: none).
    pub watch: Vec<String>,
    /// Ids whose mention in an event changes the page.
    pub mention: Vec<String>,
    /// Which item of the navigation it is under.
    pub section: &'static str,
    /// The log position the console had folded when the page was made (a
    /// live stream that starts later fetches the page again if the log
    /// moved on meanwhile, so nothing in between is missed).
    pub position: u64,
}

impl Page {
    pub fn new(title: impl Into<String>, section: &'static str) -> Page {
        Page {
            title: title.into(),
            body: String::new(),
            watch: Vec::new(),
            mention: Vec::new(),
            section,
            position: 0,
        }
    }

    /// The `<main>` element alone (what a live update swaps in).
    pub fn main(&self) -> String {
        format!(
            r#"<main id="main" tabindex="-1" data-position="{}" data-watch="{}" data-mention="{}"><h1>{}</h1>{}</main>"#,
            self.position,
            esc(&self.watch.join(",")),
            esc(&self.mention.join(",")),
            esc(&self.title),
            self.body
        )
    }

    /// The whole document.
    pub fn document(&self, who: &Who) -> String {
        let mut nav = String::new();
        for (href, name, section) in [
            ("/", "Region", "region"),
            ("/queues", "Queues", "queues"),
            ("/events", "Events", "events"),
            ("/usage", "Usage", "usage"),
        ] {
            let current = if section == self.section {
                r#" aria-current="page""#
            } else {
                ""
            };
            let _ = write!(nav, r#"<li><a href="{href}"{current}>{name}</a></li>"#);
        }
        let pools = match who.role.role {
            gateway::roles::Role::Operator => format!(" of {}", esc(&who.role.pools.join(", "))),
            _ => String::new(),
        };
        format!(
            r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>{title} · Strata</title><link rel="stylesheet" href="/assets/console.css"><script src="/assets/console.js" defer></script></head>
<body><a class="skip" href="#main">Skip to content</a>
<header><nav aria-label="Sections"><span class="brand">Strata</span><ul>{nav}</ul></nav>
<div class="who"><span id="live-state" role="status" aria-live="polite">connecting…</span>
<span>{op} <small>({role}{pools})</small></span>
<form method="post" action="/logout"><input type="hidden" name="csrf" value="{csrf}"><button type="submit">Sign out</button></form></div></header>
{main}
</body></html>"##,
            title = esc(&self.title),
            op = esc(&who.operator),
            role = who.role.role,
            csrf = esc(&who.csrf),
            main = self.main()
        )
    }
}

/// A page for someone not signed in (or refused).
pub fn bare(title: &str, body: &str) -> String {
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>{t} · Strata</title><link rel="stylesheet" href="/assets/console.css"></head>
<body><main id="main" class="bare"><h1>{t}</h1>{body}</main></body></html>"#,
        t = esc(title)
    )
}

/// A horizontal bar of parts (each a CSS class and an amount) out of
/// `total`, with a text equivalent for screen readers.
pub fn bar(parts: &[(&str, u64)], total: u64, label: &str) -> String {
    let mut out = format!(
        r#"<svg class="bar" viewBox="0 0 100 6" preserveAspectRatio="none" role="img" aria-label="{}">"#,
        esc(label)
    );
    let mut x = 0.0;
    for (class, n) in parts {
        if total == 0 || *n == 0 {
            continue;
        }
        let w = *n as f64 * 100.0 / total as f64;
        let _ = write!(
            out,
            r#"<rect class="{class}" x="{x:.2}" y="0" width="{w:.2}" height="6"/>"#
        );
        x += w;
    }
    out.push_str("</svg>");
    out
}

/// A line chart of series over the same times: each (CSS class, name,
/// values); the x axis is the times, oldest left.
pub fn lines(times: &[u64], series: &[(&str, &str, Vec<u64>)], label: &str) -> String {
    let (w, h) = (600.0, 120.0);
    let max = series
        .iter()
        .flat_map(|(_, _, v)| v.iter().copied())
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let mut out = format!(
        r#"<figure class="chart"><svg viewBox="0 0 {w} {h}" role="img" aria-label="{}"><line class="axis" x1="0" y1="{h}" x2="{w}" y2="{h}"/>"#,
        esc(label)
    );
    let n = times.len();
    for (class, _, values) in series {
        if values.is_empty() {
            continue;
        }
        let pts: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let x = if n > 1 {
                    i as f64 * w / (n - 1) as f64
                } else {
                    w
                };
                let y = h - (*v as f64 / max) * (h - 4.0);
                format!("{x:.1},{y:.1}")
            })
            .collect();
        let _ = write!(
            out,
            r#"<polyline class="{class}" points="{}"/>"#,
            pts.join(" ")
        );
    }
    out.push_str("</svg><figcaption>");
    for (class, name, values) in series {
        let _ = write!(
            out,
            r#"<span class="key {class}">{} (now {})</span> "#,
            esc(name),
            values.last().copied().unwrap_or(0)
        );
    }
    let _ = write!(
        out,
        "<span class=\"scale\">max {max}</span></figcaption></figure>"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped() {
        assert_eq!(
            esc(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert!(node_link("n<1>").contains("n&lt;1&gt;"));
        assert!(node_link("a b").contains("/nodes/a%20b"));
    }

    #[test]
    fn charts_say_what_they_show() {
        let b = bar(&[("booked", 3), ("free", 1)], 4, "3 of 4 booked");
        assert!(
            b.contains(r#"width="75.00""#) && b.contains(r#"aria-label="3 of 4 booked""#),
            "{b}"
        );
        let l = lines(&[1, 2], &[("used", "used", vec![0, 4])], "usage");
        assert!(l.contains("polyline") && l.contains("(now 4)"), "{l}");
        assert_eq!(ago(3_723_000), "1h 2m");
    }
}
