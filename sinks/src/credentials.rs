//! Credentials in a sink's URL (`scheme://user:password@host/...`) are kept
//! apart from the log: `sink.created` holds the URL without them and says
//! they exist, `strata.sink_credentials` holds them (only Strata's own
//! database user reads it, never an auditor), and the sinks process puts
//! them back when it connects. Wherever a URL is printed, its credentials
//! are hidden.

use events::db::Sql;

/// `url` without its user info, and the user info (`user[:password]`), if any.
pub fn split(url: &str) -> (String, Option<String>) {
    let Some((start, end)) = authority(url) else {
        return (url.to_string(), None);
    };
    match url[start..end].rfind('@') {
        Some(at) => (
            format!("{}{}", &url[..start], &url[start + at + 1..]),
            Some(url[start..start + at].to_string()),
        ),
        None => (url.to_string(), None),
    }
}

/// `url` (without user info) with `userinfo` put back.
pub fn join(url: &str, userinfo: &str) -> String {
    match authority(url) {
        Some((start, _)) => format!("{}{userinfo}@{}", &url[..start], &url[start..]),
        None => url.to_string(),
    }
}

/// `url` as it may be printed: user info replaced by `***`.
pub fn redact(url: &str) -> String {
    match split(url) {
        (bare, Some(_)) => join(&bare, "***"),
        (bare, None) => bare,
    }
}

/// Where the authority of `url` starts and ends (after `://`, up to the
/// path, query or fragment).
fn authority(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://")? + 3;
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    Some((start, end))
}

/// Keeps sink `sink`'s credentials (or forgets them, for `None`), in the
/// transaction that records its `sink.created`.
pub async fn store(
    tx: &(impl tokio_postgres::GenericClient + Sync),
    sink: &str,
    userinfo: Option<&str>,
) -> Result<(), tokio_postgres::Error> {
    match userinfo {
        Some(u) => tx
            .exec(
                "INSERT INTO strata.sink_credentials (sink, userinfo) VALUES ($1, $2)
                 ON CONFLICT (sink) DO UPDATE SET userinfo = EXCLUDED.userinfo, created_at = now()",
                &[&sink, &u],
            )
            .await
            .map(drop),
        None => tx
            .exec(
                "DELETE FROM strata.sink_credentials WHERE sink = $1",
                &[&sink],
            )
            .await
            .map(drop),
    }
}

/// Sink `sink`'s credentials, if kept.
pub async fn load(
    client: &(impl tokio_postgres::GenericClient + Sync),
    sink: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .opt(
            "SELECT userinfo FROM strata.sink_credentials WHERE sink = $1",
            &[&sink],
        )
        .await?
        .map(|r| r.get(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_info_is_split_off_and_put_back() {
        let (bare, user) = split("nats://alice:s3cr@t@nats.example:4222/x?y=1");
        assert_eq!(bare, "nats://nats.example:4222/x?y=1");
        assert_eq!(user.as_deref(), Some("alice:s3cr@t"));
        assert_eq!(
            join(&bare, user.as_deref().unwrap()),
            "nats://alice:s3cr@t@nats.example:4222/x?y=1"
        );
        assert_eq!(split("https://h/p@q"), ("https://h/p@q".into(), None));
        assert_eq!(split("not a url"), ("not a url".into(), None));
        assert_eq!(redact("nats://tok@h:4222"), "nats://***@h:4222");
        assert_eq!(redact("http://h:80/a"), "http://h:80/a");
    }
}
