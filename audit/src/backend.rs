//! One auditor's session on Postgres, as the read-only audit role.
//!
//! The endpoint speaks the extended query protocol to Postgres itself (over
//! the events crate's raw connection, built on `postgres-protocol`), so an
//! auditor's parameters and result formats pass through byte for byte and
//! Postgres does every type conversion. Each statement runs inside a
//! `REPEATABLE READ READ ONLY` transaction that the endpoint opened and whose
//! snapshot it already took (so `SET transaction_read_only = off` is refused),
//! and that it rolls back afterwards. An auditor's own `BEGIN` keeps that
//! transaction open until their `COMMIT` or `ROLLBACK`, so several statements
//! see one snapshot. Once out of it, every setting is back at the
//! session's defaults (a rollback undoes every `SET` made in the
//! transaction), so an auditor cannot switch off the statement or idle
//! timeouts for later statements.

use bytes::{Bytes, BytesMut};
use events::replication::{ReplicationConnection, ReplicationError};
use fallible_iterator::FallibleIterator;
use pgwire::error::ErrorInfo;
use postgres_protocol::message::backend::{ErrorResponseBody, Message};
use postgres_protocol::message::frontend;
use postgres_protocol::IsNull;

use crate::control::Control;

/// A result column as Postgres described it.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub table_oid: u32,
    pub column_id: i16,
    pub type_oid: u32,
    pub type_size: i16,
    pub type_modifier: i32,
}

/// A statement as Postgres described it.
#[derive(Debug, Clone)]
pub struct Described {
    pub params: Vec<u32>,
    pub columns: Vec<Column>,
}

/// What one statement did.
#[derive(Debug)]
pub enum Outcome {
    Rows {
        columns: Vec<Column>,
        rows: Vec<BytesMut>,
        tag: String,
    },
    Command {
        tag: String,
    },
    Empty,
    Error(Box<ErrorInfo>),
}

/// How a statement moved the auditor's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxChange {
    None,
    Started,
    Ended,
}

/// A failure of the connection itself (not an SQL error).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Connection(#[from] ReplicationError),
    #[error("protocol: {0}")]
    Protocol(String),
}

pub struct Backend {
    conn: ReplicationConnection,
    /// The auditor opened a transaction (their BEGIN) that is still open.
    in_client_tx: bool,
    max_result_bytes: usize,
    /// Set again after every statement of an auditor's transaction (see
    /// [`crate::control`]): the endpoint's limits, whatever the
    /// statement did with `set_config()`.
    limits: String,
    /// NOTICE and WARNING messages of the last statement, for the auditor.
    notices: Vec<ErrorInfo>,
    /// Statements described on this connection, by text and parameter
    /// types: a client that parses the same statement again (every
    /// extended-protocol client without named statements, for every
    /// execution) is answered without a round trip. The statement itself
    /// is parsed again by PostgreSQL when it runs, and its rows are sent
    /// with the description PostgreSQL gives then.
    described: std::collections::HashMap<(String, Vec<u32>), Described>,
}

/// The endpoint's own transaction around every auditor statement: read-only,
/// its snapshot taken by the `SELECT 1`, so it cannot be made writable.
const OPEN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1";
// After every statement outside an auditor's transaction, and when theirs
// ends: the transaction rolled back. Every setting the auditor SET in it
// (`SET`, `SET SESSION`, `set_config(.., false)`) goes back with the
// rollback, so the session is at its defaults again.
const CLOSE: &str = "ROLLBACK";
// When a statement ended the transaction some other way than by the
// endpoint's rollback (nothing the endpoint runs should, but if one did, a
// setting made before it would have been committed): the rollback, and
// every setting back to the session's defaults (the endpoint's startup
// options).
const RESET: &str = "ROLLBACK; RESET ALL";

/// Most statement descriptions a session keeps (see [`Backend::describe`]).
const DESCRIBED_KEPT: usize = 64;

/// How often (ms) an auditor's PostgreSQL process checks, while a
/// statement runs, that the endpoint is still connected: one whose endpoint
/// closed the connection (a statement past its limit, the endpoint's crash
/// or restart) ends within this, whatever the statement does (a `DO` block
/// catching every cancel included). TCP keepalives do the same for an
/// endpoint whose machine went away.
pub const CONNECTION_CHECK_MS: u64 = 1000;

/// What the endpoint counts for each row it holds, beyond its payload: the
/// row's buffer and its place in the result (a zero-column row is 2 bytes
/// on the wire and about this much in memory).
const ROW_OVERHEAD: usize = 64;

/// The limits an auditor's session is held to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub statement_timeout: std::time::Duration,
    pub idle_in_transaction: std::time::Duration,
    pub lock_timeout: std::time::Duration,
    /// PostgreSQL closes a session idle this long: a backstop behind the
    /// endpoint's own idle limit.
    pub idle_session: std::time::Duration,
    /// Memory per sort or hash of a statement, in KiB (hashes get no more:
    /// `hash_mem_multiplier` is 1).
    pub work_mem_kib: u64,
}

impl Limits {
    /// Startup options: read-only transactions and these limits.
    pub fn options(&self) -> String {
        format!(
            "-c default_transaction_read_only=on -c statement_timeout={} -c idle_in_transaction_session_timeout={} -c lock_timeout={} -c idle_session_timeout={} -c work_mem={} -c hash_mem_multiplier=1 -c maintenance_work_mem={} -c client_connection_check_interval={CONNECTION_CHECK_MS} -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3 -c search_path=audit,strata,pg_catalog -c TimeZone=UTC -c DateStyle=ISO,MDY -c IntervalStyle=postgres",
            ms(self.statement_timeout),
            ms(self.idle_in_transaction),
            ms(self.lock_timeout),
            ms(self.idle_session),
            self.work_mem_kib.max(64),
            self.work_mem_kib.max(1024),
        )
    }

    fn reassert(&self) -> String {
        format!(
            "SELECT set_config('statement_timeout', '{}', true), set_config('idle_in_transaction_session_timeout', '{}', true), set_config('lock_timeout', '{}', true), set_config('work_mem', '{}', true), set_config('hash_mem_multiplier', '1', true), set_config('maintenance_work_mem', '{}', true), set_config('client_connection_check_interval', '{CONNECTION_CHECK_MS}', true), set_config('transaction_read_only', 'on', true)",
            ms(self.statement_timeout),
            ms(self.idle_in_transaction),
            ms(self.lock_timeout),
            self.work_mem_kib.max(64),
            self.work_mem_kib.max(1024),
        )
    }
}

fn ms(d: std::time::Duration) -> u128 {
    d.as_millis().max(1)
}

fn refusal(code: &str, message: String) -> Outcome {
    Outcome::Error(Box::new(ErrorInfo::new(
        "ERROR".into(),
        code.into(),
        message,
    )))
}

impl Backend {
    pub async fn connect(
        config: &events::db::Database,
        limits: &Limits,
        max_result_bytes: usize,
    ) -> Result<Backend, BackendError> {
        let conn =
            ReplicationConnection::connect_session(config, "strata-audit", Some(&limits.options()))
                .await?;
        Ok(Backend {
            conn,
            in_client_tx: false,
            max_result_bytes,
            limits: limits.reassert(),
            notices: Vec::new(),
            described: std::collections::HashMap::new(),
        })
    }

    /// Closes the connection to PostgreSQL (its process ends within
    /// [`CONNECTION_CHECK_MS`], even mid-statement); the session is over.
    pub async fn close(&mut self) {
        self.conn.close().await;
    }

    /// The PostgreSQL process's id and cancel key.
    pub fn key(&self) -> Option<(i32, i32)> {
        self.conn.backend_key()
    }

    /// The notices of the last statement.
    pub fn take_notices(&mut self) -> Vec<ErrorInfo> {
        std::mem::take(&mut self.notices)
    }

    /// Parses `sql` (one statement) and describes its parameters and
    /// columns; a statement this connection described before is answered
    /// from memory. Only statements PostgreSQL accepted are kept, so an
    /// error is always PostgreSQL's own, at the time.
    pub async fn describe(
        &mut self,
        sql: &str,
        param_types: &[u32],
    ) -> Result<Result<Described, Box<ErrorInfo>>, BackendError> {
        let key = (sql.to_string(), param_types.to_vec());
        if let Some(d) = self.described.get(&key) {
            return Ok(Ok(d.clone()));
        }
        let described = self.describe_anew(sql, param_types).await?;
        if let Ok(d) = &described {
            if self.described.len() >= DESCRIBED_KEPT {
                self.described.clear();
            }
            self.described.insert(key, d.clone());
        }
        Ok(described)
    }

    async fn describe_anew(
        &mut self,
        sql: &str,
        param_types: &[u32],
    ) -> Result<Result<Described, Box<ErrorInfo>>, BackendError> {
        let buf = self.conn.write_buf();
        frontend::parse("", sql, param_types.iter().copied(), buf).map_err(encode)?;
        frontend::describe(b'S', "", buf).map_err(encode)?;
        frontend::sync(buf);
        self.conn.flush().await?;
        let mut params = Vec::new();
        let mut columns = Vec::new();
        let mut error = None;
        loop {
            match self.conn.next_message().await? {
                Some(Message::ParameterDescription(body)) => {
                    params = body.parameters().collect().map_err(protocol)?;
                }
                Some(Message::RowDescription(body)) => columns = columns_of(&body)?,
                Some(Message::ErrorResponse(body)) => error = Some(error_info(&body)),
                Some(Message::ReadyForQuery(_)) => break,
                _ => {}
            }
        }
        Ok(match error {
            Some(e) => Err(e),
            None => Ok(Described { params, columns }),
        })
    }

    /// Ends the auditor's transaction, if one is open, with a rollback,
    /// which undoes its settings too (the endpoint ending it: at its
    /// maximum age).
    pub async fn abandon(&mut self) -> Result<(), BackendError> {
        if self.in_client_tx {
            self.in_client_tx = false;
            self.simple(CLOSE).await?;
        }
        Ok(())
    }

    /// Runs one statement with the auditor's parameters and formats, inside
    /// the endpoint's read-only transaction. The endpoint's own statements
    /// travel in the same round trip: the transaction opened before it, the
    /// limits set again after it, and (for a statement on its own) the
    /// rollback after that.
    pub async fn execute(
        &mut self,
        sql: &str,
        param_types: &[u32],
        params: &[Option<Bytes>],
        param_formats: &[i16],
        result_formats: &[i16],
    ) -> Result<(Outcome, TxChange), BackendError> {
        self.notices.clear();
        let control = crate::control::classify(sql);
        let (sql, asked_commit) = match &control {
            Control::Refused(m) => return Ok((refusal("0A000", m.clone()), TxChange::None)),
            Control::End { asked_commit } => ("ROLLBACK", *asked_commit),
            _ => (sql, false),
        };
        let opens = !self.in_client_tx;
        let begins = opens && control == Control::Begin;
        let ends = matches!(control, Control::End { .. });
        // After this statement the transaction is over (or never was the
        // auditor's): roll back in the same round trip.
        let closes = (opens && !begins) || (!opens && ends);
        let buf = self.conn.write_buf();
        if opens {
            frontend::query(OPEN, buf).map_err(encode)?;
        }
        frontend::parse("", sql, param_types.iter().copied(), buf).map_err(encode)?;
        let bound = frontend::bind(
            "",
            "",
            param_formats.iter().copied(),
            params.iter(),
            |p, out| match p {
                Some(b) => {
                    out.extend_from_slice(b);
                    Ok(IsNull::No)
                }
                None => Ok(IsNull::Yes),
            },
            result_formats.iter().copied(),
            buf,
        );
        if bound.is_err() {
            return Err(BackendError::Protocol("could not encode Bind".into()));
        }
        frontend::describe(b'P', "", buf).map_err(encode)?;
        frontend::execute("", 0, buf).map_err(encode)?;
        if !closes {
            // Still in the auditor's transaction: the limits again, whatever
            // the statement set.
            frontend::parse("", &self.limits, std::iter::empty(), buf).map_err(encode)?;
            frontend::bind(
                "",
                "",
                std::iter::empty(),
                std::iter::empty::<Option<Bytes>>(),
                |_: Option<Bytes>, _| Ok(IsNull::Yes),
                std::iter::empty(),
                buf,
            )
            .map_err(|_| BackendError::Protocol("could not encode Bind".into()))?;
            frontend::execute("", 0, buf).map_err(encode)?;
        }
        frontend::sync(buf);
        if closes {
            frontend::query(CLOSE, buf).map_err(encode)?;
        }
        self.conn.flush().await?;
        if opens {
            self.read_own(OPEN).await?;
        }

        let (outcome, bytes, status) = self.read_results(begins).await?;
        if closes {
            self.read_own(CLOSE).await?;
            if status == b'I' && !ends {
                // The statement ended the endpoint's transaction itself.
                self.simple(RESET).await?;
            }
        }
        let mut outcome = outcome.unwrap_or(Outcome::Empty);
        if bytes > self.max_result_bytes {
            outcome = refusal(
                "54000",
                format!(
                    "the result is larger than the audit endpoint's limit of {} MiB; narrow the query (a position range, LIMIT)",
                    self.max_result_bytes >> 20
                ),
            );
        }
        if asked_commit && !matches!(outcome, Outcome::Error(_)) {
            self.notices.push(ErrorInfo::new(
                "NOTICE".into(),
                "00000".into(),
                "the audit endpoint ends every transaction with a rollback: nothing an auditor runs is committed".into(),
            ));
        }
        let change = if begins && status == b'T' {
            TxChange::Started
        } else if ends || (!opens && status == b'I') {
            TxChange::Ended
        } else {
            TxChange::None
        };
        match change {
            TxChange::Started => self.in_client_tx = true,
            TxChange::Ended => {
                self.in_client_tx = false;
                if !closes {
                    // The transaction ended some other way: reset as well.
                    self.simple(RESET).await?;
                }
            }
            TxChange::None => {}
        }
        Ok((outcome, change))
    }

    /// Reads what the server answers to the auditor's statement, up to its
    /// ReadyForQuery: the statement's outcome (rows kept up to the result
    /// limit), the result's size in bytes, and the transaction status.
    async fn read_results(
        &mut self,
        begins: bool,
    ) -> Result<(Option<Outcome>, usize, u8), BackendError> {
        let mut columns = None;
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        let mut outcome = None;
        let status;
        loop {
            match self.conn.next_message().await? {
                // Past the auditor's statement: the endpoint's own.
                Some(
                    Message::RowDescription(_) | Message::DataRow(_) | Message::CommandComplete(_),
                ) if outcome.is_some() => {}
                Some(Message::RowDescription(body)) => columns = Some(columns_of(&body)?),
                Some(Message::DataRow(body)) => {
                    // What a kept row costs in memory, not its payload
                    // alone: a million empty rows are not free.
                    bytes += body.buffer().len() + ROW_OVERHEAD;
                    if bytes <= self.max_result_bytes {
                        rows.push(BytesMut::from(body.buffer()));
                    }
                }
                Some(Message::CommandComplete(body)) => {
                    let tag = body.tag().map_err(protocol)?.to_string();
                    outcome = Some(match columns.take() {
                        Some(columns) => Outcome::Rows {
                            columns,
                            rows: std::mem::take(&mut rows),
                            tag,
                        },
                        None => Outcome::Command { tag },
                    });
                }
                Some(Message::EmptyQueryResponse) => outcome = Some(Outcome::Empty),
                Some(Message::ErrorResponse(body)) if outcome.is_none() => {
                    outcome = Some(Outcome::Error(error_info(&body)))
                }
                Some(Message::NoticeResponse(body)) if outcome.is_none() => {
                    let n = notice_info(&body);
                    // The auditor's BEGIN inside the endpoint's transaction.
                    if !(begins && n.code == "25001") {
                        self.notices.push(*n);
                    }
                }
                Some(m @ (Message::CopyOutResponse(_) | Message::CopyInResponse(_))) => {
                    outcome = Some(refusal(
                        "0A000",
                        "COPY is not available through the audit endpoint; use SELECT".into(),
                    ));
                    if let Message::CopyInResponse(_) = m {
                        // Postgres waits for data and ignores Sync until the copy ends.
                        let buf = self.conn.write_buf();
                        frontend::copy_fail("refused by the audit endpoint", buf)
                            .map_err(encode)?;
                        frontend::sync(buf);
                        self.conn.flush().await?;
                    }
                }
                Some(Message::ReadyForQuery(body)) => {
                    status = body.status();
                    break;
                }
                _ => {}
            }
        }
        Ok((outcome, bytes, status))
    }

    /// Reads the answer to one of the endpoint's own simple queries sent
    /// ahead of or after an auditor's statement; an error there is a failure
    /// of the session.
    async fn read_own(&mut self, sql: &str) -> Result<(), BackendError> {
        let mut error = None;
        loop {
            match self.conn.next_message().await? {
                Some(Message::ErrorResponse(body)) => {
                    error = Some(error_info(&body).message);
                }
                Some(Message::ReadyForQuery(_)) => break,
                _ => {}
            }
        }
        match error {
            Some(e) => Err(BackendError::Protocol(format!("{sql}: {e}"))),
            None => Ok(()),
        }
    }

    /// Runs the endpoint's own statements; an error is a failure of the session.
    async fn simple(&mut self, sql: &str) -> Result<(), BackendError> {
        frontend::query(sql, self.conn.write_buf()).map_err(encode)?;
        self.conn.flush().await?;
        self.read_own(sql).await
    }
}

fn encode(e: std::io::Error) -> BackendError {
    BackendError::Protocol(format!("encode: {e}"))
}

fn protocol(e: std::io::Error) -> BackendError {
    BackendError::Protocol(e.to_string())
}

fn columns_of(
    body: &postgres_protocol::message::backend::RowDescriptionBody,
) -> Result<Vec<Column>, BackendError> {
    body.fields()
        .map(|f| {
            Ok(Column {
                name: f.name().to_string(),
                table_oid: f.table_oid(),
                column_id: f.column_id(),
                type_oid: f.type_oid(),
                type_size: f.type_size(),
                type_modifier: f.type_modifier(),
            })
        })
        .collect()
        .map_err(protocol)
}

/// Postgres's error, field by field, for the auditor.
pub fn error_info(body: &ErrorResponseBody) -> Box<ErrorInfo> {
    info_of(body.fields())
}

fn notice_info(body: &postgres_protocol::message::backend::NoticeResponseBody) -> Box<ErrorInfo> {
    info_of(body.fields())
}

fn info_of(mut fields: postgres_protocol::message::backend::ErrorFields<'_>) -> Box<ErrorInfo> {
    let mut info = ErrorInfo::new("ERROR".into(), "XX000".into(), String::new());
    while let Ok(Some(f)) = fields.next() {
        let v = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            b'V' => info.severity = v,
            b'C' => info.code = v,
            b'M' => info.message = v,
            b'D' => info.detail = Some(v),
            b'H' => info.hint = Some(v),
            b'P' => info.position = Some(v),
            b'p' => info.internal_position = Some(v),
            b'q' => info.internal_query = Some(v),
            b'W' => info.where_context = Some(v),
            _ => {}
        }
    }
    Box::new(info)
}
