//! Query strings and `application/x-www-form-urlencoded` bodies, decoded
//! (`+` is a space, `%XX` a byte; a malformed escape is kept as written,
//! and bytes that are not UTF-8 are replaced), and the percent-encoding of
//! a path segment or query value the pages link with.

/// The pairs of a query string or form body, in order.
pub fn pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

/// The first value of `key`.
pub fn get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// One component, decoded.
pub fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex_val(b[i + 1]), hex_val(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_decode_and_links_encode() {
        let p = pairs("a=1&b=x+y%2Fz&c&d=%zz&e=%4");
        assert_eq!(get(&p, "a"), Some("1"));
        assert_eq!(get(&p, "b"), Some("x y/z"));
        assert_eq!(get(&p, "c"), Some(""));
        assert_eq!(get(&p, "d"), Some("%zz"));
        assert_eq!(get(&p, "e"), Some("%4"));
        assert_eq!(get(&p, "f"), None);
        assert_eq!(decode("%C3%A9"), "é");
        assert_eq!(decode("%FF"), "\u{FFFD}");
        assert_eq!(encode("a b/é~"), "a%20b%2F%C3%A9~");
        for s in ["", "pool/p1", "x y&z=1", "%%", "é"] {
            assert_eq!(decode(&encode(s)), s);
        }
    }
}
