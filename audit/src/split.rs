//! Splits a simple-protocol query string into its statements.
//!
//! The endpoint runs every statement on its own through the extended
//! protocol, where Postgres refuses more than one statement per Parse. So a
//! wrong split can only make Postgres refuse a piece; it can never run two
//! statements as one (which is what would let a `COMMIT` end the read-only
//! transaction the endpoint opened). The lexer knows what can hide a `;`:
//! quoted strings (with `''` and, in `E''` strings, backslash escapes),
//! quoted identifiers, dollar quotes, line comments and nested block comments.

/// The statements of `sql`, trimmed, empty ones dropped.
pub fn statements(sql: &str) -> Vec<&str> {
    let b = sql.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b';' => {
                push(&mut out, &sql[start..i]);
                i += 1;
                start = i;
            }
            b'\'' => {
                let escapes =
                    i > 0 && matches!(b[i - 1], b'e' | b'E') && !ident_char_before(b, i - 1);
                i = skip_quoted(b, i + 1, b'\'', escapes);
            }
            b'"' => i = skip_quoted(b, i + 1, b'"', false),
            b'-' if b.get(i + 1) == Some(&b'-') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += block_comment_len(&b[i..]).unwrap_or(b.len() - i);
            }
            b'$' if !ident_char_before(b, i) => match dollar_tag(b, i) {
                Some(tag_end) => {
                    let tag = &b[i..tag_end];
                    i = tag_end;
                    loop {
                        if i >= b.len() {
                            break;
                        }
                        if b[i..].starts_with(tag) {
                            i += tag.len();
                            break;
                        }
                        i += 1;
                    }
                }
                None => i += 1,
            },
            _ => i += 1,
        }
    }
    push(&mut out, &sql[start..]);
    out
}

/// The first `n` words of one statement, upper-cased: unquoted words of
/// letters, digits, `_` and `$`, or double-quoted identifiers (unquoted).
/// Whitespace and comments between them are skipped; the words end at the
/// first other token (`=`, `(`, a string, ...).
pub fn leading_words(stmt: &str, n: usize) -> Vec<String> {
    let b = stmt.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while out.len() < n && i < b.len() {
        match b[i] {
            c if c.is_ascii_whitespace() => i += 1,
            b'-' if b.get(i + 1) == Some(&b'-') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += block_comment_len(&b[i..]).unwrap_or(b.len() - i);
            }
            b'"' => {
                let end = skip_quoted(b, i + 1, b'"', false);
                // An identifier never closed ends the words.
                let Some(inner) = (b.get(end - 1) == Some(&b'"') && end >= i + 2)
                    .then(|| stmt.get(i + 1..end - 1))
                    .flatten()
                else {
                    break;
                };
                out.push(inner.replace("\"\"", "\"").to_ascii_uppercase());
                i = end;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'$')
                {
                    i += 1;
                }
                out.push(stmt[start..i].to_ascii_uppercase());
            }
            _ => break,
        }
    }
    out
}

fn push<'a>(out: &mut Vec<&'a str>, s: &'a str) {
    let t = s.trim();
    if !t.is_empty() && !only_comments(t) {
        out.push(t);
    }
}

/// True when `s` holds nothing but comments (Postgres answers those with an
/// empty query; the endpoint drops them).
fn only_comments(s: &str) -> bool {
    let mut rest = s.trim_start();
    loop {
        if rest.is_empty() {
            return true;
        }
        if let Some(r) = rest.strip_prefix("--") {
            rest = r
                .split_once('\n')
                .map(|(_, r)| r)
                .unwrap_or("")
                .trim_start();
        } else if rest.starts_with("/*") {
            match block_comment_len(rest.as_bytes()) {
                Some(end) => rest = rest[end..].trim_start(),
                None => return true,
            }
        } else {
            return false;
        }
    }
}

/// The length of the (nested) block comment `b` starts with, or `None` if
/// it does not end.
fn block_comment_len(b: &[u8]) -> Option<usize> {
    let mut depth = 0;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            depth += 1;
            i += 2;
        } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return Some(i);
            }
        } else {
            i += 1;
        }
    }
    None
}

fn ident_char_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b'$')
}

/// Skips to just past the closing `quote`; a doubled quote is one character.
fn skip_quoted(b: &[u8], mut i: usize, quote: u8, escapes: bool) -> usize {
    while i < b.len() {
        if escapes && b[i] == b'\\' {
            i += 2;
            continue;
        }
        if b[i] == quote {
            if b.get(i + 1) == Some(&quote) {
                i += 2;
                continue;
            }
            return i + 1;
        }
        i += 1;
    }
    b.len()
}

/// The end of a dollar-quote tag (`$$` or `$name$`) starting at `i`.
fn dollar_tag(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'$' => return Some(j + 1),
            c if c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 => {
                if j == i + 1 && c.is_ascii_digit() {
                    return None; // $1: a parameter
                }
                j += 1;
            }
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{leading_words, statements};

    #[test]
    fn leading_words_skip_comments_and_unquote() {
        assert_eq!(
            leading_words("commit and chain", 4),
            ["COMMIT", "AND", "CHAIN"]
        );
        assert_eq!(
            leading_words("/* x */ Set -- y\n \"Statement_Timeout\" = 0", 4),
            ["SET", "STATEMENT_TIMEOUT"]
        );
        assert_eq!(leading_words("select 1", 1), ["SELECT"]);
        assert_eq!(leading_words("  ", 3), Vec::<String>::new());
        for s in ["\"", "/*", "--", "\"a\"\"", "é", "\"é", "\"\""] {
            let _ = leading_words(s, 5);
        }
    }

    #[test]
    fn splits_on_semicolons_outside_quotes_and_comments() {
        assert_eq!(
            statements("select 1; select 2;"),
            vec!["select 1", "select 2"]
        );
        assert_eq!(
            statements("select ';'; select 2"),
            vec!["select ';'", "select 2"]
        );
        assert_eq!(statements("select 'it''s;'"), vec!["select 'it''s;'"]);
        assert_eq!(
            statements(r"select E'a\';b'; x"),
            vec![r"select E'a\';b'", "x"]
        );
        assert_eq!(
            statements(r#"select 1 as "a;b""#),
            vec![r#"select 1 as "a;b""#]
        );
        assert_eq!(statements("select $$a;b$$; x"), vec!["select $$a;b$$", "x"]);
        assert_eq!(
            statements("select $q$a;$$;b$q$"),
            vec!["select $q$a;$$;b$q$"]
        );
        assert_eq!(statements("select $1; x"), vec!["select $1", "x"]);
        assert_eq!(
            statements("select 1 -- a;b\n; x"),
            vec!["select 1 -- a;b", "x"]
        );
        assert_eq!(
            statements("select /* a; /* b; */ c; */ 1"),
            vec!["select /* a; /* b; */ c; */ 1"]
        );
        assert_eq!(statements(" ; ;; "), Vec::<&str>::new());
        assert_eq!(statements("-- only a comment"), Vec::<&str>::new());
        assert_eq!(
            statements("commit; insert into t values (1)"),
            vec!["commit", "insert into t values (1)"]
        );
    }

    #[test]
    fn never_panics_on_odd_input() {
        for s in [
            "'", "\"", "$", "$a", "/*", "--", "E'\\", "$$;", "é;'é'", "\u{0}",
        ] {
            let _ = statements(s);
        }
    }

    mod properties {
        use super::super::{leading_words, statements};
        use crate::control::classify;
        use proptest::prelude::*;

        /// SQL-ish text: the characters the lexer treats specially, often.
        fn sqlish() -> impl Strategy<Value = String> {
            proptest::collection::vec(
                prop_oneof![
                    Just(";".to_string()),
                    Just("'".to_string()),
                    Just("\"".to_string()),
                    Just("$".to_string()),
                    Just("$a$".to_string()),
                    Just("--".to_string()),
                    Just("/*".to_string()),
                    Just("*/".to_string()),
                    Just("\n".to_string()),
                    Just("E'".to_string()),
                    Just("\\".to_string()),
                    Just(" BEGIN ".to_string()),
                    Just(" SET work_mem = 1".to_string()),
                    Just("commit and chain".to_string()),
                    any::<char>().prop_map(String::from),
                    "[a-z ]{0,6}",
                ],
                0..40,
            )
            .prop_map(|parts| parts.concat())
        }

        proptest! {
            /// The splitter never panics, and every statement it returns is
            /// a piece of the input, in order, the pieces not overlapping.
            #[test]
            fn statements_are_disjoint_pieces_of_the_input_in_order(sql in sqlish()) {
                let base = sql.as_ptr() as usize;
                let mut end = 0;
                for stmt in statements(&sql) {
                    let at = stmt.as_ptr() as usize - base;
                    prop_assert!(at >= end, "{stmt:?} overlaps the one before in {sql:?}");
                    prop_assert!(at + stmt.len() <= sql.len());
                    prop_assert!(!stmt.trim().is_empty());
                    end = at + stmt.len();
                    // Whatever a statement holds, telling what it does and
                    // reading its words never panics.
                    let _ = classify(stmt);
                    let _ = leading_words(stmt, 6);
                }
            }

            /// Arbitrary text (any Unicode) as well.
            #[test]
            fn arbitrary_text_never_panics(sql in any::<String>()) {
                for stmt in statements(&sql) {
                    let _ = classify(stmt);
                }
            }
        }
    }
}
