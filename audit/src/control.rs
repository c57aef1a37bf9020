//! What one auditor statement does to the transaction the endpoint holds.
//!
//! Postgres's grammar names a statement's kind by its leading keywords, and
//! the endpoint runs every statement on its own Parse (so no second statement
//! can hide behind the first). From those words the endpoint knows, before
//! it runs anything, whether a statement would end the transaction (it is
//! then ended with a rollback: nothing an auditor runs is ever committed),
//! chain a new transaction after it (refused: the chained transaction has no
//! snapshot yet, so it could still be made writable), prepare or finish a
//! two-phase transaction (refused), or change one of the limits the endpoint
//! holds the session to (refused; and the limits are set again after every
//! statement, so `set_config()` in a query cannot lift them either).

use crate::split::leading_words;

/// Settings an auditor may not change: the limits that keep one auditor
/// from holding locks (and so the log) for as long as they like, and the
/// read-only mode.
pub const FIXED_SETTINGS: &[&str] = &[
    "STATEMENT_TIMEOUT",
    "IDLE_IN_TRANSACTION_SESSION_TIMEOUT",
    "IDLE_SESSION_TIMEOUT",
    "LOCK_TIMEOUT",
    "WORK_MEM",
    "HASH_MEM_MULTIPLIER",
    "MAINTENANCE_WORK_MEM",
    "TEMP_FILE_LIMIT",
    "CLIENT_CONNECTION_CHECK_INTERVAL",
    "TCP_KEEPALIVES_IDLE",
    "TCP_KEEPALIVES_INTERVAL",
    "TCP_KEEPALIVES_COUNT",
    "DEFAULT_TRANSACTION_READ_ONLY",
    "TRANSACTION_READ_ONLY",
];

/// How the endpoint treats a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Anything else: run as it is.
    Plain,
    /// `BEGIN` / `START TRANSACTION`: the auditor's transaction begins (the
    /// endpoint's read-only one, already open, carries on).
    Begin,
    /// `COMMIT`, `END`, `ROLLBACK`, `ABORT`: the transaction ends, always
    /// with a rollback.
    End { asked_commit: bool },
    /// Refused before it runs, with this message.
    Refused(String),
}

pub fn classify(stmt: &str) -> Control {
    let w = leading_words(stmt, 6);
    let word = |i: usize| w.get(i).map(String::as_str).unwrap_or("");
    // `AND CHAIN` (not `AND NO CHAIN`) after the optional WORK/TRANSACTION.
    let chains = || {
        let rest = match word(1) {
            "WORK" | "TRANSACTION" => &w[2.min(w.len())..],
            _ => &w[1.min(w.len())..],
        };
        rest.first().map(String::as_str) == Some("AND")
            && rest.get(1).map(String::as_str) == Some("CHAIN")
    };
    match word(0) {
        "BEGIN" => Control::Begin,
        "START" if word(1) == "TRANSACTION" => Control::Begin,
        "COMMIT" | "END" | "ROLLBACK" | "ABORT" if word(1) == "PREPARED" => Control::Refused(
            "two-phase transactions are not available through the audit endpoint".into(),
        ),
        "ROLLBACK" if word(1) == "TO" => Control::Plain,
        "COMMIT" | "END" | "ROLLBACK" | "ABORT" if chains() => Control::Refused(
            "AND CHAIN is not available through the audit endpoint: end the transaction and BEGIN another"
                .into(),
        ),
        "COMMIT" | "END" => Control::End { asked_commit: true },
        "ROLLBACK" | "ABORT" => Control::End {
            asked_commit: false,
        },
        "PREPARE" if word(1) == "TRANSACTION" => Control::Refused(
            "two-phase transactions are not available through the audit endpoint".into(),
        ),
        "SET" | "RESET" => {
            let name = match word(1) {
                "SESSION" | "LOCAL" => word(2),
                n => n,
            };
            if FIXED_SETTINGS.contains(&name) {
                Control::Refused(format!(
                    "{} is fixed by the audit endpoint and cannot be changed",
                    name.to_ascii_lowercase()
                ))
            } else {
                Control::Plain
            }
        }
        _ => Control::Plain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transaction_control_is_told_by_its_leading_words() {
        assert_eq!(classify("begin"), Control::Begin);
        assert_eq!(classify("START TRANSACTION READ WRITE"), Control::Begin);
        assert_eq!(classify("commit"), Control::End { asked_commit: true });
        assert_eq!(
            classify("/* c */ END WORK"),
            Control::End { asked_commit: true }
        );
        assert_eq!(
            classify("abort"),
            Control::End {
                asked_commit: false
            }
        );
        assert_eq!(
            classify("commit and no chain"),
            Control::End { asked_commit: true }
        );
        assert_eq!(classify("rollback to savepoint a"), Control::Plain);
        for s in [
            "commit and chain",
            "COMMIT WORK AND CHAIN",
            "rollback transaction and chain",
            "end and chain",
            "prepare transaction 'x'",
            "commit prepared 'x'",
            "SET statement_timeout = 0",
            "set session idle_in_transaction_session_timeout to 0",
            "set local \"lock_timeout\" = 0",
            "reset statement_timeout",
            "SET transaction_read_only = off",
        ] {
            assert!(matches!(classify(s), Control::Refused(_)), "{s}");
        }
        assert_eq!(classify("SET search_path = audit"), Control::Plain);
        assert_eq!(classify("RESET ALL"), Control::Plain);
        assert_eq!(classify("select 'commit'"), Control::Plain);
        assert_eq!(classify("prepare q as select 1"), Control::Plain);
    }
}
