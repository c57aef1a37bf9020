//! The house rules that the compiler does not check, read from the source
//! text of every crate of the workspace:
//!
//! - no import cycle between the module files of a crate (an arrow is a
//!   `crate::`, `super::` or `self::` path in a file's production code,
//!   comments and strings left out);
//! - every source file is in ARCHITECTURE.md's code map, under its crate's
//!   heading.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// (name, folder) of the root package (the binary) and every member.
fn crates() -> Vec<(String, PathBuf)> {
    let toml = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let line = toml
        .lines()
        .find(|l| l.starts_with("members"))
        .expect("a members line");
    let mut out = vec![("strata".to_string(), root())];
    for m in line.split('"').skip(1).step_by(2) {
        out.push((m.to_string(), root().join(m)));
    }
    out
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The module path of a file under `src` (`index/apply.rs` is
/// `["index", "apply"]`; `lib.rs` and `main.rs` are the root, `[]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("lib" | "main" | "mod")
    ) {
        parts.pop();
    }
    parts
}

/// `text` with comments and the contents of string and char literals
/// blanked, and everything from the first `#[cfg(test)]` on dropped.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths named after `crate::`, `super::` and `self::` in `code`, each
/// as (its first word, the segments after it); a group
/// (`crate::{a, b::c}`) gives one path per member.
fn paths(code: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let at_word = i == 0 || !(ident_char(chars[i - 1]) || chars[i - 1] == ':');
        if at_word {
            for kw in ["crate", "super", "self"] {
                let n = kw.len();
                let word: String = chars[i..(i + n).min(chars.len())].iter().collect();
                if word == kw
                    && chars.get(i + n) == Some(&':')
                    && chars.get(i + n + 1) == Some(&':')
                {
                    let mut j = i + n + 2;
                    read_path(&chars, &mut j, Vec::new(), kw, &mut out);
                    i = j;
                    break;
                }
            }
        }
        i += 1;
    }
    out
}

/// Reads `a::b::{c, d::e}` from `chars[*j..]`, pushing each full path.
fn read_path(
    chars: &[char],
    j: &mut usize,
    mut prefix: Vec<String>,
    kw: &str,
    out: &mut Vec<(String, Vec<String>)>,
) {
    loop {
        while *j < chars.len() && chars[*j].is_whitespace() {
            *j += 1;
        }
        if chars.get(*j) == Some(&'{') {
            *j += 1;
            loop {
                read_path(chars, j, prefix.clone(), kw, out);
                while *j < chars.len() && chars[*j].is_whitespace() {
                    *j += 1;
                }
                match chars.get(*j) {
                    Some(',') => *j += 1,
                    Some('}') => {
                        *j += 1;
                        return;
                    }
                    _ => return,
                }
                while *j < chars.len() && chars[*j].is_whitespace() {
                    *j += 1;
                }
                if chars.get(*j) == Some(&'}') {
                    *j += 1;
                    return;
                }
            }
        }
        let start = *j;
        while *j < chars.len() && ident_char(chars[*j]) {
            *j += 1;
        }
        if *j == start {
            out.push((kw.to_string(), prefix));
            return;
        }
        prefix.push(chars[start..*j].iter().collect());
        if chars.get(*j) == Some(&':') && chars.get(*j + 1) == Some(&':') {
            *j += 2;
        } else {
            out.push((kw.to_string(), prefix));
            return;
        }
    }
}

/// The module files of one crate and the arrows between them.
fn graph(dir: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = dir.join("src");
    let mut files = BTreeMap::new();
    for f in rust_files(&src) {
        if f.strip_prefix(&src).unwrap().starts_with("bin") {
            continue;
        }
        files.insert(module_of(&src, &f), f);
    }
    let is_root = |f: &Path| {
        matches!(
            f.file_name().and_then(|n| n.to_str()),
            Some("lib.rs" | "main.rs" | "mod.rs")
        )
    };
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, f) in &files {
        let into = edges.entry(m.clone()).or_default();
        if is_root(f) {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        for (kw, segs) in paths(&code) {
            let mut full: Vec<String> = match kw.as_str() {
                "crate" => Vec::new(),
                "super" => m[..m.len() - 1].to_vec(),
                _ => m.clone(),
            };
            full.extend(segs);
            let target = (1..=full.len())
                .rev()
                .map(|n| full[..n].to_vec())
                .find(|p| files.contains_key(p));
            if let Some(t) = target {
                if &t != m && !is_root(&files[&t]) {
                    into.insert(t);
                }
            }
        }
    }
    edges
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct T<'a> {
        g: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Vec<String>) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                scc.push(w.clone());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn the_reader_of_paths_finds_arrows_and_ignores_comments_strings_and_tests() {
    let code = code_of(
        "use crate::a::{b, c::{d, self}};\n// crate::x::y\nlet s = \"crate::z\";\nsuper::w(); self::v::u;\n#[cfg(test)]\nuse crate::t;",
    );
    let got: Vec<String> = paths(&code)
        .into_iter()
        .map(|(k, p)| format!("{k}::{}", p.join("::")))
        .collect();
    assert_eq!(
        got,
        [
            "crate::a::b",
            "crate::a::c::d",
            "crate::a::c::self",
            "super::w",
            "self::v::u"
        ]
    );
    let mut g = BTreeMap::new();
    let m = |s: &str| vec![s.to_string()];
    g.insert(m("a"), BTreeSet::from([m("b")]));
    g.insert(m("b"), BTreeSet::from([m("c")]));
    g.insert(m("c"), BTreeSet::from([m("a")]));
    g.insert(m("d"), BTreeSet::from([m("a")]));
    assert_eq!(cycles(&g), vec![vec![m("a"), m("b"), m("c")]]);
}

#[test]
fn no_crate_has_an_import_cycle_between_its_modules() {
    let mut found = Vec::new();
    for (name, dir) in crates() {
        for scc in cycles(&graph(&dir)) {
            let names: Vec<String> = scc.iter().map(|m| m.join("/")).collect();
            found.push(format!("{name}: {}", names.join(" <-> ")));
        }
    }
    assert!(
        found.is_empty(),
        "import cycles (move what both sides use into a module neither side is used by):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_source_file_is_in_the_architecture_map() {
    let doc = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    // The text under each crate's heading (`### `folder/``; the binary's is
    // `### `src/``).
    let mut sections: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("### `") {
            current = h
                .split('`')
                .next()
                .map(|s| s.trim_end_matches('/').to_string());
            continue;
        }
        if line.starts_with("## ") {
            current = None;
        }
        if let Some(c) = &current {
            let s = sections.entry(c.clone()).or_default();
            s.push_str(line);
            s.push('\n');
        }
    }
    let mut missing = Vec::new();
    for (name, dir) in crates() {
        let key = if name == "strata" {
            "src".to_string()
        } else {
            name.clone()
        };
        let text = sections.get(&key);
        let src = dir.join("src");
        for f in rust_files(&src) {
            let rel = f.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            if !text.is_some_and(|t| t.contains(&format!("`{rel}`"))) {
                missing.push(format!("{key}: {rel}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "source files missing from ARCHITECTURE.md's code map (name each, in backticks, under its crate's `### ` heading):\n{}",
        missing.join("\n")
    );
}
